/* Unit tests for common/tokenizer: golden ids/text from the independent JS reference
 * (@huggingface/tokenizers via tests/reference/tok_ref.mjs) over the real Llama-2,
 * Llama-3 and Qwen3 tokenizer files in the npm cache, incremental detokenization against
 * whole decode (including byte-by-byte split UTF-8), invalid UTF-8, a synthetic byte-level
 * BPE as pd-mkmodel writes it, and malformed tokenizer.json files.
 *
 * The real tokenizer files live in $PD_NPM_CACHE (default $PD_SOURCE_ROOT/.cache/npm,
 * filled by tests/npm_cache.sh); the tests that need them skip when it is absent. */
#include "harness.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "util/status.h"

static const char *const MODELS[] = {"llama2", "llama3", "qwen3"};

static const char *npm_cache(void)
{
    static char buf[1024];
    const char *c = getenv("PD_NPM_CACHE");
    if (c && *c) return c;
    const char *root = getenv("PD_SOURCE_ROOT");
    snprintf(buf, sizeof buf, "%s/.cache/npm", root && *root ? root : ".");
    return buf;
}

static bool model_dir(const char *model, char *buf, size_t n)
{
    return pdt_npm_tokenizer_dir(model, buf, n) != NULL;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* The real tokenizers, each loaded once per process (a load parses 2-11 MB of JSON) and
 * freed at exit; tests borrow them. */
static pd_tok *g_real[3];

static void free_real(void)
{
    for (int i = 0; i < 3; i++) pd_tok_free(g_real[i]);
}

/* Returns the borrowed real tokenizer; NULL with *skip when the npm cache is missing, NULL
 * without it when loading failed (message printed). */
static pd_tok *load_real(const char *model, bool *skip)
{
    char dir[1024];
    int k = 0;
    while (k < 2 && strcmp(MODELS[k], model) != 0) k++;
    *skip = false;
    if (g_real[k]) return g_real[k];
    if (!model_dir(model, dir, sizeof dir)) {
        *skip = true;
        return NULL;
    }
    if (pd_tok_load(dir, &g_real[k]) < 0) {
        printf("    load %s: %s\n", dir, pd_last_error());
        return NULL;
    }
    static bool registered;
    if (!registered) {
        atexit(free_real);
        registered = true;
    }
    return g_real[k];
}

/* Golden sets: "" = texts.json (hand-written cases), "_random" = random.json. */
static const char *const SETS[][2] = {{"", "texts"}, {"_random", "random"}};

static json_t *load_golden_set(const char *model, const char *set)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/%s%s.json", pdt_data_dir(), model, set);
    json_error_t err;
    json_t *g = json_load_file(path, JSON_ALLOW_NUL, &err);
    if (!g) printf("    %s: %s\n", path, err.text);
    return g;
}

static bool ids_equal(const int32_t *ids, size_t n, json_t *want)
{
    if (json_array_size(want) != n) return false;
    for (size_t i = 0; i < n; i++)
        if (json_integer_value(json_array_get(want, i)) != ids[i]) return false;
    return true;
}

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
    printf("    %s:", what);
    for (size_t i = 0; i < n && i < 64; i++) printf(" %d", ids[i]);
    printf("\n");
}

/* Valid UTF-8 check for deltas (no split characters). */
static bool utf8_valid(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned b = p[i], need;
        if (b < 0x80) {
            i++;
            continue;
        }
        if (b >= 0xC2 && b <= 0xDF)
            need = 1;
        else if (b >= 0xE0 && b <= 0xEF)
            need = 2;
        else if (b >= 0xF0 && b <= 0xF4)
            need = 3;
        else
            return false;
        for (unsigned k = 1; k <= need; k++)
            if (i + k >= n || (p[i + k] & 0xC0) != 0x80) return false;
        i += need + 1;
    }
    return true;
}

/* Runs ids through a detokenizer and checks that every delta is whole UTF-8 and that the
 * concatenation equals pd_tok_decode. Returns false (after printing) on mismatch. */
static bool detok_matches(const pd_tok *t, const int32_t *ids, size_t n, bool skip)
{
    char *full;
    size_t full_len;
    if (pd_tok_decode(t, ids, n, skip, &full, &full_len) < 0) {
        printf("    decode: %s\n", pd_last_error());
        return false;
    }
    pd_detok *d;
    if (pd_detok_create(t, skip, NULL, 0, &d) < 0) {
        free(full);
        return false;
    }
    char *cat = malloc(full_len * 2 + 64);
    size_t cl = 0, cap = full_len * 2 + 64;
    bool ok = true;
    for (size_t i = 0; i <= n && ok; i++) {
        const char *delta;
        size_t dl;
        int rc = i < n ? pd_detok_push(d, ids[i], &delta, &dl) : pd_detok_flush(d, &delta, &dl);
        if (rc < 0 || !utf8_valid(delta, dl) || cl + dl > cap) {
            printf("    detok step %zu: rc %d, delta of %zu bytes not whole UTF-8 or too long\n", i,
                   rc, dl);
            ok = false;
            break;
        }
        memcpy(cat + cl, delta, dl);
        cl += dl;
    }
    if (ok && (cl != full_len || memcmp(cat, full, cl) != 0)) {
        printf("    detok \"%.*s\" != decode \"%s\"\n", (int)cl, cat, full);
        ok = false;
    }
    size_t tl;
    const char *tt = pd_detok_text(d, &tl);
    if (ok && (tl != full_len || memcmp(tt, full, tl) != 0)) {
        printf("    pd_detok_text differs from decode\n");
        ok = false;
    }
    free(cat);
    free(full);
    pd_detok_free(d);
    return ok;
}

/* ---- golden tests against the JS reference ------------------------------------------- */

static json_t *load_golden(const char *model)
{
    return load_golden_set(model, "");
}

