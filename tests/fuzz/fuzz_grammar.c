/* libFuzzer target for common/grammar's front ends: the first input byte picks the compiler
 * (JSON Schema, regex, EBNF grammar, choice; bit 0x80 adds a guided_whitespace_pattern taken
 * from the input's last line), the rest is its text. Every spec that compiles is then driven:
 * masks are computed along a walk that feeds the input's bytes as tokens of a 300-token
 * vocabulary (all bytes, some multi-byte tokens), and every mask bit must agree with
 * pd_gmatcher_allows; EOS is in the mask exactly when accepting. A refusal must have a message.
 * A matcher that stops as too ambiguous (pd_gmatcher_too_ambiguous) ends the walk. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"
#include "util/status.h"

static pd_gvocab *g_v;
static int32_t g_n;

static void init(void)
{
    static const char *multi[] = {"{\"", "\":", "\",", "\"}",  "true", "null",     "12",
                                  "ab",  "\\u", "  ",  ", \"", "[\"",  "\xc3\xa9", "-1",
                                  "0.",  "e+",  "\"a", "::=",  "\n",   "::"};
    int nm = (int)(sizeof multi / sizeof *multi);
    g_n = 256 + nm + 1;
    const uint8_t **b = calloc((size_t)g_n, sizeof *b);
    uint32_t *l = calloc((size_t)g_n, sizeof *l);
    static uint8_t bytes[256];
    for (int i = 0; i < 256; i++) {
        bytes[i] = (uint8_t)i;
        b[i] = &bytes[i];
        l[i] = 1;
    }
    for (int i = 0; i < nm; i++) {
        b[256 + i] = (const uint8_t *)multi[i];
        l[256 + i] = (uint32_t)strlen(multi[i]);
    }
    b[g_n - 1] = (const uint8_t *)"</s>";
    l[g_n - 1] = 4;
    int32_t eos = g_n - 1;
    if (pd_gvocab_create(g_n, b, l, NULL, &eos, 1, &g_v) < 0) abort();
    free(b);
    free(l);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!g_v) init();
    if (size < 1 || size > 4096) return 0;
    static const pd_gspec_kind kinds[4] = {PD_GSPEC_JSON_SCHEMA, PD_GSPEC_REGEX, PD_GSPEC_GRAMMAR,
                                           PD_GSPEC_CHOICE};
#ifdef FUZZ_GRAMMAR_KIND /* one compiler per target: 0 schema, 1 regex, 2 EBNF */
    pd_gspec_kind kind = kinds[FUZZ_GRAMMAR_KIND];
#else
    pd_gspec_kind kind = kinds[data[0] & 3];
#endif
    char *text = malloc(size);
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;
    size_t len = size - 1;
    char *ws = NULL;
    if ((data[0] & 0x80) && kind == PD_GSPEC_JSON_SCHEMA) {
        char *nl = memchr(text, '\n', len);
        if (nl) {
            *nl = 0;
            ws = nl + 1;
            len = (size_t)(nl - text);
        }
    }
    pd_gspec spec = {kind, text, len, ws, false};
    pd_grammar *g = NULL;
    pd_gerr err;
    if (pd_grammar_compile(g_v, &spec, &g, &err) < 0) {
        if (!pd_last_error()[0] || !err.msg[0]) abort();
        free(text);
        return 0;
    }
    pd_gmatcher *m;
    if (pd_gmatcher_create(g, &m) < 0) abort();
    uint32_t bits[(300 + 31) / 32 + 1];
    /* an ambiguous grammar may stop the matcher (PD_GRAMMAR_MAX_STACKS parses): then every
     * call refuses, and the walk ends there */
    for (size_t i = 1; i < size && i < 64 && !pd_gmatcher_is_terminated(m); i++) {
        if (pd_gmatcher_fill_mask(m, bits) < 0) {
            if (pd_gmatcher_too_ambiguous(m)) break;
            abort();
        }
        for (int32_t t = 0; t < g_n; t++) {
            bool bit = bits[t >> 5] >> (t & 31) & 1;
            if (bit != pd_gmatcher_allows(m, t) && !pd_gmatcher_too_ambiguous(m)) abort();
        }
        if (pd_gmatcher_too_ambiguous(m)) break;
        if ((bool)(bits[(g_n - 1) >> 5] >> ((g_n - 1) & 31) & 1) != pd_gmatcher_is_accepting(m))
            abort();
        /* follow the input when allowed, else the first allowed token */
        int32_t t = data[i];
        if (!(bits[t >> 5] >> (t & 31) & 1)) {
            t = -1;
            for (int32_t k = 0; k < g_n && t < 0; k++)
                if (bits[k >> 5] >> (k & 31) & 1) t = k;
        }
        if (t < 0) break;
        if (pd_gmatcher_accept_token(m, t) < 0 && !pd_gmatcher_too_ambiguous(m)) abort();
    }
    pd_gmatcher_free(m);
    pd_grammar_unref(g);
    free(text);
    return 0;
}
