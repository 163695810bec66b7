/* Tokenizer loading (tokenizer.json + tokenizer_config.json) and the vocabulary accessors.
 *
 * Design: the JSON pipeline is compiled at load into flat tables (see tok_internal.h) and
 * anything outside the supported subset is refused with the file and field named, so
 * encode (encode.c) never meets an unknown step. Strings are copied into one arena owned
 * by the pd_tok; the parsed tokenizer.json is dropped after load, tokenizer_config.json is
 * kept for the chat template.
 */
#include "tokenizer/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json/json.h"
#include "tokenizer/tok_internal.h"
#include "tokenizer/unicode.h"
#include "util/status.h"

/* ---- hashing and maps ------------------------------------------------------------------- */

uint64_t pd_tok_hash(const void *p, size_t n)
{
    const uint8_t *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0x100000001B3ull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        h = (h ^ v) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, s, n);
    h = (h ^ v) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    return h;
}

static uint32_t pow2_at_least(size_t n)
{
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

int32_t pd_tok_vocab_find(const pd_tok *t, const char *s, size_t n)
{
    uint32_t i = (uint32_t)pd_tok_hash(s, n) & t->vmap_mask;
    for (;;) {
        int32_t id = t->vmap[i];
        if (id < 0) return -1;
        if (t->id_len[id] == n && memcmp(t->id_str[id], s, n) == 0) return id;
        i = (i + 1) & t->vmap_mask;
    }
}

/* ---- loading ----------------------------------------------------------------------------- */

typedef struct {
    pd_tok *t;
    const char *file; /* for messages */
} loader;

static int lerr(loader *L, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int lerr(loader *L, int code, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return pd_error(code, "%s: %s", L->file, msg);
}

/* Prefixes the pdj_* message (which names the JSON path) with the file name. */
static int lwrap(loader *L, int rc)
{
    return rc < 0 ? pd_error_prefix(rc, "%s", L->file) : rc;
}

static int get_type(loader *L, const json_t *obj, const char *path, const char **type)
{
    return lwrap(L, pdj_get_string(obj, path, "type", PDJ_REQUIRED, type));
}

static int load_vocab(loader *L, json_t *model)
{
    pd_tok *t = L->t;
    json_t *vocab;
    PD_CHECK(lwrap(L, pdj_get_object(model, "model", "vocab", PDJ_REQUIRED, &vocab)));
    int64_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val)
    {
        int64_t id;
        char path[256];
        snprintf(path, sizeof path, "model.vocab[\"%.200s\"]", key);
        PD_CHECK(lwrap(L, pdj_as_int(val, path, &id)));
        if (id < 0 || id >= (1 << 24))
            return lerr(L, PD_ERANGE, "%s: id %lld out of range [0, 16777216)", path,
                        (long long)id);
        if (id > max_id) max_id = id;
    }
    t->n_ids = (int32_t)(max_id + 1);
    return 0;
}

static int alloc_ids(loader *L, int32_t n_ids)
{
    pd_tok *t = L->t;
    t->n_ids = n_ids;
    size_t n = (size_t)n_ids;
    t->id_str = pd_arena_calloc(t->arena, n, sizeof *t->id_str);
    t->id_len = pd_arena_calloc(t->arena, n, sizeof *t->id_len);
    t->id_flags = pd_arena_calloc(t->arena, n, 1);
    t->id_byte = pd_arena_calloc(t->arena, n, 1);
    t->id_dec = pd_arena_calloc(t->arena, n, sizeof *t->id_dec);
    t->id_dec_len = pd_arena_calloc(t->arena, n, sizeof *t->id_dec_len);
    if (!t->id_str || !t->id_len || !t->id_flags || !t->id_byte || !t->id_dec || !t->id_dec_len)
        return pd_error(PD_ENOMEM, "tokenizer: out of memory for %d ids", n_ids);
    return 0;
}

static bool parse_byte_token(const char *s, size_t n, uint8_t *b)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return false;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0) return false;
        v = v * 16 + d;
    }
    *b = (uint8_t)v;
    return true;
}

static int fill_vocab(loader *L, json_t *vocab)
{
    pd_tok *t = L->t;
    size_t count = json_object_size(vocab);
    uint32_t cap = pow2_at_least(count * 2 + 1);
    t->vmap = pd_arena_alloc(t->arena, (size_t)cap * sizeof *t->vmap, 0);
    if (!t->vmap) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    memset(t->vmap, 0xFF, (size_t)cap * sizeof *t->vmap);
    t->vmap_mask = cap - 1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val)
    {
        int32_t id = (int32_t)json_number_value(val);
        size_t len = strlen(key);
        if (t->id_flags[id] & TOKF_USED)
            return lerr(L, PD_EINVAL, "model.vocab[\"%.200s\"]: id %d already used by \"%.200s\"",
                        key, id, t->id_str[id]);
        char *s = pd_arena_strndup(t->arena, key, len);
        if (!s) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
        t->id_str[id] = s;
        t->id_len[id] = (uint32_t)len;
        t->id_flags[id] = TOKF_USED;
        uint8_t b;
        if (parse_byte_token(s, len, &b)) {
            t->id_flags[id] |= TOKF_BYTE;
            t->id_byte[id] = b;
        }
        uint32_t i = (uint32_t)pd_tok_hash(s, len) & t->vmap_mask;
        while (t->vmap[i] >= 0) {
            int32_t o = t->vmap[i];
            if (t->id_len[o] == len && memcmp(t->id_str[o], s, len) == 0)
                return lerr(L, PD_EINVAL, "model.vocab: duplicate token \"%.200s\"", key);
            i = (i + 1) & t->vmap_mask;
        }
        t->vmap[i] = id;
    }
    return 0;
}