static int golden_model(const char *model, const char *set, int *n_cases)
{
    bool skip;
    pd_tok *t = load_real(model, &skip);
    if (skip) return 1;
    if (!t) return -1;
    json_t *g = load_golden_set(model, set);
    if (!g) {
        return -1;
    }
    json_t *cases = json_object_get(g, "cases");
    int fails = 0;
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        const char *text = json_string_value(json_object_get(c, "text"));
        size_t len = json_string_length(json_object_get(c, "text"));
        for (int special = 0; special < 2; special++) {
            int32_t *ids;
            size_t n;
            if (pd_tok_encode(t, text, len, special, &ids, &n) < 0) {
                printf("    %s case %zu: encode: %s\n", model, i, pd_last_error());
                fails++;
                continue;
            }
            json_t *want = json_object_get(c, special ? "ids_special" : "ids");
            if (!ids_equal(ids, n, want)) {
                printf("    %s case %zu (add_special=%d) \"%.60s\": ids differ\n", model, i,
                       special, text);
                print_ids("got ", ids, n);
                char *w = json_dumps(want, JSON_COMPACT);
                printf("    want: %.400s\n", w);
                free(w);
                fails++;
            }
            if (special) {
                for (int skip_sp = 0; skip_sp < 2; skip_sp++) {
                    char *s;
                    size_t sl;
                    json_t *jw = json_object_get(c, skip_sp ? "decoded_skip" : "decoded");
                    const char *wt = json_string_value(jw);
                    size_t wl = json_string_length(jw);
                    if (pd_tok_decode(t, ids, n, skip_sp, &s, &sl) < 0) {
                        fails++;
                        continue;
                    }
                    if (sl != wl || memcmp(s, wt, wl) != 0) {
                        printf("    %s case %zu decode(skip=%d): \"%s\" != \"%s\"\n", model, i,
                               skip_sp, s, wt);
                        fails++;
                    }
                    free(s);
                    if (!detok_matches(t, ids, n, skip_sp)) {
                        printf("    %s case %zu: incremental decode differs\n", model, i);
                        fails++;
                    }
                }
            }
            free(ids);
        }
        (*n_cases)++;
    }
    json_decref(g);
    return fails ? -1 : 0;
}

TEST(golden_llama2)
{
    int n = 0, rc = golden_model("llama2", "", &n);
    if (rc == 1) SKIP("npm cache missing (tests/npm_cache.sh)");
    ASSERT_EQ_INT(rc, 0);
    ASSERT(n >= 40);
    n = 0;
    ASSERT_EQ_INT(golden_model("llama2", "_random", &n), 0);
    ASSERT(n >= 400);
}

TEST(golden_llama3)
{
    int n = 0, rc = golden_model("llama3", "", &n);
    if (rc == 1) SKIP("npm cache missing (tests/npm_cache.sh)");
    ASSERT_EQ_INT(rc, 0);
    ASSERT(n >= 40);
    n = 0;
    ASSERT_EQ_INT(golden_model("llama3", "_random", &n), 0);
    ASSERT(n >= 400);
}

TEST(golden_qwen3)
{
    int n = 0, rc = golden_model("qwen3", "", &n);
    if (rc == 1) SKIP("npm cache missing (tests/npm_cache.sh)");
    ASSERT_EQ_INT(rc, 0);
    ASSERT(n >= 40);
    n = 0;
    ASSERT_EQ_INT(golden_model("qwen3", "_random", &n), 0);
    ASSERT(n >= 400);
}

/* Re-runs the node reference and compares with the committed goldens (catches drift of
 * either the reference or the committed files). */
TEST(golden_files_match_node_reference)
{
    if (system("node --version >/dev/null 2>&1") != 0) SKIP("node not available");
    const char *root = getenv("PD_SOURCE_ROOT");
    if (!root) SKIP("PD_SOURCE_ROOT not set");
    for (size_t m = 0; m < 3; m++) {
        for (size_t k = 0; k < 2; k++) {
            char dir[1024], cmd[4096], out[1024];
            if (!model_dir(MODELS[m], dir, sizeof dir))
                SKIP("npm cache missing (tests/npm_cache.sh)");
            snprintf(out, sizeof out, "%s/%s%s.json", pdt_tmp_dir(), MODELS[m], SETS[k][0]);
            snprintf(cmd, sizeof cmd,
                     "PD_NPM_CACHE='%s' node '%s/tests/reference/tok_ref.mjs' '%s' "
                     "'%s/tokenizer/%s.json' '%s'",
                     npm_cache(), root, dir, pdt_data_dir(), SETS[k][1], out);
            int rc = system(cmd);
            ASSERT_MSG(rc == 0, "%s failed (%d)", cmd, rc);
            json_error_t err;
            json_t *fresh = json_load_file(out, JSON_ALLOW_NUL, &err);
            json_t *committed = load_golden_set(MODELS[m], SETS[k][0]);
            ASSERT(fresh && committed);
            int eq = json_equal(fresh, committed);
            json_decref(fresh);
            json_decref(committed);
            ASSERT_MSG(eq,
                       "%s%s: committed golden differs from the node reference; "
                       "regenerate with the commands in tests/data/tokenizer/README.md",
                       MODELS[m], SETS[k][0]);
        }
    }
}

/* ---- incremental decoding ------------------------------------------------------------ */

/* Every text of the goldens as single-byte tokens (byte-level chars or <0xNN>), so each
 * multi-byte character is split over several pushes. */
