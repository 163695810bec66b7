/* Unicode helpers for the tokenizer (internal to common/tokenizer): UTF-8 decoding with
 * U+FFFD for invalid bytes, the character classes the pre-tokenizer regexes use, and NFC.
 *
 * The tables come from gen_unicode_tables.py (Python's unicodedata) as sorted range
 * arrays searched by bisection; ASCII is answered from a 128-entry table first, since
 * English text is almost all ASCII.
 */
#ifndef PD_TOKENIZER_UNICODE_H
#define PD_TOKENIZER_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    PD_UC_L = 1, /* \p{L} letter */
    PD_UC_N = 2, /* \p{N} number */
    PD_UC_S = 4, /* \s: Unicode White_Space (Oniguruma's \s) */
};

typedef struct {
    uint32_t lo, hi; /* inclusive code point range */
    uint32_t val;    /* class bits, combining class, or 1 */
} pd_uc_range;
typedef struct {
    uint32_t cp;
    uint32_t off, len; /* into pd_uc_decomp_pool */
} pd_uc_decomp;
typedef struct {
    uint32_t a, b, c; /* a + b compose to c */
} pd_uc_pair;

typedef struct {
    uint32_t lo, hi; /* code points lo, lo + step, ..., hi map to cp + delta (the runs are
                        disjoint intervals; one of step 2 may hold full mappings between) */
    uint32_t step;
    int32_t delta;
} pd_uc_case_run;
typedef struct {
    uint32_t cp, n; /* maps to out[0..n) */
    uint32_t out[3];
} pd_uc_case_full;

extern const uint8_t pd_uc_ascii_class[128]; /* PD_UC_* bits of code points < 128 */
extern const pd_uc_range pd_uc_class_ranges[];
extern const unsigned pd_uc_class_count;
extern const pd_uc_range pd_uc_ccc_ranges[];
extern const unsigned pd_uc_ccc_count;
extern const pd_uc_decomp pd_uc_decomps[];
extern const unsigned pd_uc_decomp_count;
extern const uint32_t pd_uc_decomp_pool[];
extern const pd_uc_pair pd_uc_comps[];
extern const unsigned pd_uc_comp_count;
extern const pd_uc_range pd_uc_nfc_unsafe[];
extern const unsigned pd_uc_nfc_unsafe_count;
extern const pd_uc_case_run pd_uc_upper_runs[], pd_uc_lower_runs[], pd_uc_title_runs[];
extern const unsigned pd_uc_upper_run_count, pd_uc_lower_run_count, pd_uc_title_run_count;
extern const pd_uc_case_full pd_uc_upper_full[], pd_uc_lower_full[], pd_uc_title_full[];
extern const unsigned pd_uc_upper_full_count, pd_uc_lower_full_count, pd_uc_title_full_count;
extern const pd_uc_range pd_uc_cased[], pd_uc_case_ignorable[];
extern const unsigned pd_uc_cased_count, pd_uc_case_ignorable_count;

/* Decodes one code point at s[0..n) (n >= 1). Returns the number of bytes consumed (>= 1)
 * and sets *cp; an invalid or truncated sequence consumes its maximal invalid prefix (as
 * WHATWG / Rust from_utf8_lossy do) and yields 0xFFFD with *valid = false. */
size_t pd_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp, bool *valid);
/* Writes cp as UTF-8 into out (room for 4 bytes); returns the byte count. */
size_t pd_utf8_encode(uint32_t cp, uint8_t *out);
/* Length of the longest prefix of s that is complete in the sense of UTF-8 streaming:
 * everything except a trailing truncated-but-so-far-valid sequence (0..3 bytes held). */
size_t pd_utf8_complete_prefix(const uint8_t *s, size_t n);
/* Appends the lossy decoding of s[0..n) (invalid sequences -> U+FFFD) to out, which must
 * have room for 3 * n bytes. Returns bytes written. */
size_t pd_utf8_lossy(const uint8_t *s, size_t n, uint8_t *out);

/* PD_UC_* bits of cp. */
unsigned pd_uc_class(uint32_t cp);

enum { PD_UC_UPPER, PD_UC_LOWER, PD_UC_TITLE };
/* Python's full case mapping of cp (str.upper / lower / title of the one character, so
 * U+00DF upper is "SS"): writes 1 to 3 code points to out and returns their count. */
size_t pd_uc_case(uint32_t cp, int mode, uint32_t out[3]);
/* The Cased property (Python's: cased characters decide str.title()'s word starts). */
bool pd_uc_is_cased(uint32_t cp);
/* The Case_Ignorable property (apostrophes, combining marks, modifiers: what lower() skips
 * around a capital sigma to decide whether it ends a word). */
bool pd_uc_is_case_ignorable(uint32_t cp);

/* NFC of s[0..n) (valid UTF-8 expected; invalid bytes become U+FFFD). Returns a malloc'd
 * buffer in *out with length *out_len, or sets *out = NULL when the text is already in NFC
 * by the quick check (the common case, no allocation). Negative status on out of memory. */
int pd_uc_nfc(const uint8_t *s, size_t n, uint8_t **out, size_t *out_len);

#endif