static int load_merges(loader *L, json_t *model)
{
    pd_tok *t = L->t;
    json_t *merges = NULL; /* absent: no merges (the getter leaves it untouched) */
    PD_CHECK(lwrap(L, pdj_get_array(model, "model", "merges", PDJ_OPTIONAL, &merges)));
    size_t n = merges ? json_array_size(merges) : 0;
    if (n >= (1u << 30)) return lerr(L, PD_ERANGE, "model.merges: too many merges (%zu)", n);
    uint32_t cap = pow2_at_least(n * 2 + 1);
    t->mmap = pd_arena_alloc(t->arena, (size_t)cap * sizeof *t->mmap, 0);
    if (!t->mmap) return pd_error(PD_ENOMEM, "tokenizer: out of memory for %zu merges", n);
    for (uint32_t i = 0; i < cap; i++) t->mmap[i].key = UINT64_MAX;
    t->mmap_mask = cap - 1;
    char *cat = NULL;
    size_t cat_cap = 0;
    int rc = 0;
    for (size_t r = 0; r < n; r++) {
        json_t *m = json_array_get(merges, r);
        const char *a, *b;
        size_t alen, blen;
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            size_t sl = json_string_length(m);
            const char *sp = memchr(s, ' ', sl);
            if (!sp || sp == s || sp + 1 == s + sl ||
                memchr(sp + 1, ' ', (size_t)(s + sl - sp - 1))) {
                rc = lerr(L, PD_EPARSE,
                          "model.merges[%zu]: expected \"left right\", got \"%.200s\"", r, s);
                goto out;
            }
            a = s;
            alen = (size_t)(sp - s);
            b = sp + 1;
            blen = (size_t)(s + sl - b);
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            alen = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            blen = json_string_length(json_array_get(m, 1));
        } else {
            rc = lerr(L, PD_EPARSE,
                      "model.merges[%zu]: expected a \"left right\" string or a [left, right] "
                      "pair of strings, got %s",
                      r, pdj_type_name(m));
            goto out;
        }
        int32_t ia = pd_tok_vocab_find(t, a, alen), ib = pd_tok_vocab_find(t, b, blen);
        if (ia < 0 || ib < 0) {
            rc = lerr(L, PD_EINVAL, "model.merges[%zu]: token \"%.*s\" is not in model.vocab", r,
                      (int)(ia < 0 ? alen : blen), ia < 0 ? a : b);
            goto out;
        }
        if (alen + blen > cat_cap) {
            cat_cap = (alen + blen) * 2 + 64;
            char *nc = realloc(cat, cat_cap);
            if (!nc) {
                rc = pd_error(PD_ENOMEM, "tokenizer: out of memory");
                goto out;
            }
            cat = nc;
        }
        memcpy(cat, a, alen);
        memcpy(cat + alen, b, blen);
        int32_t ic = pd_tok_vocab_find(t, cat, alen + blen);
        if (ic < 0) {
            rc =
                lerr(L, PD_EINVAL, "model.merges[%zu]: merged token \"%.*s\" is not in model.vocab",
                     r, (int)(alen + blen), cat);
            goto out;
        }
        uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
        uint32_t i = (uint32_t)merge_hash(key) & t->mmap_mask;
        while (t->mmap[i].key != UINT64_MAX && t->mmap[i].key != key) i = (i + 1) & t->mmap_mask;
        /* A repeated pair keeps its last rank, as Hugging Face's map insertion does. */
        t->mmap[i].key = key;
        t->mmap[i].rank = (int32_t)r;
        t->mmap[i].id = ic;
    }
out:
    free(cat);
    return rc;
}

