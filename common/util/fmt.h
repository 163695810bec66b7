/* Number formatting shared by the JSON API and /metrics.
 *
 * pd_fmt_double writes a double as Python's repr(float) does: the shortest decimal string that
 * reads back to the same double, always with a '.' or an exponent ("1.0", "0.125", "1e-05",
 * "1.5e+16"), fixed notation for decimal exponents -4 <= e < 16. The API contract prints float
 * values in messages this way, and JSON float output uses the same shortest digits.
 * pd_fmt_go_float writes a Prometheus sample or `le` value as the Python client does (Go style):
 * repr, except that values >= 1e6 written with 7 or more integer digits become "1e+06", and
 * infinities become "+Inf"/"-Inf".
 * pd_str_copy is the bounded copy of a message into a fixed buffer. */
#ifndef PD_UTIL_FMT_H
#define PD_UTIL_FMT_H

#include <stddef.h>

/* Both write at most n bytes including the NUL (32 always suffices) and return the length. */
size_t pd_fmt_double(double v, char *buf, size_t n);
size_t pd_fmt_go_float(double v, char *buf, size_t n);

/* Copies src (NULL: "") into dst of n > 0 bytes, cut to fit (never inside a UTF-8 sequence) and
 * NUL-terminated, for messages kept in fixed buffers. Returns the bytes copied. */
size_t pd_str_copy(char *dst, size_t n, const char *src);

#endif