TEST(detok_byte_by_byte_split_utf8)
{
    int tested = 0;
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
        ASSERT(t);
        json_t *g = load_golden(MODELS[m]);
        ASSERT(g);
        /* byte -> id */
        int32_t byte_id[256];
        int32_t sp = pd_tok_token_to_id(t, "<0x41>", 6);
        for (int b = 0; b < 256; b++) {
            char name[8];
            if (sp >= 0) {
                snprintf(name, sizeof name, "<0x%02X>", b);
                byte_id[b] = pd_tok_token_to_id(t, name, 6);
            } else { /* GPT-2 byte-level alphabet */
                int k = 0;
                for (int c = 0; c < b; c++)
                    if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE)) k++;
                bool pr = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
                unsigned cp = pr ? (unsigned)b : 0x100u + (unsigned)k;
                char u[4];
                size_t ul = cp < 0x80 ? 1 : 2;
                if (cp < 0x80)
                    u[0] = (char)cp;
                else {
                    u[0] = (char)(0xC0 | (cp >> 6));
                    u[1] = (char)(0x80 | (cp & 0x3F));
                }
                byte_id[b] = pd_tok_token_to_id(t, u, ul);
            }
            ASSERT_MSG(byte_id[b] >= 0, "%s: no token for byte %d", MODELS[m], b);
        }
        json_t *cases = json_object_get(g, "cases");
        for (size_t i = 0; i < json_array_size(cases); i++) {
            json_t *jt = json_object_get(json_array_get(cases, i), "text");
            const char *text = json_string_value(jt);
            size_t len = json_string_length(jt);
            int32_t *ids = malloc((len + 1) * sizeof *ids);
            for (size_t k = 0; k < len; k++) ids[k] = byte_id[(unsigned char)text[k]];
            bool ok = detok_matches(t, ids, len, true);
            /* Whole valid text: the decode gives the text back (SentencePiece's Strip
             * decoder drops one leading space). */
            char *s;
            size_t sl, cut = (sp >= 0 && len > 0 && text[0] == ' ') ? 1 : 0;
            ASSERT_OK(pd_tok_decode(t, ids, len, true, &s, &sl));
            bool same = sl == len - cut && memcmp(s, text + cut, len - cut) == 0;
            free(s);
            free(ids);
            ASSERT_MSG(ok, "%s case %zu: byte-by-byte incremental decode differs", MODELS[m], i);
            ASSERT_MSG(same, "%s case %zu: bytes did not decode back to the text", MODELS[m], i);
            tested++;
        }
        json_decref(g);
    }
    ASSERT(tested > 100);
}

/* Invalid byte sequences in generated ids: U+FFFD, never a split character, and the same
 * text incrementally as in one piece. */
TEST(detok_invalid_bytes)
{
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
        ASSERT(t);
        bool spm = pd_tok_token_to_id(t, "<0xE6>", 6) >= 0;
        int32_t a = pd_tok_token_to_id(t,
                                       spm ? "\xe2\x96\x81"
                                             "a"
                                           : "a",
                                       spm ? 4 : 1);
        int32_t e6, x97, ff;
        if (spm) {
            e6 = pd_tok_token_to_id(t, "<0xE6>", 6);
            x97 = pd_tok_token_to_id(t, "<0x97>", 6);
            ff = pd_tok_token_to_id(t, "<0xFF>", 6);
        } else { /* byte-level chars of 0xE6, 0x97, 0xFF: æ, Ĺ (0x97 is unprintable), ÿ */
            e6 = pd_tok_token_to_id(t, "\xc3\xa6", 2);
            x97 = pd_tok_token_to_id(t, "\xc4\xb9", 2);
            ff = pd_tok_token_to_id(t, "\xc3\xbf", 2);
        }
        ASSERT(a >= 0 && e6 >= 0 && x97 >= 0 && ff >= 0);
        int32_t seq[] = {e6, x97, a, ff, a, e6};
        char *s;
        size_t sl;
        ASSERT_OK(pd_tok_decode(t, seq, 6, false, &s, &sl));
        /* ByteLevel: from_utf8_lossy -> one U+FFFD per maximal invalid subpart;
         * ByteFallback (Rust): one U+FFFD per byte of an invalid run. */
        const char *want = spm ? "\xef\xbf\xbd\xef\xbf\xbd a\xef\xbf\xbd a\xef\xbf\xbd"
                               : "\xef\xbf\xbd"
                                 "a\xef\xbf\xbd"
                                 "a\xef\xbf\xbd";
        ASSERT_STR_EQ(s, want);
        free(s);
        ASSERT(detok_matches(t, seq, 6, false));
        /* Out of range ids are rejected, the detokenizer is unchanged. */
        pd_detok *d;
        ASSERT_OK(pd_detok_create(t, true, NULL, 0, &d));
        const char *delta;
        size_t dl;
        ASSERT_ERR(pd_detok_push(d, pd_tok_vocab_size(t), &delta, &dl), PD_EINVAL, "out of range");
        ASSERT_ERR(pd_detok_push(d, -1, &delta, &dl), PD_EINVAL, "out of range");
        ASSERT_OK(pd_detok_push(d, a, &delta, &dl));
        pd_detok_free(d);
        int32_t bad_ids[] = {a, -5};
        ASSERT_ERR(pd_tok_decode(t, bad_ids, 2, false, &s, &sl), PD_EINVAL, "out of range");
    }
}

/* With a prompt, the first generated token keeps its leading space (SentencePiece strips
 * only at the start of the whole text) and the deltas are what the output adds. */