static int load_model(loader *L, json_t *root)
{
    pd_tok *t = L->t;
    json_t *model;
    PD_CHECK(lwrap(L, pdj_get_object(root, "", "model", PDJ_REQUIRED, &model)));
    const char *type = NULL;
    PD_CHECK(lwrap(L, pdj_get_string(model, "model", "type", PDJ_OPTIONAL, &type)));
    if (!type && !json_object_get(model, "merges"))
        return lerr(L, PD_EINVAL, "model.type: required");
    if (type && strcmp(type, "BPE") != 0)
        return lerr(L, PD_EUNSUPPORTED,
                    "model.type: unsupported model type \"%s\" (supported: BPE)", type);
    json_t *v = json_object_get(model, "dropout");
    if (v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == 0.0))
        return lerr(L, PD_EUNSUPPORTED, "model.dropout: BPE dropout is not supported");
    static const char *const empty_only[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        const char *s = NULL;
        PD_CHECK(lwrap(L, pdj_get_string(model, "model", empty_only[i],
                                         PDJ_OPTIONAL | PDJ_NULL_IS_ABSENT, &s)));
        if (s && *s)
            return lerr(L, PD_EUNSUPPORTED, "model.%s: \"%s\" is not supported (only empty)",
                        empty_only[i], s);
    }
    PD_CHECK(lwrap(L, pdj_get_bool(model, "model", "byte_fallback",
                                   PDJ_OPTIONAL | PDJ_NULL_IS_ABSENT, &t->byte_fallback)));
    PD_CHECK(lwrap(L, pdj_get_bool(model, "model", "fuse_unk", PDJ_OPTIONAL | PDJ_NULL_IS_ABSENT,
                                   &t->fuse_unk)));
    PD_CHECK(lwrap(L, pdj_get_bool(model, "model", "ignore_merges",
                                   PDJ_OPTIONAL | PDJ_NULL_IS_ABSENT, &t->ignore_merges)));
    PD_CHECK(load_vocab(L, model));

    /* ids also come from added_tokens */
    json_t *added = json_object_get(root, "added_tokens");
    int64_t max_id = t->n_ids - 1;
    if (added && !json_is_null(added)) {
        if (!json_is_array(added))
            return lerr(L, PD_EPARSE, "added_tokens: expected array, got %s", pdj_type_name(added));
        for (size_t i = 0; i < json_array_size(added); i++) {
            char path[64];
            snprintf(path, sizeof path, "added_tokens[%zu]", i);
            json_t *a = json_array_get(added, i);
            if (!json_is_object(a))
                return lerr(L, PD_EPARSE, "%s: expected object, got %s", path, pdj_type_name(a));
            int64_t id;
            PD_CHECK(
                lwrap(L, pdj_get_int_range(a, path, "id", PDJ_REQUIRED, 0, (1 << 24) - 1, &id)));
            if (id > max_id) max_id = id;
        }
    }
    if (max_id < 0) return lerr(L, PD_EINVAL, "model.vocab: empty vocabulary");
    PD_CHECK(alloc_ids(L, (int32_t)(max_id + 1)));
    PD_CHECK(fill_vocab(L, json_object_get(model, "vocab")));
    PD_CHECK(load_merges(L, model));

    t->model_unk_id = -1;
    const char *unk = NULL;
    PD_CHECK(lwrap(
        L, pdj_get_string(model, "model", "unk_token", PDJ_OPTIONAL | PDJ_NULL_IS_ABSENT, &unk)));
    if (unk) {
        t->model_unk_id = pd_tok_vocab_find(t, unk, strlen(unk));
        if (t->model_unk_id < 0)
            return lerr(L, PD_EINVAL, "model.unk_token: \"%s\" is not in model.vocab", unk);
    }
    return 0;
}

static int load_added(loader *L, json_t *root)
{
    pd_tok *t = L->t;
    json_t *added = json_object_get(root, "added_tokens");
    size_t n = added && json_is_array(added) ? json_array_size(added) : 0;
    t->added = pd_arena_calloc(t->arena, n ? n : 1, sizeof *t->added);
    if (!t->added) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    for (size_t i = 0; i < n; i++) {
        char path[64];
        snprintf(path, sizeof path, "added_tokens[%zu]", i);
        json_t *a = json_array_get(added, i);
        pd_tok_added *x = &t->added[t->n_added];
        const char *content;
        int64_t id;
        PD_CHECK(lwrap(L, pdj_get_string(a, path, "content", PDJ_REQUIRED, &content)));
        PD_CHECK(lwrap(L, pdj_get_int(a, path, "id", PDJ_REQUIRED, &id)));
        size_t len = json_string_length(json_object_get(a, "content"));
        if (len == 0) return lerr(L, PD_EINVAL, "%s.content: empty", path);
        bool special = false, lstrip = false, rstrip = false, single = false, normalized;
        PD_CHECK(lwrap(L, pdj_get_bool(a, path, "special", PDJ_OPTIONAL, &special)));
        normalized = !special;
        PD_CHECK(lwrap(L, pdj_get_bool(a, path, "lstrip", PDJ_OPTIONAL, &lstrip)));
        PD_CHECK(lwrap(L, pdj_get_bool(a, path, "rstrip", PDJ_OPTIONAL, &rstrip)));
        PD_CHECK(lwrap(L, pdj_get_bool(a, path, "single_word", PDJ_OPTIONAL, &single)));
        PD_CHECK(lwrap(L, pdj_get_bool(a, path, "normalized", PDJ_OPTIONAL, &normalized)));
        int32_t iid = (int32_t)id;
        if (t->id_flags[iid] & TOKF_USED) {
            if (t->id_len[iid] != len || memcmp(t->id_str[iid], content, len) != 0)
                return lerr(L, PD_EINVAL, "%s: id %d is \"%s\" in model.vocab, not \"%s\"", path,
                            iid, t->id_str[iid], content);
        } else {
            t->id_str[iid] = pd_arena_strndup(t->arena, content, len);
            if (!t->id_str[iid]) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
            t->id_len[iid] = (uint32_t)len;
        }
        t->id_flags[iid] |= TOKF_USED | TOKF_ADDED | (special ? TOKF_SPECIAL : 0);
        x->s = t->id_str[iid];
        x->len = (uint32_t)len;
        x->id = iid;
        x->special = special;
        x->lstrip = lstrip;
        x->rstrip = rstrip;
        x->single_word = single;
        x->normalized = normalized && t->n_norm > 0;
        t->n_added++;
    }
    return 0;
}

static int parse_pattern_string(loader *L, json_t *obj, const char *path, const char **s,
                                size_t *len)
{
    json_t *pat;
    char p[128];
    PD_CHECK(lwrap(L, pdj_get_object(obj, path, "pattern", PDJ_REQUIRED, &pat)));
    json_t *str = json_object_get(pat, "String");
    if (!str || !json_is_string(str)) {
        snprintf(p, sizeof p, "%s.pattern", path);
        return lerr(L, PD_EUNSUPPORTED, "%s: only {\"String\": ...} patterns are supported here",
                    p);
    }
    *s = json_string_value(str);
    *len = json_string_length(str);
    if (*len == 0) return lerr(L, PD_EINVAL, "%s.pattern.String: empty", path);
    return 0;
}

