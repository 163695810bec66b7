/* A growable byte buffer for building HTTP bodies and SSE events (prefix pd_sb_).
 *
 * Design: the buffer only grows (geometrically) and is reused with pd_sb_reset, so a request
 * that streams many tokens allocates only while its longest event is still growing. An
 * allocation failure is sticky: the buffer keeps its old contents and pd_sb_failed() says so,
 * so that callers build a whole event and check once. */
#ifndef PD_SCHEDULER_SBUF_H
#define PD_SCHEDULER_SBUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    char *p; /* (cap,) bytes, NUL-terminated at len when non-NULL */
    size_t len;
    size_t cap;
    bool failed;
} pd_sb;

void pd_sb_free(pd_sb *b);
void pd_sb_reset(pd_sb *b);
bool pd_sb_failed(const pd_sb *b);
void pd_sb_add(pd_sb *b, const void *data, size_t len);
void pd_sb_str(pd_sb *b, const char *s);
void pd_sb_printf(pd_sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal with quotes: escapes '"', '\\' and control characters; '/' and
 * non-ASCII stay raw (docs/api.md §0). */
void pd_sb_json_str(pd_sb *b, const char *s, size_t len);
/* A JSON string literal as Python's json.dumps writes it by default (ensure_ascii): every
 * character outside printable ASCII as \uXXXX (lowercase hex; surrogate pairs above U+FFFF).
 * s must be valid UTF-8. */
void pd_sb_json_str_ascii(pd_sb *b, const char *s, size_t len);
/* A double as Python repr (pd_fmt_double). */
void pd_sb_double(pd_sb *b, double v);

#endif