TEST(detok_with_prompt_context)
{
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
        ASSERT(t);
        const char *prompt = "The capital of France is", *out = " Paris. It is big.";
        int32_t *p, *o;
        size_t np, no;
        ASSERT_OK(pd_tok_encode(t, prompt, strlen(prompt), true, &p, &np));
        ASSERT_OK(pd_tok_encode(t, out, strlen(out), false, &o, &no));
        /* Generated ids for " Paris..." are the continuation ids of the full text. */
        char full[256];
        snprintf(full, sizeof full, "%s%s", prompt, out);
        int32_t *f;
        size_t nf;
        ASSERT_OK(pd_tok_encode(t, full, strlen(full), true, &f, &nf));
        ASSERT(nf > np);
        pd_detok *d;
        ASSERT_OK(pd_detok_create(t, true, f, np, &d));
        char got[256] = "";
        size_t gl = 0;
        for (size_t i = np; i <= nf; i++) {
            const char *delta;
            size_t dl;
            if (i < nf)
                ASSERT_OK(pd_detok_push(d, f[i], &delta, &dl));
            else
                ASSERT_OK(pd_detok_flush(d, &delta, &dl));
            memcpy(got + gl, delta, dl);
            gl += dl;
        }
        got[gl] = 0;
        char *whole, *head;
        ASSERT_OK(pd_tok_decode(t, f, nf, true, &whole, NULL));
        ASSERT_OK(pd_tok_decode(t, f, np, true, &head, NULL));
        ASSERT(strncmp(whole, head, strlen(head)) == 0);
        ASSERT_STR_EQ(got, whole + strlen(head));
        ASSERT(got[0] == ' ' || f[np] != o[0]);
        size_t tl;
        ASSERT_STR_EQ(pd_detok_text(d, &tl), got);
        free(whole);
        free(head);
        pd_detok_free(d);
        free(p);
        free(o);
        free(f);
    }
}

/* ---- randomized properties ------------------------------------------------------------ */

static uint64_t prng(uint64_t *st)
{
    uint64_t z = (*st += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Random id sequences (biased towards byte tokens, specials and short tokens, where the
 * decoder has its corner cases): the incremental detokenizer equals whole decode. */
TEST(detok_random_id_sequences)
{
    uint64_t st = 1234;
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
        ASSERT(t);
        int32_t V = pd_tok_vocab_size(t);
        int32_t pool[600];
        int np = 0;
        for (int b = 0; b < 256; b++) { /* byte tokens (either alphabet) */
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", b);
            int32_t id = pd_tok_token_to_id(t, name, 6);
            if (id >= 0) pool[np++] = id;
        }
        for (int32_t id = 0; id < V && np < 600; id++)
            if (pd_tok_is_special(t, id) ||
                (pd_tok_id_to_token(t, id) && strlen(pd_tok_id_to_token(t, id)) <= 2))
                pool[np++] = id;
        for (int it = 0; it < 1500; it++) {
            int32_t ids[48];
            size_t n = (size_t)(prng(&st) % 48);
            for (size_t i = 0; i < n; i++)
                ids[i] = prng(&st) % 3 ? pool[prng(&st) % (uint64_t)np]
                                       : (int32_t)(prng(&st) % (uint64_t)V);
            bool sk = it & 1;
            ASSERT_MSG(detok_matches(t, ids, n, sk), "%s: random sequence %d differs", MODELS[m],
                       it);
        }
    }
}

/* Appends the UTF-8 of cp. */
static size_t put_cp(char *o, uint32_t cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Random valid UTF-8 (ASCII, Latin, combining marks, CJK, emoji, odd whitespace, unassigned
 * code points; no '<' so no special-token text): decode(encode(text)) gives the text back
 * (Qwen: its NFC), and the detokenizer agrees. */
TEST(roundtrip_random_text)
{
    static const uint32_t odd[] = {'\t',   '\n',   '\r',     ' ',    0x85,  0xA0,
                                   0x2028, 0x3000, 0x200B,   0xFEFF, 0x301, 0x308,
                                   0x2581, 0x17F,  0x10FFFD, 0xE000, 0x378};
    uint64_t st = 99;
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
        ASSERT(t);
        for (int it = 0; it < 800; it++) {
            char text[512];
            size_t len = 0, n_cp = 1 + prng(&st) % 60;
            for (size_t k = 0; k < n_cp; k++) {
                uint64_t r = prng(&st) % 100;
                uint32_t cp;
                if (r < 60)
                    cp = 0x20 + (uint32_t)(prng(&st) % 95);
                else if (r < 70)
                    cp = 0xA0 + (uint32_t)(prng(&st) % 0x1B0);
                else if (r < 78)
                    cp = 0x4E00 + (uint32_t)(prng(&st) % 0x5000);
                else if (r < 84)
                    cp = 0x1F300 + (uint32_t)(prng(&st) % 0x300);
                else if (r < 94)
                    cp = odd[prng(&st) % (sizeof odd / sizeof odd[0])];
                else
                    cp = (uint32_t)(prng(&st) % 0x30000);
                if (cp == '<' || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 'x';
                len += put_cp(text + len, cp);
            }
            int32_t *ids;
            size_t n;
            ASSERT_OK(pd_tok_encode(t, text, len, false, &ids, &n));
            char *back;
            size_t bl;
            ASSERT_OK(pd_tok_decode(t, ids, n, false, &back, &bl));
            uint8_t *nfc = NULL;
            size_t nl = len;
            if (m == 2) ASSERT_OK(pd_uc_nfc((const uint8_t *)text, len, &nfc, &nl));
            if (!nfc) nl = len; /* already NFC */
            const char *want = nfc ? (const char *)nfc : text;
            char spm[512]; /* SentencePiece decodes a literal "▁" as a space */
            if (m == 0) {
                nl = 0;
                for (size_t k = 0; k < len; k++) {
                    if (k + 3 <= len && memcmp(text + k, "\xe2\x96\x81", 3) == 0) {
                        spm[nl++] = ' ';
                        k += 2;
                    } else {
                        spm[nl++] = text[k];
                    }
                }
                want = spm;
            }
            bool same = bl == nl && memcmp(back, want, nl) == 0;
            if (!same)
                printf("    got \"%.*s\"\n    want \"%.*s\"\n", (int)bl, back, (int)nl, want);
            bool inc = detok_matches(t, ids, n, false);
            free(back);
            free(nfc);
            free(ids);
            ASSERT_MSG(same, "%s: text %d did not round-trip", MODELS[m], it);
            ASSERT(inc);
        }
    }
}

/* Random bytes (mostly invalid UTF-8) never fail or crash, and with a byte-level model
 * decode(encode(bytes)) is the lossy reading of the bytes. */
TEST(random_bytes_encode)
{
    uint64_t st = 5;
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
        ASSERT(t);
        for (int it = 0; it < 500; it++) {
            uint8_t buf[96];
            size_t len = prng(&st) % sizeof buf;
            for (size_t k = 0; k < len; k++)
                buf[k] = (uint8_t)(prng(&st) % 4 ? 0x80 + prng(&st) % 0x80 : prng(&st) % 0x80);
            int32_t *ids;
            size_t n;
            ASSERT_OK(pd_tok_encode(t, (const char *)buf, len, true, &ids, &n));
            char *back;
            size_t bl;
            ASSERT_OK(pd_tok_decode(t, ids, n, true, &back, &bl));
            if (m == 1) {
                uint8_t want[3 * sizeof buf];
                size_t wl = pd_utf8_lossy(buf, len, want);
                ASSERT_MSG(bl == wl && memcmp(back, want, wl) == 0, "bytes %d", it);
            }
            ASSERT(utf8_valid(back, bl));
            free(back);
            free(ids);
        }
    }
}

/* One pd_tok shared by several threads encoding and decoding at once gives each the same
 * ids as a single thread (encode keeps all scratch per call). */
typedef struct {
    const pd_tok *t;
    const char *text;
    const int32_t *want;
    size_t n_want;
    int bad;
} thread_arg;

static void *encode_thread(void *p)
{
    thread_arg *a = p;
    for (int it = 0; it < 20; it++) {
        int32_t *ids;
        size_t n;
        if (pd_tok_encode(a->t, a->text, strlen(a->text), true, &ids, &n) < 0 || n != a->n_want ||
            memcmp(ids, a->want, n * sizeof *ids) != 0)
            a->bad++;
        char *s;
        if (pd_tok_decode(a->t, ids, n, true, &s, NULL) < 0)
            a->bad++;
        else
            free(s);
        free(ids);
    }
    return NULL;
}

/* pd_tok_encode_max against the whole text's encoding: a text that fits gives the same ids; one
 * that does not gives more = true and a count between max_ids and the true count (the api-server
 * stops tokenizing huge prompts with it, issue 29 item 4). Texts of words, CJK, emoji, newlines
 * and long runs without a space, 1 KB to 400 KB. */
TEST(encode_max_matches_whole)
{
    static const char *const pieces[] = {"hello ",
                                         "world. ",
                                         "\n",
                                         "日本語の文章",
                                         "😀🚀",
                                         "  ",
                                         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                                         "1234567890",
                                         "<|begin_of_text|>",
                                         "é ",
                                         "\t"};
    uint64_t st = 7;
    size_t cap = 400 * 1024 + 64;
    char *text = malloc(cap);
    ASSERT(text);
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) {
            free(text);
            SKIP("npm cache missing (tests/npm_cache.sh)");
        }
        ASSERT(t);
        for (int it = 0; it < 12; it++) {
            size_t want = (size_t)1024 << (it % 9), len = 0;
            if (want > cap - 64) want = cap - 64;
            while (len < want) {
                const char *p = pieces[prng(&st) % (sizeof pieces / sizeof *pieces)];
                size_t pl = strlen(p);
                memcpy(text + len, p, pl);
                len += pl;
            }
            int32_t *all = NULL, *ids = NULL;
            size_t n_all = 0, n = 0;
            ASSERT_OK(pd_tok_encode(t, text, len, true, &all, &n_all));
            static const size_t maxes[] = {1, 100, 1000, 5000};
            for (size_t k = 0; k < sizeof maxes / sizeof *maxes; k++) {
                bool more = true;
                ASSERT_OK(pd_tok_encode_max(t, text, len, true, maxes[k], &ids, &n, &more));
                if (n_all <= maxes[k]) ASSERT(!more);
                if (more) {
                    ASSERT(ids == NULL);
                    ASSERT_MSG(n > maxes[k] && n <= n_all,
                               "%s: %zu bytes, max %zu: at least %zu of %zu", MODELS[m], len,
                               maxes[k], n, n_all);
                } else {
                    ASSERT_EQ_INT((long long)n, (long long)n_all);
                    ASSERT(memcmp(ids, all, n * sizeof *ids) == 0);
                }
                free(ids);
                ids = NULL;
            }
            free(all);
        }
    }
    free(text);
}