static int add_norm(loader *L, json_t *n, const char *path, int depth)
{
    pd_tok *t = L->t;
    const char *type;
    PD_CHECK(get_type(L, n, path, &type));
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr;
        PD_CHECK(lwrap(L, pdj_get_array(n, path, "normalizers", PDJ_REQUIRED, &arr)));
        if (depth > 4) return lerr(L, PD_EUNSUPPORTED, "%s: normalizers nested too deeply", path);
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char p[128];
            if (snprintf(p, sizeof p, "%s.normalizers[%zu]", path, i) >= (int)sizeof p)
                return lerr(L, PD_EUNSUPPORTED, "%s: normalizers nested too deeply", path);
            PD_CHECK(add_norm(L, json_array_get(arr, i), p, depth + 1));
        }
        return 0;
    }
    if (t->n_norm >= 16) return lerr(L, PD_EUNSUPPORTED, "%s: more than 16 normalizers", path);
    pd_tok_norm *x = &t->norm[t->n_norm];
    memset(x, 0, sizeof *x);
    if (strcmp(type, "Prepend") == 0) {
        x->kind = NORM_PREPEND;
        PD_CHECK(lwrap(L, pdj_get_string(n, path, "prepend", PDJ_REQUIRED, &x->a)));
        x->alen = strlen(x->a);
        x->a = pd_arena_strdup(t->arena, x->a);
    } else if (strcmp(type, "Replace") == 0) {
        x->kind = NORM_REPLACE;
        PD_CHECK(parse_pattern_string(L, n, path, &x->a, &x->alen));
        PD_CHECK(lwrap(L, pdj_get_string(n, path, "content", PDJ_REQUIRED, &x->b)));
        x->blen = strlen(x->b);
        x->a = pd_arena_strndup(t->arena, x->a, x->alen);
        x->b = pd_arena_strdup(t->arena, x->b);
    } else if (strcmp(type, "NFC") == 0) {
        x->kind = NORM_NFC;
    } else {
        return lerr(L, PD_EUNSUPPORTED,
                    "%s.type: unsupported normalizer \"%s\" (supported: Sequence, Prepend, "
                    "Replace, NFC)",
                    path, type);
    }
    if ((x->kind != NORM_NFC && !x->a) || (x->kind == NORM_REPLACE && !x->b))
        return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    t->n_norm++;
    return 0;
}

