/* Hand-written matchers for the pre-tokenizer split regexes of the supported models.
 *
 * Hugging Face compiles these with Oniguruma (leftmost-first alternation, backtracking).
 * Instead of a regex engine we implement the three published patterns directly over code
 * points and Unicode classes; each function below quotes its pattern and follows its
 * alternatives in order, reproducing the backtracking results (e.g. "\s+(?!\S)" leaves the
 * last space of a run for the next word). Patterns:
 *   RX_GPT2   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   RX_LLAMA3 (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *             ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *   RX_QWEN2  as RX_LLAMA3 with \p{N} instead of \p{N}{1,3}
 */
#include "tokenizer/tok_internal.h"
#include "tokenizer/unicode.h"

/* Code point at s[i] (valid UTF-8) and its length. */
static inline uint32_t cp_at(const uint8_t *s, size_t n, size_t i, size_t *len)
{
    if (s[i] < 0x80) {
        *len = 1;
        return s[i];
    }
    uint32_t cp;
    bool ok;
    *len = pd_utf8_decode(s + i, n - i, &cp, &ok);
    return cp;
}

static inline unsigned cls_at(const uint8_t *s, size_t n, size_t i, size_t *len, uint32_t *cpo)
{
    uint32_t cp = cp_at(s, n, i, len);
    if (cpo) *cpo = cp;
    return pd_uc_class(cp);
}

/* [^\s\p{L}\p{N}] */
#define IS_OTHER(c) (((c) & (PD_UC_L | PD_UC_N | PD_UC_S)) == 0)

static size_t run_of(const uint8_t *s, size_t n, size_t i, unsigned want, size_t max_chars)
{
    size_t k = 0, len;
    while (i < n && k < max_chars) {
        unsigned c = cls_at(s, n, i, &len, NULL);
        if (!(c & want)) break;
        i += len;
        k++;
    }
    return i;
}

static size_t run_other(const uint8_t *s, size_t n, size_t i)
{
    size_t len;
    while (i < n) {
        unsigned c = cls_at(s, n, i, &len, NULL);
        if (!IS_OTHER(c)) break;
        i += len;
    }
    return i;
}

static inline int fold(uint32_t cp, bool ci)
{
    if (!ci) return (int)cp;
    if (cp >= 'A' && cp <= 'Z') return (int)(cp + 32);
    if (cp == 0x17F) /* LATIN SMALL LETTER LONG S case-folds to 's' */
        return 's';
    return (int)cp;
}

/* 's|'t|'re|'ve|'m|'ll|'d at s[i] == '\''; returns end or 0. */
static size_t contraction(const uint8_t *s, size_t n, size_t i, bool ci)
{
    size_t l1, l2;
    if (i + 1 >= n) return 0;
    int a = fold(cp_at(s, n, i + 1, &l1), ci);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 1 + l1;
    if (i + 1 + l1 >= n) return 0;
    int b = fold(cp_at(s, n, i + 1 + l1, &l2), ci);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        return i + 1 + l1 + l2;
    return 0;
}

/* Whitespace alternatives shared by all patterns. with_newline_rule adds \s*[\r\n]+ first. */
static size_t whitespace(const uint8_t *s, size_t n, size_t i, bool with_newline_rule)
{
    size_t j = i, len, last_nl = 0, nchars = 0, last_start = i;
    while (j < n) {
        uint32_t cp;
        unsigned c = cls_at(s, n, j, &len, &cp);
        if (!(c & PD_UC_S)) break;
        last_start = j;
        j += len;
        nchars++;
        if (cp == '\r' || cp == '\n') last_nl = j;
    }
    if (nchars == 0) return 0;
    if (with_newline_rule && last_nl) return last_nl; /* \s*[\r\n]+ */
    if (j == n) return j;                             /* \s+(?!\S) at the end of the text */
    if (nchars >= 2) return last_start; /* \s+(?!\S): leave the last space to the next word */
    return j;                           /* \s+ */
}

static size_t match_gpt2(const uint8_t *s, size_t n, size_t i)
{
    size_t len, len2;
    uint32_t cp;
    unsigned c = cls_at(s, n, i, &len, &cp);
    if (cp == '\'') {
        size_t e = contraction(s, n, i, false);
        if (e) return e;
    }
    size_t k = i;
    unsigned c2 = c;
    if (cp == ' ' && i + 1 < n) {
        c2 = cls_at(s, n, i + 1, &len2, NULL);
        k = i + 1;
    }
    if (c2 & PD_UC_L) return run_of(s, n, k, PD_UC_L, SIZE_MAX);
    if (c2 & PD_UC_N) return run_of(s, n, k, PD_UC_N, SIZE_MAX);
    if (IS_OTHER(c2) && (k != i || IS_OTHER(c))) return run_other(s, n, k);
    if (c & PD_UC_S) return whitespace(s, n, i, false);
    return i + len;
}

static size_t match_llama3(const uint8_t *s, size_t n, size_t i, size_t max_digits)
{
    size_t len, len2;
    uint32_t cp;
    unsigned c = cls_at(s, n, i, &len, &cp);
    if (cp == '\'') {
        size_t e = contraction(s, n, i, true);
        if (e) return e;
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (c & PD_UC_L) return run_of(s, n, i, PD_UC_L, SIZE_MAX);
    if (!(c & PD_UC_N) && cp != '\r' && cp != '\n' && i + len < n) {
        unsigned c2 = cls_at(s, n, i + len, &len2, NULL);
        if (c2 & PD_UC_L) return run_of(s, n, i + len, PD_UC_L, SIZE_MAX);
    }
    /* \p{N}{1,max} */
    if (c & PD_UC_N) return run_of(s, n, i, PD_UC_N, max_digits);
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    size_t k = SIZE_MAX;
    if (cp == ' ' && i + 1 < n && IS_OTHER(cls_at(s, n, i + 1, &len2, NULL)))
        k = i + 1;
    else if (IS_OTHER(c))
        k = i;
    if (k != SIZE_MAX) {
        size_t e = run_other(s, n, k);
        while (e < n && (s[e] == '\r' || s[e] == '\n')) e++;
        return e;
    }
    if (c & PD_UC_S) return whitespace(s, n, i, true);
    return i + len;
}

size_t pd_tok_rx_match(int regex, const uint8_t *s, size_t n, size_t i)
{
    switch (regex) {
    case RX_GPT2: return match_gpt2(s, n, i);
    case RX_LLAMA3: return match_llama3(s, n, i, 3);
    default: return match_llama3(s, n, i, 1);
    }
}