TEST(shared_between_threads)
{
    bool skip;
    pd_tok *t = load_real("qwen3", &skip);
    if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
    ASSERT(t);
    char text[6000];
    size_t len = 0;
    while (len + 80 < sizeof text) /* long enough for the word cache */
        len +=
            (size_t)snprintf(text + len, sizeof text - len,
                             "Caf\xc3\xa9 na\xc3\xafve <|im_end|> 12345 tokens, %zu times. ", len);
    int32_t *want;
    size_t n_want;
    ASSERT_OK(pd_tok_encode(t, text, len, true, &want, &n_want));
    pthread_t th[4];
    thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg){t, text, want, n_want, 0};
        ASSERT(pthread_create(&th[i], NULL, encode_thread, &args[i]) == 0);
    }
    int bad = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        bad += args[i].bad;
    }
    free(want);
    ASSERT_EQ_INT(bad, 0);
}

/* ---- encode edge cases --------------------------------------------------------------- */

TEST(invalid_utf8_reads_as_replacement_char)
{
    for (size_t m = 0; m < 3; m++) {
        bool skip;
        pd_tok *t = load_real(MODELS[m], &skip);
        if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
        ASSERT(t);
        /* stray continuation, truncated 3-byte sequence, overlong, surrogate, 0xFF */
        static const char bad[] = "a\x80 b\xe6\x97 c\xc0\xaf d\xed\xa0\x80 e\xff";
        static const char good[] = "a\xef\xbf\xbd b\xef\xbf\xbd c\xef\xbf\xbd\xef\xbf\xbd "
                                   "d\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd e\xef\xbf\xbd";
        int32_t *x, *y;
        size_t nx, ny;
        ASSERT_OK(pd_tok_encode(t, bad, sizeof bad - 1, false, &x, &nx));
        ASSERT_OK(pd_tok_encode(t, good, sizeof good - 1, false, &y, &ny));
        ASSERT_EQ_INT(nx, ny);
        ASSERT(memcmp(x, y, nx * sizeof *x) == 0);
        free(x);
        free(y);
        /* truncated at the very end, and a lone lead byte */
        ASSERT_OK(pd_tok_encode(t, "\xf0\x9f\x8e", 3, false, &x, &nx));
        ASSERT(nx >= 1);
        free(x);
        ASSERT_OK(pd_tok_encode(t, "", 0, true, &x, &nx));
        ASSERT_EQ_INT(nx, pd_tok_add_bos(t) ? 1 : 0);
        free(x);
        ASSERT_ERR(pd_tok_encode(t, NULL, 3, false, &x, &nx), PD_EINVAL, "NULL");
    }
}