static const char RX_LLAMA3_STR[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char RX_QWEN2_STR[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char RX_GPT2_STR[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int add_pre(loader *L, json_t *n, const char *path, int depth)
{
    pd_tok *t = L->t;
    const char *type;
    PD_CHECK(get_type(L, n, path, &type));
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr;
        PD_CHECK(lwrap(L, pdj_get_array(n, path, "pretokenizers", PDJ_REQUIRED, &arr)));
        if (depth > 4)
            return lerr(L, PD_EUNSUPPORTED, "%s: pre-tokenizers nested too deeply", path);
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char p[128];
            if (snprintf(p, sizeof p, "%s.pretokenizers[%zu]", path, i) >= (int)sizeof p)
                return lerr(L, PD_EUNSUPPORTED, "%s: pre-tokenizers nested too deeply", path);
            PD_CHECK(add_pre(L, json_array_get(arr, i), p, depth + 1));
        }
        return 0;
    }
    if (t->n_pre >= 8) return lerr(L, PD_EUNSUPPORTED, "%s: more than 8 pre-tokenizers", path);
    pd_tok_pre *x = &t->pre[t->n_pre];
    memset(x, 0, sizeof *x);
    x->regex = -1;
    if (strcmp(type, "Split") == 0) {
        x->kind = PRE_SPLIT;
        json_t *pat;
        PD_CHECK(lwrap(L, pdj_get_object(n, path, "pattern", PDJ_REQUIRED, &pat)));
        json_t *rx = json_object_get(pat, "Regex");
        if (!rx || !json_is_string(rx))
            return lerr(L, PD_EUNSUPPORTED, "%s.pattern: only {\"Regex\": ...} is supported", path);
        const char *r = json_string_value(rx);
        if (strcmp(r, RX_LLAMA3_STR) == 0)
            x->regex = RX_LLAMA3;
        else if (strcmp(r, RX_QWEN2_STR) == 0)
            x->regex = RX_QWEN2;
        else if (strcmp(r, RX_GPT2_STR) == 0)
            x->regex = RX_GPT2;
        else
            return lerr(L, PD_EUNSUPPORTED,
                        "%s.pattern.Regex: unsupported split regex \"%.300s\" (supported: the "
                        "GPT-2, Llama-3 and Qwen2 patterns)",
                        path, r);
        const char *behavior = "Isolated";
        bool invert = false;
        PD_CHECK(lwrap(L, pdj_get_string(n, path, "behavior", PDJ_OPTIONAL, &behavior)));
        PD_CHECK(lwrap(L, pdj_get_bool(n, path, "invert", PDJ_OPTIONAL, &invert)));
        if (strcmp(behavior, "Isolated") != 0 || invert)
            return lerr(L, PD_EUNSUPPORTED,
                        "%s.behavior: only \"Isolated\" with invert false is supported", path);
    } else if (strcmp(type, "ByteLevel") == 0) {
        x->kind = PRE_BYTELEVEL;
        bool use_regex = true;
        PD_CHECK(lwrap(
            L, pdj_get_bool(n, path, "add_prefix_space", PDJ_OPTIONAL, &x->add_prefix_space)));
        PD_CHECK(lwrap(L, pdj_get_bool(n, path, "use_regex", PDJ_OPTIONAL, &use_regex)));
        x->regex = use_regex ? RX_GPT2 : -1;
        t->mode = TOK_MODE_BYTELEVEL;
    } else if (strcmp(type, "Metaspace") == 0) {
        x->kind = PRE_METASPACE;
        const char *repl = "\xe2\x96\x81", *scheme = NULL;
        bool add_prefix = true;
        x->split = true;
        PD_CHECK(lwrap(L, pdj_get_string(n, path, "replacement", PDJ_OPTIONAL, &repl)));
        PD_CHECK(lwrap(L, pdj_get_bool(n, path, "add_prefix_space", PDJ_OPTIONAL, &add_prefix)));
        PD_CHECK(lwrap(L, pdj_get_string(n, path, "prepend_scheme", PDJ_OPTIONAL, &scheme)));
        PD_CHECK(lwrap(L, pdj_get_bool(n, path, "split", PDJ_OPTIONAL, &x->split)));
        x->repl_len = strlen(repl);
        x->repl = pd_arena_strdup(t->arena, repl);
        if (x->repl_len == 0) return lerr(L, PD_EINVAL, "%s.replacement: empty", path);
        if (!scheme)
            x->prepend_scheme = add_prefix ? PREPEND_ALWAYS : PREPEND_NEVER;
        else if (strcmp(scheme, "always") == 0)
            x->prepend_scheme = PREPEND_ALWAYS;
        else if (strcmp(scheme, "first") == 0)
            x->prepend_scheme = PREPEND_FIRST;
        else if (strcmp(scheme, "never") == 0)
            x->prepend_scheme = PREPEND_NEVER;
        else
            return lerr(L, PD_EINVAL, "%s.prepend_scheme: unknown value \"%s\"", path, scheme);
    } else {
        return lerr(L, PD_EUNSUPPORTED,
                    "%s.type: unsupported pre-tokenizer \"%s\" (supported: Sequence, Split, "
                    "ByteLevel, Metaspace)",
                    path, type);
    }
    if (x->kind == PRE_METASPACE && !x->repl)
        return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    t->n_pre++;
    return 0;
}

/* Looks up an added token or model token by content; -1 when absent. */
static int32_t find_any(const pd_tok *t, const char *s, size_t n)
{
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len == n && memcmp(t->added[i].s, s, n) == 0) return t->added[i].id;
    return pd_tok_vocab_find(t, s, n);
}

static int add_post(loader *L, json_t *n, const char *path, int depth)
{
    pd_tok *t = L->t;
    const char *type;
    PD_CHECK(get_type(L, n, path, &type));
    if (strcmp(type, "ByteLevel") == 0) return 0; /* only adjusts offsets */
    if (strcmp(type, "Sequence") == 0) {
        json_t *arr;
        PD_CHECK(lwrap(L, pdj_get_array(n, path, "processors", PDJ_REQUIRED, &arr)));
        if (depth > 4)
            return lerr(L, PD_EUNSUPPORTED, "%s: post-processors nested too deeply", path);
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char p[128];
            snprintf(p, sizeof p, "%s.processors[%zu]", path, i);
            PD_CHECK(add_post(L, json_array_get(arr, i), p, depth + 1));
        }
        return 0;
    }
    if (strcmp(type, "TemplateProcessing") != 0)
        return lerr(L, PD_EUNSUPPORTED,
                    "%s.type: unsupported post-processor \"%s\" (supported: TemplateProcessing, "
                    "ByteLevel, Sequence)",
                    path, type);
    json_t *single, *specials = NULL; /* absent special_tokens: each token's own id */
    PD_CHECK(lwrap(L, pdj_get_array(n, path, "single", PDJ_REQUIRED, &single)));
    PD_CHECK(lwrap(L, pdj_get_object(n, path, "special_tokens", PDJ_OPTIONAL, &specials)));
    bool seen_a = false;
    t->n_post_pre = t->n_post_suf = 0;
    for (size_t i = 0; i < json_array_size(single); i++) {
        json_t *item = json_array_get(single, i);
        json_t *sp = json_object_get(item, "SpecialToken");
        json_t *seq = json_object_get(item, "Sequence");
        if (seq) {
            const char *sid = json_string_value(json_object_get(seq, "id"));
            if (!sid || strcmp(sid, "A") != 0 || seen_a)
                return lerr(L, PD_EUNSUPPORTED,
                            "%s.single[%zu]: only one Sequence \"A\" is supported", path, i);
            seen_a = true;
            continue;
        }
        const char *name = sp ? json_string_value(json_object_get(sp, "id")) : NULL;
        if (!name)
            return lerr(L, PD_EPARSE, "%s.single[%zu]: expected SpecialToken or Sequence", path, i);
        /* ids from special_tokens[name].ids, else the token's own id */
        json_t *ent = specials ? json_object_get(specials, name) : NULL;
        json_t *ids = ent ? json_object_get(ent, "ids") : NULL;
        int32_t buf[4];
        size_t nb = 0;
        if (ids && json_is_array(ids)) {
            for (size_t k = 0; k < json_array_size(ids) && nb < 4; k++) {
                json_t *v = json_array_get(ids, k);
                if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                    json_integer_value(v) >= t->n_ids)
                    return lerr(L, PD_EINVAL, "%s.special_tokens[\"%s\"].ids[%zu]: bad id", path,
                                name, k);
                buf[nb++] = (int32_t)json_integer_value(v);
            }
        } else {
            int32_t id = find_any(t, name, strlen(name));
            if (id < 0)
                return lerr(L, PD_EINVAL,
                            "%s.single[%zu]: special token \"%s\" is not in the vocabulary", path,
                            i, name);
            buf[nb++] = id;
        }
        for (size_t k = 0; k < nb; k++) {
            int *cnt = seen_a ? &t->n_post_suf : &t->n_post_pre;
            int32_t *dst = seen_a ? t->post_suf : t->post_pre;
            if (*cnt >= 4)
                return lerr(L, PD_EUNSUPPORTED, "%s.single: more than 4 special tokens on a side",
                            path);
            dst[(*cnt)++] = buf[k];
        }
    }
    return 0;
}

