/* libFuzzer target: tokenizer.json (+ tokenizer_config.json) loading, common/tokenizer.
 *
 * The input is tokenizer.json, optionally followed by the separator "\xff\xff" (never valid
 * JSON, never UTF-8) and a tokenizer_config.json. Both are written to files in a private
 * temporary directory and loaded with pd_tok_load_files, the loader the servers use. Every
 * tokenizer that loads is then exercised, and a broken promise of tokenizer.h aborts (a
 * finding): encoding fixed texts (ASCII, special-token text, multi-byte and invalid UTF-8) gives
 * ids in [0, vocab); decoding them works; the incremental detokenizer's deltas concatenate to
 * pd_tok_decode's text; each id's token string maps back to an id with the same string; the
 * special ids lie in range.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tokenizer/tokenizer.h"
#include "util/status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char g_dir[256], g_tok[300], g_cfg[300];

static void fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_tokenizer invariant broken: %s: %s\n", what, detail);
    abort();
}

static void cleanup(void)
{
    unlink(g_tok);
    unlink(g_cfg);
    rmdir(g_dir);
}

static void setup(void)
{
    if (g_dir[0]) return;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(g_dir, sizeof g_dir, "%s/fuzz_tokenizer.XXXXXX", base);
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        abort();
    }
    snprintf(g_tok, sizeof g_tok, "%s/tokenizer.json", g_dir);
    snprintf(g_cfg, sizeof g_cfg, "%s/tokenizer_config.json", g_dir);
    atexit(cleanup);
}

static void write_file(const char *path, const uint8_t *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        perror(path);
        abort();
    }
}

static void check_id(const pd_tok *t, int32_t id, const char *what)
{
    if (id < -1 || id >= pd_tok_vocab_size(t)) fail("special id out of range", what);
}

static void check_text(const pd_tok *t, const char *text, size_t len, bool special)
{
    int32_t *ids = NULL;
    size_t n = 0;
    if (pd_tok_encode(t, text, len, special, &ids, &n) < 0) {
        free(ids);
        return; /* an encode error is allowed (e.g. no token for a byte); a crash is not */
    }
    int32_t vocab = pd_tok_vocab_size(t);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) fail("encode gave an id out of range", text);
    for (int skip = 0; skip < 2; skip++) {
        char *dec = NULL;
        size_t dlen = 0;
        if (pd_tok_decode(t, ids, n, skip, &dec, &dlen) < 0) fail("decode", pd_last_error());
        if (strlen(dec) > dlen) fail("decode length", text);
        pd_detok *d = NULL;
        if (pd_detok_create(t, skip, NULL, 0, &d) < 0) fail("detok_create", pd_last_error());
        size_t got_len = 0;
        char *got = malloc(dlen + 1);
        if (!got) abort();
        for (size_t i = 0; i <= n; i++) {
            const char *delta;
            size_t dl;
            int rc = i < n ? pd_detok_push(d, ids[i], &delta, &dl) : pd_detok_flush(d, &delta, &dl);
            if (rc < 0) fail("detok", pd_last_error());
            if (got_len + dl > dlen || memcmp(dec + got_len, delta, dl) != 0)
                fail("detok deltas differ from decode", text);
            memcpy(got + got_len, delta, dl);
            got_len += dl;
        }
        if (got_len != dlen) fail("detok text shorter than decode", text);
        free(got);
        pd_detok_free(d);
        free(dec);
    }
    free(ids);
}

static void exercise(const pd_tok *t)
{
    static const char *const texts[] = {
        "Hello world! 123 hello   world\n\n\tcode(x)=y;",
        "<|im_start|>user\nHi<|im_end|><s></s><|endoftext|><unk>",
        "caf\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x98\x80 e\xcc\x81",
        "bad \xff\xfe utf8 \xc3 \xe4\xbd end",
        "",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        check_text(t, texts[i], strlen(texts[i]), false);
        check_text(t, texts[i], strlen(texts[i]), true);
    }
    int32_t vocab = pd_tok_vocab_size(t);
    if (vocab <= 0) fail("vocab size", "not positive");
    for (int32_t id = 0; id < vocab && id < 4096; id++) {
        const char *s = pd_tok_id_to_token(t, id);
        if (!s) continue;
        int32_t back = pd_tok_token_to_id(t, s, strlen(s));
        if (back < 0 || back >= vocab) continue; /* a token string with a NUL inside */
        const char *s2 = pd_tok_id_to_token(t, back);
        if (!s2 || strcmp(s, s2) != 0) fail("token_to_id(id_to_token(id)) names another token", s);
        (void)pd_tok_is_special(t, id);
    }
    check_id(t, pd_tok_bos_id(t), "bos");
    check_id(t, pd_tok_unk_id(t), "unk");
    check_id(t, pd_tok_pad_id(t), "pad");
    const int32_t *eos = NULL;
    size_t n_eos = pd_tok_eos_ids(t, &eos);
    for (size_t i = 0; i < n_eos; i++) check_id(t, eos[i], "eos");
    (void)pd_tok_bos_token(t);
    (void)pd_tok_eos_token(t);
    (void)pd_tok_config(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    const uint8_t *sep = NULL;
    for (size_t i = 0; i + 1 < size; i++)
        if (data[i] == 0xff && data[i + 1] == 0xff) {
            sep = data + i;
            break;
        }
    size_t tok_len = sep ? (size_t)(sep - data) : size;
    write_file(g_tok, data, tok_len);
    if (sep) write_file(g_cfg, sep + 2, size - tok_len - 2);
    pd_tok *t = NULL;
    pd_error_clear();
    if (pd_tok_load_files(g_tok, sep ? g_cfg : NULL, &t) == 0) {
        exercise(t);
        pd_tok_free(t);
    } else if (pd_last_error()[0] == '\0') {
        fail("pd_tok_load_files failed", "without a message");
    } else if (t) {
        fail("pd_tok_load_files failed", "but set *out");
    }
    return 0;
}