TEST(vocab_accessors)
{
    bool skip;
    pd_tok *t = load_real("llama2", &skip);
    if (skip) SKIP("npm cache missing (tests/npm_cache.sh)");
    ASSERT(t);
    ASSERT_EQ_INT(pd_tok_vocab_size(t), 32000);
    ASSERT_EQ_INT(pd_tok_bos_id(t), 1);
    ASSERT_EQ_INT(pd_tok_unk_id(t), 0);
    ASSERT_EQ_INT(pd_tok_pad_id(t), -1);
    const int32_t *eos;
    ASSERT_EQ_INT(pd_tok_eos_ids(t, &eos), 1);
    ASSERT_EQ_INT(eos[0], 2);
    ASSERT_STR_EQ(pd_tok_bos_token(t), "<s>");
    ASSERT_STR_EQ(pd_tok_eos_token(t), "</s>");
    ASSERT(pd_tok_add_bos(t) && !pd_tok_add_eos(t));
    ASSERT(pd_tok_is_special(t, 1) && pd_tok_is_special(t, 2) && !pd_tok_is_special(t, 100));
    ASSERT(!pd_tok_is_special(t, -1) && !pd_tok_is_special(t, 1 << 20));
    ASSERT_STR_EQ(pd_tok_id_to_token(t, 1), "<s>");
    ASSERT_STR_EQ(pd_tok_id_to_token(t, 13), "<0x0A>");
    ASSERT(pd_tok_id_to_token(t, 32000) == NULL && pd_tok_id_to_token(t, -1) == NULL);
    ASSERT_EQ_INT(pd_tok_token_to_id(t, "<0x0A>", 6), 13);
    ASSERT_EQ_INT(pd_tok_token_to_id(t, "no such token", 13), -1);
    const json_t *cfg = pd_tok_config(t);
    ASSERT(cfg && json_is_object(cfg));
    ASSERT_STR_EQ(json_string_value(json_object_get(cfg, "tokenizer_class")), "LlamaTokenizer");

    t = load_real("qwen3", &skip);
    ASSERT(t);
    ASSERT_EQ_INT(pd_tok_bos_id(t), -1);
    ASSERT(pd_tok_bos_token(t) == NULL);
    ASSERT_EQ_INT(pd_tok_eos_ids(t, &eos), 1);
    ASSERT_EQ_INT(eos[0], 151645);
    ASSERT_EQ_INT(pd_tok_pad_id(t), 151643);
    ASSERT(!pd_tok_add_bos(t));
    ASSERT(pd_tok_is_special(t, 151644));
    ASSERT(!pd_tok_is_special(t, 151667)); /* <think> is added but not special */
    ASSERT_EQ_INT(pd_tok_token_to_id(t, "<think>", 7), 151667);
    ASSERT(json_is_string(json_object_get(pd_tok_config(t), "chat_template")));

    t = load_real("llama3", &skip);
    ASSERT(t);
    ASSERT_EQ_INT(pd_tok_vocab_size(t), 128256);
    ASSERT_EQ_INT(pd_tok_bos_id(t), 128000);
    ASSERT_EQ_INT(pd_tok_eos_ids(t, &eos), 1);
    ASSERT_EQ_INT(eos[0], 128001);
}

/* ---- a synthetic byte-level BPE as pd-mkmodel writes it ------------------------------ */