static bool is_strip_space(json_t *d)
{
    json_t *c = json_object_get(d, "content");
    json_t *stop = json_object_get(d, "stop");
    return c && json_is_string(c) && strcmp(json_string_value(c), " ") == 0 &&
           (!stop || (json_is_integer(stop) && json_integer_value(stop) == 0));
}

static int load_decoder(loader *L, json_t *root)
{
    pd_tok *t = L->t;
    json_t *d = json_object_get(root, "decoder");
    if (!d || json_is_null(d)) {
        t->dec_mode = DEC_NONE;
        return 0;
    }
    if (!json_is_object(d))
        return lerr(L, PD_EPARSE, "decoder: expected object, got %s", pdj_type_name(d));
    const char *type;
    PD_CHECK(get_type(L, d, "decoder", &type));
    if (strcmp(type, "ByteLevel") == 0) {
        t->dec_mode = DEC_BYTELEVEL;
        return 0;
    }
    t->dec_mode = DEC_SPM;
    if (strcmp(type, "Metaspace") == 0) {
        const char *scheme = NULL;
        bool add_prefix = true;
        PD_CHECK(
            lwrap(L, pdj_get_bool(d, "decoder", "add_prefix_space", PDJ_OPTIONAL, &add_prefix)));
        PD_CHECK(lwrap(L, pdj_get_string(d, "decoder", "prepend_scheme", PDJ_OPTIONAL, &scheme)));
        t->dec_meta_first = scheme ? strcmp(scheme, "never") != 0 : add_prefix;
        return 0;
    }
    if (strcmp(type, "Sequence") != 0)
        return lerr(L, PD_EUNSUPPORTED,
                    "decoder.type: unsupported decoder \"%s\" (supported: ByteLevel, Metaspace, "
                    "Sequence of Replace/ByteFallback/Fuse/Strip)",
                    type);
    json_t *arr;
    PD_CHECK(lwrap(L, pdj_get_array(d, "decoder", "decoders", PDJ_REQUIRED, &arr)));
    /* The SentencePiece chain: Replace("▁" -> " "), ByteFallback, Fuse, Strip(" ", n, 0).
     * Each step is optional but the order is fixed, and Strip must follow Fuse (then it
     * acts on the whole text, which is what the incremental decoder relies on). */
    int stage = 0;
    bool fused = false;
    for (size_t i = 0; i < json_array_size(arr); i++) {
        char p[64];
        snprintf(p, sizeof p, "decoder.decoders[%zu]", i);
        json_t *x = json_array_get(arr, i);
        const char *xt;
        PD_CHECK(get_type(L, x, p, &xt));
        if (strcmp(xt, "Replace") == 0 && stage < 1) {
            const char *pat;
            size_t plen;
            const char *content;
            PD_CHECK(parse_pattern_string(L, x, p, &pat, &plen));
            PD_CHECK(lwrap(L, pdj_get_string(x, p, "content", PDJ_REQUIRED, &content)));
            if (strcmp(pat, "\xe2\x96\x81") != 0 || strcmp(content, " ") != 0)
                return lerr(L, PD_EUNSUPPORTED,
                            "%s: only Replace \"\xe2\x96\x81\" -> \" \" is supported", p);
            stage = 1;
        } else if (strcmp(xt, "ByteFallback") == 0 && stage < 2) {
            t->dec_byte_fallback = true;
            stage = 2;
        } else if (strcmp(xt, "Fuse") == 0 && stage < 3) {
            fused = true;
            stage = 3;
        } else if (strcmp(xt, "Strip") == 0 && fused && stage < 4 && is_strip_space(x)) {
            int64_t start = 0;
            PD_CHECK(lwrap(L, pdj_get_int_range(x, p, "start", PDJ_OPTIONAL, 0, 64, &start)));
            t->dec_strip = (int)start;
            stage = 4;
        } else {
            return lerr(L, PD_EUNSUPPORTED,
                        "%s: unsupported decoder step \"%s\" here (supported: Replace, "
                        "ByteFallback, Fuse, Strip(\" \") in that order, Strip after Fuse)",
                        p, xt);
        }
    }
    if (stage < 1)
        return lerr(L, PD_EUNSUPPORTED,
                    "decoder: a Sequence without Replace(\"\xe2\x96\x81\") is not supported");
    return 0;
}

