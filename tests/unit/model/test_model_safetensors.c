/* Unit tests of the safetensors reader and writer: a round trip, malformed files built byte by
 * byte, sharded checkpoints with an index. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model_common.h"
#include "model/safetensors.h"

/* A safetensors file from a header string and n_data bytes of data (filled with 0x11). */
static int write_st_raw(const char *path, const char *header, size_t n_data, uint64_t hlen_override)
{
    size_t hl = strlen(header);
    size_t total = 8 + hl + n_data;
    unsigned char *b = malloc(total);
    if (!b) return -1;
    uint64_t hlen = hlen_override ? hlen_override : hl;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(b + 8, header, hl);
    memset(b + 8 + hl, 0x11, n_data);
    int rc = write_file(path, b, total);
    free(b);
    return rc;
}

/* ---- safetensors ----------------------------------------------------------------------------- */

TEST(st_write_read_roundtrip)
{
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[3] = {0x3c00, 0x4000, 0xc000};
    uint16_t c[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
    pd_tensor t[3];
    memset(t, 0, sizeof t);
    t[0] = (pd_tensor){
        .name = "a.weight", .dtype = PD_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .data = a};
    t[1] = (pd_tensor){.name = "b", .dtype = PD_DTYPE_F16, .ndim = 1, .shape = {3}, .data = b};
    t[2] =
        (pd_tensor){.name = "c", .dtype = PD_DTYPE_BF16, .ndim = 3, .shape = {1, 2, 2}, .data = c};
    const char *p = tmp_path("rt.safetensors");
    ASSERT_OK(pd_st_write(p, t, 3, NULL, NULL));
    pd_st *st;
    ASSERT_OK(pd_st_open(p, &st));
    ASSERT_EQ_INT(pd_st_count(st), 3);
    ASSERT_EQ_INT(pd_st_file_count(st), 1);
    const pd_tensor *x;
    int rc = pd_st_find(st, "a.weight", &x);
    if (rc < 0) pd_st_close(st);
    ASSERT_OK(rc);
    int ok = x->dtype == PD_DTYPE_F32 && x->ndim == 2 && x->shape[0] == 2 && x->shape[1] == 3 &&
             x->nbytes == 24 && memcmp(x->data, a, 24) == 0 && strcmp(x->file, p) == 0 &&
             ((uintptr_t)x->data % 8) == 0;
    const pd_tensor *y = pd_st_get(st, "b"), *z = pd_st_get(st, "c");
    ok = ok && y && y->dtype == PD_DTYPE_F16 && memcmp(y->data, b, 6) == 0;
    ok = ok && z && z->dtype == PD_DTYPE_BF16 && z->ndim == 3 && memcmp(z->data, c, 8) == 0;
    ok = ok && pd_st_get(st, "nope") == NULL && pd_tensor_numel(z) == 4;
    rc = pd_st_find(st, "nope", &x);
    pd_st_close(st);
    ASSERT(ok);
    ASSERT_EQ_INT(rc, PD_ENOTFOUND);
    ASSERT_CONTAINS(pd_last_error(), "rt.safetensors: tensor 'nope' not found");
    /* the header carries __metadata__ {"format": "pt"} and is padded to 8 bytes */
    size_t n;
    char *raw = read_all(p, &n);
    ASSERT(raw);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | (unsigned char)raw[i];
    int good = hl % 8 == 0 && strstr(raw + 8, "\"__metadata__\":{\"format\":\"pt\"}") != NULL;
    free(raw);
    ASSERT(good);
    /* writer errors */
    t[1].name = "a.weight";
    ASSERT_ERR(pd_st_write(tmp_path("dup.safetensors"), t, 2, NULL, NULL), PD_EINVAL,
               "'a.weight' given twice");
}

typedef struct {
    const char *header;
    size_t n_data;
    uint64_t hlen; /* 0: the real length */
    int code;
    const char *msg;
} bad_st;

TEST(st_malformed_files)
{
    static const bad_st cases[] = {
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 1u << 30, PD_EPARSE,
         "bad header length 1073741824"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 1, PD_EPARSE,
         "bad header length 1"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]", 8, 0, PD_EPARSE,
         "header: line 1"},
        {"[1,2,3]", 0, 0, PD_EPARSE, "header: expected a JSON object, got array"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, 0, PD_EPARSE,
         "tensor 't': data_offsets [0, 8] out of bounds (data region is 4 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, 0, PD_EPARSE, "tensor 'b' [4, 12) overlaps tensor 'a'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         12, 0, PD_EPARSE, "tensor 'b' starts at byte 8, leaving a hole after byte 4"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 12, 0, PD_EPARSE,
         "8 trailing bytes after the last tensor"},
        {"{\"w\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, 0, PD_EUNSUPPORTED,
         "tensor 'w': unsupported dtype \"I64\""},
        {"{\"w\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, 0, PD_EUNSUPPORTED,
         "tensor 'w': unsupported dtype \"Q4\""},
        {"{\"w\":{\"dtype\":\"F16\",\"shape\":[3,2],\"data_offsets\":[0,8]}}", 8, 0, PD_EPARSE,
         "tensor 'w': shape [3, 2] x F16 (2 bytes each) does not match its 8 data bytes"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8,
         0, PD_EPARSE, "does not match its 8 data bytes"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, 0, PD_EPARSE,
         "tensor 'w': shape[0]: expected a non-negative integer"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, 0, PD_EPARSE,
         "begin after end"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, 0, PD_EPARSE,
         "tensor 'w': data_offsets: expected [begin, end]"},
        {"{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 0, PD_EPARSE,
         "tensor 'w': w.dtype: required"},
        {"{\"w\":[1]}", 0, 0, PD_EPARSE, "tensor 'w': expected an object, got array"},
        {"{\"__metadata__\":3}", 0, 0, PD_EPARSE, "__metadata__: expected an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "bad%zu.safetensors", i);
        const char *p = tmp_path(name);
        ASSERT(write_st_raw(p, cases[i].header, cases[i].n_data, cases[i].hlen) == 0);
        pd_st *st = NULL;
        int rc = pd_st_open(p, &st);
        ASSERT_MSG(rc == cases[i].code && st == NULL, "case %zu: expected %s, got %s (%s)", i,
                   pd_status_name(cases[i].code), pd_status_name(rc), pd_last_error());
        ASSERT_MSG(strstr(pd_last_error(), name), "case %zu: \"%s\" lacks the file name", i,
                   pd_last_error());
        ASSERT_MSG(strstr(pd_last_error(), cases[i].msg), "case %zu: \"%s\" lacks \"%s\"", i,
                   pd_last_error(), cases[i].msg);
    }
    /* a header that was not padded to 8 bytes: data still handed out aligned and intact */
    const char *u = tmp_path("unaligned.safetensors");
    ASSERT(write_st_raw(u, "{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                        0) == 0);
    pd_st *ust;
    ASSERT_OK(pd_st_open(u, &ust));
    const pd_tensor *ut = pd_st_get(ust, "t");
    uint32_t bits[2] = {0, 0};
    int aligned = ut && ((uintptr_t)ut->data % 8) == 0;
    if (ut) memcpy(bits, ut->data, 8);
    pd_st_close(ust);
    ASSERT(aligned && bits[0] == 0x11111111u && bits[1] == 0x11111111u);
    ASSERT(write_st_raw(u,
                        "{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]},"
                        "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
                        6, 0) == 0);
    ASSERT_ERR(pd_st_open(u, &ust), PD_EUNSUPPORTED,
               "tensor 'b': data offset 2 is not a multiple of its 4-byte element size");
    /* shorter than the length prefix, empty, missing */
    const char *p = tmp_path("short.safetensors");
    ASSERT(write_file(p, "\x10\x00\x00", 3) == 0);
    pd_st *st;
    ASSERT_ERR(pd_st_open(p, &st), PD_EPARSE, "short.safetensors: file is 3 bytes, too short");
    ASSERT(write_file(p, "", 0) == 0);
    ASSERT_ERR(pd_st_open(p, &st), PD_EPARSE, "file is 0 bytes");
    ASSERT_ERR(pd_st_open(tmp_path("none.safetensors"), &st), PD_ENOTFOUND, "none.safetensors");
    /* a valid file cut short: offsets now point past the end */
    float v[64] = {0};
    pd_tensor t = {.name = "big", .dtype = PD_DTYPE_F32, .ndim = 1, .shape = {64}, .data = v};
    p = tmp_path("trunc.safetensors");
    ASSERT_OK(pd_st_write(p, &t, 1, NULL, NULL));
    struct stat sb;
    ASSERT(stat(p, &sb) == 0 && sb.st_size > 8 + 256);
    ASSERT(truncate(p, sb.st_size - 16) == 0);
    ASSERT_ERR(pd_st_open(p, &st), PD_EPARSE,
               "tensor 'big': data_offsets [0, 256] out of bounds (data region is 240 bytes");
    /* a directory with no checkpoint */
    const char *d = tmp_path("emptydir");
    mkdir(d, 0755);
    ASSERT_ERR(pd_st_open(d, &st), PD_ENOTFOUND,
               "emptydir: no model.safetensors or model.safetensors.index.json");
}

static int write_shard(const char *dir, const char *file, const char *n1, const char *n2)
{
    float v[4] = {1, 2, 3, 4};
    pd_tensor t[2] = {{.name = n1, .dtype = PD_DTYPE_F32, .ndim = 1, .shape = {2}, .data = v},
                      {.name = n2, .dtype = PD_DTYPE_F32, .ndim = 1, .shape = {2}, .data = v + 2}};
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    return pd_st_write(p, t, n2 ? 2 : 1, NULL, NULL);
}

TEST(st_sharded_index)
{
    const char *d = tmp_path("sharded");
    mkdir(d, 0755);
    ASSERT_OK(write_shard(d, "model-00001-of-00002.safetensors", "w.a", "w.b"));
    ASSERT_OK(write_shard(d, "model-00002-of-00002.safetensors", "w.c", NULL));
    char idx[4096];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", d);
    ASSERT(write_text(idx, "{\"metadata\": {\"total_size\": 24}, \"weight_map\": {"
                           "\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.b\": \"model-00001-of-00002.safetensors\", "
                           "\"w.c\": \"model-00002-of-00002.safetensors\"}}") == 0);
    pd_st *st;
    ASSERT_OK(pd_st_open(d, &st));
    int ok = pd_st_count(st) == 3 && pd_st_file_count(st) == 2 && pd_st_get(st, "w.c") &&
             strstr(pd_st_get(st, "w.c")->file, "model-00002-of-00002") &&
             ((const float *)pd_st_get(st, "w.b")->data)[1] == 4.0f;
    pd_st_close(st);
    ASSERT(ok);
    /* the index names a shard that is not there */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.z\": \"model-00003-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_ENOTFOUND,
               "model-00003-of-00002.safetensors (holding tensor 'w.z') is missing");
    ASSERT_CONTAINS(pd_last_error(), "model.safetensors.index.json");
    /* a tensor the index puts in a shard that lacks it */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.q\": \"model-00002-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_ENOTFOUND, "tensor 'w.q' listed in the index is not in");
    /* the index puts a tensor in the wrong shard */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00002-of-00002.safetensors\", "
                           "\"w.c\": \"model-00001-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "tensor 'w.a' listed in");
    /* a path instead of a file name, a missing weight_map, bad JSON */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"../x.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "is not a plain file name");
    ASSERT(write_text(idx, "{\"metadata\": {}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "model.safetensors.index.json: weight_map: required");
    ASSERT(write_text(idx, "{\"weight_map\": ") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EPARSE, "model.safetensors.index.json: line 1");
    /* the same tensor in two shards */
    ASSERT_OK(write_shard(d, "model-00002-of-00002.safetensors", "w.a", NULL));
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.x\": \"model-00002-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "tensor 'w.a' also in");
}