/* Writes DIR/tokenizer.json: 256 byte tokens, merges given as "a b" strings or pairs. */
static void write_synthetic(const char *dir, bool pair_merges, const char *extra_added)
{
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        int k = 0;
        for (int c = 0; c < b; c++)
            if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE)) k++;
        bool pr = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        unsigned cp = pr ? (unsigned)b : 0x100u + (unsigned)k;
        char u[4] = {0};
        if (cp < 0x80)
            u[0] = (char)cp;
        else {
            u[0] = (char)(0xC0 | (cp >> 6));
            u[1] = (char)(0x80 | (cp & 0x3F));
        }
        json_object_set_new(vocab, u, json_integer(b));
    }
    static const char *const merges[][2] = {
        {"h", "e"},          {"l", "l"},           {"he", "ll"},
        {"hell", "o"},       {"\xc4\xa0", "w"},    {"o", "r"},
        {"\xc4\xa0w", "or"}, {"\xc4\xa0wor", "l"}, {"\xc4\xa0worl", "d"},
        {"e", "r"},
    };
    json_t *jm = json_array();
    int next = 256;
    for (size_t i = 0; i < sizeof merges / sizeof merges[0]; i++) {
        char cat[32];
        snprintf(cat, sizeof cat, "%s%s", merges[i][0], merges[i][1]);
        json_object_set_new(vocab, cat, json_integer(next++));
        if (pair_merges) {
            json_array_append_new(jm, json_pack("[ss]", merges[i][0], merges[i][1]));
        } else {
            char m[40];
            snprintf(m, sizeof m, "%s %s", merges[i][0], merges[i][1]);
            json_array_append_new(jm, json_string(m));
        }
    }
    json_t *added = json_array();
    const char *specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    for (int i = 0; i < 3; i++)
        json_array_append_new(added, json_pack("{si ss sb sb sb sb sb}", "id", next + i, "content",
                                               specials[i], "single_word", 0, "lstrip", 0, "rstrip",
                                               0, "normalized", 0, "special", 1));
    if (extra_added)
        json_array_append_new(added, json_pack("{si ss sb sb}", "id", next + 3, "content",
                                               extra_added, "special", 0, "normalized", 0));
    json_t *bl = json_pack("{ss sb sb sb}", "type", "ByteLevel", "add_prefix_space", 0,
                           "trim_offsets", 1, "use_regex", 1);
    json_t *model =
        json_pack("{ss so so sn}", "type", "BPE", "vocab", vocab, "merges", jm, "unk_token");
    json_t *root =
        json_pack("{ss so sn sO sO sO so}", "version", "1.0", "added_tokens", added, "normalizer",
                  "pre_tokenizer", bl, "post_processor", bl, "decoder", bl, "model", model);
    json_decref(bl);
    char path[1200];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    json_dump_file(root, path, JSON_INDENT(1));
    json_decref(root);
}

TEST(synthetic_bytelevel_bpe)
{
    char dir[1024];
    for (int pairs = 0; pairs < 2; pairs++) {
        snprintf(dir, sizeof dir, "%s/syn%d", pdt_tmp_dir(), pairs);
        mkdir(dir, 0755);
        write_synthetic(dir, pairs, "<tool>");
        char cfg[1100];
        snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
        write_file(cfg, "{\"eos_token\": \"<|im_end|>\", \"bos_token\": null, "
                        "\"pad_token\": {\"content\": \"<|endoftext|>\"}, "
                        "\"chat_template\": \"{{ messages }}\"}");
        pd_tok *t;
        ASSERT_OK(pd_tok_load(dir, &t));
        ASSERT_EQ_INT(pd_tok_vocab_size(t), 256 + 10 + 4);
        const char *text = "hello world<|im_end|>herr <tool>x";
        int32_t *ids;
        size_t n;
        ASSERT_OK(pd_tok_encode(t, text, strlen(text), true, &ids, &n));
        /* hello | " world" | <|im_end|> | he r r ("he" outranks "er") | " " | <tool> | x */
        int32_t want[] = {259, 264, 268, 256, 114, 114, 32, 269, 120};
        ASSERT_EQ_INT(pd_tok_token_to_id(t, "\xc4\xa0", 2), 32);
        ASSERT_EQ_INT(n, 9);
        for (size_t i = 0; i < n; i++)
            ASSERT_MSG(ids[i] == want[i], "id %zu: %d != %d", i, ids[i], want[i]);
        char *s;
        ASSERT_OK(pd_tok_decode(t, ids, n, false, &s, NULL));
        ASSERT_STR_EQ(s, text);
        free(s);
        ASSERT_OK(pd_tok_decode(t, ids, n, true, &s, NULL));
        ASSERT_STR_EQ(s, "hello worldherr <tool>x"); /* <tool> is not special */
        free(s);
        ASSERT(detok_matches(t, ids, n, true));
        ASSERT(detok_matches(t, ids, n, false));
        free(ids);
        const int32_t *eos;
        ASSERT_EQ_INT(pd_tok_eos_ids(t, &eos), 1);
        ASSERT_EQ_INT(eos[0], 268);
        ASSERT_EQ_INT(pd_tok_pad_id(t), 266);
        ASSERT_EQ_INT(pd_tok_bos_id(t), -1);
        ASSERT_STR_EQ(json_string_value(json_object_get(pd_tok_config(t), "chat_template")),
                      "{{ messages }}");
        /* every byte string round-trips */
        char all[256];
        for (int b = 0; b < 255; b++) all[b] = (char)(b + 1);
        ASSERT_OK(pd_tok_encode(t, all, 255, false, &ids, &n));
        ASSERT_OK(pd_tok_decode(t, ids, n, false, &s, NULL));
        ASSERT(detok_matches(t, ids, n, false));
        free(ids);
        /* invalid bytes were read as U+FFFD, so the text differs exactly there */
        ASSERT(strncmp(s, all, 127) == 0);
        free(s);
        pd_tok_free(t);
    }
}

/* ---- NFC (Qwen's normalizer) against Python's unicodedata ------------------------------ */

TEST(nfc_matches_python)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/nfc.json", pdt_data_dir());
    json_error_t err;
    json_t *cases = json_load_file(path, JSON_ALLOW_NUL, &err);
    ASSERT_MSG(cases, "%s: %s", path, err.text);
    size_t i, bad = 0, changed = 0;
    json_t *c;
    json_array_foreach(cases, i, c)
    {
        json_t *in = json_array_get(c, 0), *want = json_array_get(c, 1);
        uint8_t *o;
        size_t ol;
        ASSERT_OK(
            pd_uc_nfc((const uint8_t *)json_string_value(in), json_string_length(in), &o, &ol));
        const char *got = o ? (const char *)o : json_string_value(in);
        size_t gl = o ? ol : json_string_length(in);
        if (gl != json_string_length(want) || memcmp(got, json_string_value(want), gl) != 0) {
            if (bad++ < 5) printf("    case %zu: NFC differs\n", i);
        }
        changed += o != NULL;
        free(o);
    }
    json_decref(cases);
    ASSERT_EQ_INT(bad, 0);
    ASSERT(changed > 1000);
    /* plain ASCII and already-composed text take the no-copy path */
    uint8_t *o;
    size_t ol;
    ASSERT_OK(pd_uc_nfc((const uint8_t *)"caf\xc3\xa9 abc", 9, &o, &ol));
    ASSERT(o == NULL);
}