/* Byte-level alphabet (GPT-2): printable Latin-1 bytes map to themselves, the others to
 * U+0100 + k in byte order. */
static void build_bytelevel(pd_tok *t)
{
    int k = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        uint32_t cp = printable ? (uint32_t)b : 0x100u + (uint32_t)k++;
        t->bl_enc_len[b] = (uint8_t)pd_utf8_encode(cp, t->bl_enc[b]);
    }
}

static const char *config_token(loader *L, json_t *cfg, const char *key, int *rc)
{
    json_t *v = json_object_get(cfg, key);
    *rc = 0;
    if (!v || json_is_null(v)) return NULL;
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!v || !json_is_string(v)) {
        *rc = lerr(L, PD_EPARSE, "%s: expected a string or {\"content\": string}", key);
        return NULL;
    }
    return json_string_value(v);
}

static int load_config(loader *L, const char *config_json)
{
    pd_tok *t = L->t;
    t->bos_id = t->eos_id = t->unk_id = t->pad_id = -1;
    t->unk_id = t->model_unk_id;
    /* Defaults from tokenizer.json's post-processor. */
    if (t->n_post_pre > 0) t->bos_id = t->post_pre[0];
    t->add_bos = t->n_post_pre > 0;
    t->add_eos = t->n_post_suf > 0;
    if (!config_json) return 0;
    int rc = pdj_load_file(config_json, &t->config);
    if (rc < 0) return rc;
    if (!json_is_object(t->config))
        return pd_error(PD_EPARSE, "%s: expected a JSON object", config_json);
    L->file = config_json;
    static const char *const keys[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    int32_t *ids[] = {&t->bos_id, &t->eos_id, &t->unk_id, &t->pad_id};
    for (int i = 0; i < 4; i++) {
        const char *s = config_token(L, t->config, keys[i], &rc);
        if (rc < 0) return rc;
        if (i == 0) t->bos_tok = s;
        if (i == 1) t->eos_tok = s;
        if (!s) {
            if (i == 0 && json_object_get(t->config, "bos_token"))
                t->bos_id = -1; /* explicitly null */
            continue;
        }
        int32_t id = find_any(t, s, strlen(s));
        if (id < 0)
            return lerr(L, PD_EINVAL, "%s: token \"%s\" is not in the vocabulary", keys[i], s);
        *ids[i] = id;
    }
    /* add_bos_token/add_eos_token, when present, rebuild the post-processor as
     * transformers' LlamaTokenizerFast.update_post_processor does: [bos] A [eos]. */
    json_t *ab = json_object_get(t->config, "add_bos_token");
    json_t *ae = json_object_get(t->config, "add_eos_token");
    if ((ab && !json_is_boolean(ab)) || (ae && !json_is_boolean(ae)))
        return lerr(L, PD_EPARSE, "%s: expected a boolean",
                    ab && !json_is_boolean(ab) ? "add_bos_token" : "add_eos_token");
    if (ab || ae) {
        t->add_bos = ab && json_is_true(ab) && t->bos_id >= 0;
        t->add_eos = ae && json_is_true(ae) && t->eos_id >= 0;
        t->n_post_pre = t->n_post_suf = 0;
        if (t->add_bos) t->post_pre[t->n_post_pre++] = t->bos_id;
        if (t->add_eos) t->post_suf[t->n_post_suf++] = t->eos_id;
    }
    return 0;
}

static int cmp_added(const void *a, const void *b)
{
    const pd_tok_added *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int finish_added(loader *L)
{
    pd_tok *t = L->t;
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, cmp_added);
    for (int i = 0; i < t->n_added; i++) {
        pd_tok_added *a = &t->added[i];
        if (a->normalized) {
            uint8_t *ns;
            size_t nl;
            PD_CHECK(pd_tok_normalize(t, (const uint8_t *)a->s, a->len, &ns, &nl));
            a->ns = pd_arena_strndup(t->arena, (const char *)ns, nl);
            free(ns);
            if (!a->ns) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
            a->nlen = (uint32_t)nl;
            t->any_normalized_added = true;
        } else {
            uint8_t b = (uint8_t)a->s[0];
            t->added_first[b >> 3] |= (uint8_t)(1u << (b & 7));
        }
    }
    return 0;
}

/* True when no model token contains "▁" right after a character other than "▁". BPE
 * symbols are always vocab tokens, so then no symbol can span such a position and cutting
 * the text there gives the same ids as BPE over the whole text (SentencePiece-style models
 * without a pre-tokenizer would otherwise run BPE over a whole paragraph). */
static bool spm_split_safe(const pd_tok *t)
{
    static const char META[] = "\xe2\x96\x81";
    for (int32_t id = 0; id < t->n_ids; id++) {
        const char *s = t->id_str[id];
        if (!s || (t->id_flags[id] & TOKF_ADDED)) continue;
        size_t n = t->id_len[id];
        for (size_t i = 1; i + 3 <= n; i++)
            if (memcmp(s + i, META, 3) == 0 && !(i >= 3 && memcmp(s + i - 3, META, 3) == 0))
                return false;
    }
    return true;
}

int pd_tok_load_files(const char *tokenizer_json, const char *config_json, pd_tok **out)
{
    *out = NULL;
    if (!tokenizer_json) return pd_error(PD_EINVAL, "pd_tok_load_files: tokenizer_json is NULL");
    pd_tok *t = calloc(1, sizeof *t);
    if (!t) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    t->arena = pd_arena_create(1 << 20);
    t->norm = calloc(16, sizeof *t->norm);
    t->pre = calloc(8, sizeof *t->pre);
    if (!t->arena || !t->norm || !t->pre) {
        pd_tok_free(t);
        return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    }
    for (int b = 0; b < 256; b++) t->byte_tok[b] = -1;
    loader L = {t, tokenizer_json};
    json_t *root = NULL;
    int rc = pdj_load_file(tokenizer_json, &root);
    if (rc < 0) goto fail;
    if (!json_is_object(root)) {
        rc = lerr(&L, PD_EPARSE, "expected a JSON object");
        goto fail;
    }
    PD_CHECK_GOTO(load_model(&L, root), rc, fail);
    json_t *n = json_object_get(root, "normalizer");
    if (n && !json_is_null(n)) PD_CHECK_GOTO(add_norm(&L, n, "normalizer", 0), rc, fail);
    n = json_object_get(root, "pre_tokenizer");
    if (n && !json_is_null(n)) PD_CHECK_GOTO(add_pre(&L, n, "pre_tokenizer", 0), rc, fail);
    PD_CHECK_GOTO(load_added(&L, root), rc, fail);
    n = json_object_get(root, "post_processor");
    if (n && !json_is_null(n)) PD_CHECK_GOTO(add_post(&L, n, "post_processor", 0), rc, fail);
    PD_CHECK_GOTO(load_decoder(&L, root), rc, fail);

    build_bytelevel(t);
    if (t->mode == TOK_MODE_BYTELEVEL) {
        for (int b = 0; b < 256; b++)
            t->byte_tok[b] = pd_tok_vocab_find(t, (const char *)t->bl_enc[b], t->bl_enc_len[b]);
    } else {
        char name[8];
        for (int c = 0; c < 128; c++) {
            char ch = (char)c;
            t->ascii_tok[c] = pd_tok_vocab_find(t, &ch, 1);
        }
        for (int b = 0; b < 256; b++) {
            snprintf(name, sizeof name, "<0x%02X>", b);
            t->byte_tok[b] = pd_tok_vocab_find(t, name, 6);
        }
    }
    /* ignore_merges looks whole words up first, so words must stay whole there */
    t->spm_split = t->mode == TOK_MODE_CHARS && !t->ignore_merges && spm_split_safe(t);
    PD_CHECK_GOTO(finish_added(&L), rc, fail);
    PD_CHECK_GOTO(pd_tok_build_decoder(t), rc, fail);
    PD_CHECK_GOTO(load_config(&L, config_json), rc, fail);
    json_decref(root);
    *out = t;
    return 0;
fail:
    json_decref(root);
    pd_tok_free(t);
    return rc;
}

int pd_tok_load(const char *model_dir, pd_tok **out)
{
    *out = NULL;
    if (!model_dir) return pd_error(PD_EINVAL, "pd_tok_load: model_dir is NULL");
    size_t n = strlen(model_dir) + 32;
    char *tj = malloc(n), *cj = malloc(n);
    if (!tj || !cj) {
        free(tj);
        free(cj);
        return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    }
    snprintf(tj, n, "%s/tokenizer.json", model_dir);
    snprintf(cj, n, "%s/tokenizer_config.json", model_dir);
    FILE *f = fopen(cj, "rb");
    if (f) fclose(f);
    int rc = pd_tok_load_files(tj, f ? cj : NULL, out);
    free(tj);
    free(cj);
    return rc;
}

void pd_tok_free(pd_tok *t)
{
    if (!t) return;
    if (t->config) json_decref(t->config);
    pd_arena_free(t->arena);
    free(t->norm);
    free(t->pre);
    free(t);
}

/* ---- vocabulary accessors -------------------------------------------------------------- */

int32_t pd_tok_vocab_size(const pd_tok *t)
{
    return t->n_ids;
}

const char *pd_tok_id_to_token(const pd_tok *t, int32_t id)
{
    return id >= 0 && id < t->n_ids ? t->id_str[id] : NULL;
}

int32_t pd_tok_token_to_id(const pd_tok *t, const char *token, size_t len)
{
    return token ? find_any(t, token, len) : -1;
}

bool pd_tok_is_special(const pd_tok *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && (t->id_flags[id] & TOKF_SPECIAL);
}

int32_t pd_tok_bos_id(const pd_tok *t)
{
    return t->bos_id;
}
int32_t pd_tok_unk_id(const pd_tok *t)
{
    return t->unk_id;
}
int32_t pd_tok_pad_id(const pd_tok *t)
{
    return t->pad_id;
}
const char *pd_tok_bos_token(const pd_tok *t)
{
    return t->bos_tok;
}
const char *pd_tok_eos_token(const pd_tok *t)
{
    return t->eos_tok;
}
bool pd_tok_add_bos(const pd_tok *t)
{
    return t->add_bos;
}
bool pd_tok_add_eos(const pd_tok *t)
{
    return t->add_eos;
}
const json_t *pd_tok_config(const pd_tok *t)
{
    return t->config;
}

size_t pd_tok_eos_ids(const pd_tok *t, const int32_t **ids)
{
    *ids = t->eos_id >= 0 ? &t->eos_id : NULL;
    return t->eos_id >= 0 ? 1 : 0;
}