/* ---- malformed files ----------------------------------------------------------------- */

static int load_text(const char *name, const char *json)
{
    char dir[1024], path[1100];
    snprintf(dir, sizeof dir, "%s/%s", pdt_tmp_dir(), name);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    write_file(path, json);
    pd_tok *t = NULL;
    int rc = pd_tok_load(dir, &t);
    pd_tok_free(t);
    return rc;
}

#define BPE_HEAD "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, "

TEST(malformed_tokenizer_json)
{
    ASSERT_ERR(load_text("m1", "{\"version\": \"1.0\"}"), PD_EINVAL,
               "tokenizer.json: model: required");
    ASSERT_ERR(load_text("m2", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}"),
               PD_EUNSUPPORTED, "model.type: unsupported model type \"WordPiece\"");
    ASSERT_ERR(load_text("m3", BPE_HEAD "\"merges\": [\"a b\", \"ab\"]}}"), PD_EPARSE,
               "tokenizer.json: model.merges[1]: expected \"left right\"");
    ASSERT_ERR(load_text("m4", BPE_HEAD "\"merges\": [\"a c\"]}}"), PD_EINVAL,
               "model.merges[0]: token \"c\" is not in model.vocab");
    ASSERT_ERR(load_text("m5", BPE_HEAD "\"merges\": [\"b a\"]}}"), PD_EINVAL,
               "model.merges[0]: merged token \"ba\" is not in model.vocab");
    ASSERT_ERR(load_text("m6", BPE_HEAD "\"merges\": [[\"a\", 3]]}}"), PD_EPARSE,
               "model.merges[0]: expected");
    ASSERT_ERR(load_text("m7", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}}}"),
               PD_EINVAL, "model.vocab[\"a\"]");
    ASSERT_ERR(load_text("m8", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}}}"),
               PD_EINVAL, "already used");
    ASSERT_ERR(load_text("m9",
                         BPE_HEAD "\"merges\": []}, \"pre_tokenizer\": {\"type\": "
                                  "\"Split\", \"pattern\": {\"Regex\": \"\\\\w+\"}, \"behavior\": "
                                  "\"Isolated\"}}"),
               PD_EUNSUPPORTED, "pre_tokenizer.pattern.Regex: unsupported split regex");
    ASSERT_ERR(load_text("m10", BPE_HEAD "\"merges\": []}, \"normalizer\": {\"type\": "
                                         "\"Sequence\", \"normalizers\": [{\"type\": \"NFKC\"}]}}"),
               PD_EUNSUPPORTED, "normalizer.normalizers[0].type: unsupported normalizer \"NFKC\"");
    ASSERT_ERR(
        load_text("m11", BPE_HEAD "\"merges\": []}, \"decoder\": {\"type\": \"WordPiece\"}}"),
        PD_EUNSUPPORTED, "decoder.type: unsupported decoder");
    ASSERT_ERR(load_text("m12", BPE_HEAD "\"merges\": []}, \"added_tokens\": [{\"id\": 1, "
                                         "\"content\": \"zz\"}]}"),
               PD_EINVAL, "added_tokens[0]: id 1 is \"b\" in model.vocab");
    ASSERT_ERR(load_text("m13", "{\"model\": "), PD_EPARSE, "tokenizer.json");
    ASSERT_ERR(load_text("m14", BPE_HEAD "\"merges\": [], \"unk_token\": \"<unk>\"}}"), PD_EINVAL,
               "model.unk_token: \"<unk>\" is not in model.vocab");
    ASSERT_ERR(load_text("m15", BPE_HEAD "\"merges\": [], \"dropout\": 0.1}}"), PD_EUNSUPPORTED,
               "model.dropout");
    /* missing directory / file */
    pd_tok *t;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/does-not-exist", pdt_tmp_dir());
    int rc = pd_tok_load(dir, &t);
    ASSERT(rc < 0);
    ASSERT_CONTAINS(pd_last_error(), "does-not-exist/tokenizer.json");
    /* a good tokenizer.json with a bad tokenizer_config.json names the config file */
    ASSERT_OK(load_text("c1", BPE_HEAD "\"merges\": [\"a b\"]}}"));
    char cfg[1100];
    snprintf(cfg, sizeof cfg, "%s/c1/tokenizer_config.json", pdt_tmp_dir());
    write_file(cfg, "{\"eos_token\": \"</s>\"}");
    snprintf(dir, sizeof dir, "%s/c1", pdt_tmp_dir());
    ASSERT_ERR(pd_tok_load(dir, &t), PD_EINVAL,
               "tokenizer_config.json: eos_token: token \"</s>\" is not in the vocabulary");
    write_file(cfg, "{\"add_bos_token\": 1}");
    ASSERT_ERR(pd_tok_load(dir, &t), PD_EPARSE, "tokenizer_config.json: add_bos_token");
    write_file(cfg, "{\"bos_token\": \"a\", \"add_bos_token\": true, \"model_max_length\": "
                    "1000000000000000019884624838656}");
    ASSERT_OK(pd_tok_load(dir, &t));
    int32_t *ids;
    size_t n;
    ASSERT_OK(pd_tok_encode(t, "abab", 4, true, &ids, &n));
    ASSERT_EQ_INT(n, 3); /* bos, ab, ab (no pre-tokenizer: the whole text is one word) */
    ASSERT_EQ_INT(ids[0], 0);
    ASSERT_EQ_INT(ids[1], 2);
    free(ids);
    pd_tok_free(t);
}
