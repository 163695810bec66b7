/* libFuzzer target: the safetensors reader (common/model/safetensors.c).
 *
 * The input is a whole .safetensors file: 8-byte little-endian header length, JSON header, data
 * region. It is written to a file in a private temporary directory (the reader maps files, so a
 * file is its real entry point) and opened with pd_st_open. Beyond "no crash, no leak, no UB",
 * every file that opens must satisfy what the header comment promises, else abort (a finding):
 * each tensor's nbytes is numel x element size and its bytes are readable; the tensors cover the
 * data region exactly; lookups by name find each tensor; and writing the tensors back with
 * pd_st_write gives a file that opens again with the same names, dtypes, shapes and bytes.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/safetensors.h"
#include "util/status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char g_dir[256], g_in[300], g_out[300];

static void fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_safetensors invariant broken: %s: %s\n", what, detail);
    abort();
}

static void cleanup(void)
{
    unlink(g_in);
    unlink(g_out);
    rmdir(g_dir);
}

static void setup(void)
{
    if (g_dir[0]) return;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(g_dir, sizeof g_dir, "%s/fuzz_safetensors.XXXXXX", base);
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        abort();
    }
    snprintf(g_in, sizeof g_in, "%s/in.safetensors", g_dir);
    snprintf(g_out, sizeof g_out, "%s/out.safetensors", g_dir);
    atexit(cleanup);
}

static int write_file(const char *path, const uint8_t *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = size ? fwrite(data, 1, size, f) : 0;
    int rc = fclose(f);
    return w == size && rc == 0 ? 0 : -1;
}

/* Sums every byte, so a tensor view that points outside its data faults under ASan or mmap. */
static unsigned touch(const pd_tensor *t)
{
    unsigned s = 0;
    const unsigned char *p = t->data;
    for (size_t i = 0; i < t->nbytes; i++) s += p[i];
    return s;
}

static void check_open(const pd_st *st, uint64_t data_bytes)
{
    uint64_t total = 0;
    char buf[160];
    for (size_t i = 0; i < pd_st_count(st); i++) {
        const pd_tensor *t = pd_st_at(st, i);
        if (!t || !t->name) fail("pd_st_at", "NULL inside the count");
        if (t->ndim < 0 || t->ndim > PD_TENSOR_MAX_DIMS) fail("ndim out of range", t->name);
        if ((uint64_t)pd_tensor_numel(t) * pd_dtype_size(t->dtype) != t->nbytes)
            fail("nbytes is not numel x element size", t->name);
        if (t->nbytes && ((uintptr_t)t->data % pd_dtype_size(t->dtype)) != 0)
            fail("misaligned tensor data", t->name);
        (void)touch(t);
        if (pd_st_get(st, t->name) != t) fail("pd_st_get does not find", t->name);
        (void)pd_tensor_shape_str(t, buf, sizeof buf);
        total += t->nbytes;
    }
    if (total != data_bytes) {
        snprintf(buf, sizeof buf, "tensors hold %llu bytes, data region %llu",
                 (unsigned long long)total, (unsigned long long)data_bytes);
        fail("data region not covered exactly", buf);
    }
}

static void check_rewrite(const pd_st *st)
{
    size_t n = pd_st_count(st);
    pd_tensor *ts = calloc(n ? n : 1, sizeof *ts);
    if (!ts) return;
    for (size_t i = 0; i < n; i++) ts[i] = *pd_st_at(st, i);
    if (pd_st_write(g_out, ts, n, NULL, NULL) < 0) fail("pd_st_write", pd_last_error());
    pd_st *again = NULL;
    if (pd_st_open(g_out, &again) < 0) fail("rewritten file does not open", pd_last_error());
    if (pd_st_count(again) != n) fail("rewrite", "tensor count differs");
    for (size_t i = 0; i < n; i++) {
        const pd_tensor *a = &ts[i], *b = pd_st_get(again, a->name);
        if (!b) fail("rewrite lost a tensor", a->name);
        if (a->dtype != b->dtype || a->ndim != b->ndim || a->nbytes != b->nbytes ||
            memcmp(a->shape, b->shape, sizeof a->shape) != 0)
            fail("rewrite changed a tensor's dtype or shape", a->name);
        if (a->nbytes && memcmp(a->data, b->data, a->nbytes) != 0)
            fail("rewrite changed a tensor's bytes", a->name);
    }
    pd_st_close(again);
    free(ts);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    if (write_file(g_in, data, size) < 0) {
        perror(g_in);
        abort();
    }
    pd_st *st = NULL;
    pd_error_clear();
    if (pd_st_open(g_in, &st) == 0) {
        uint64_t hlen = 0;
        for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | data[i];
        if (pd_st_file_count(st) != 1) fail("file count", "not 1");
        check_open(st, (uint64_t)size - 8 - hlen);
        check_rewrite(st);
        pd_st_close(st);
    } else if (pd_last_error()[0] == '\0') {
        fail("pd_st_open failed", "without a message");
    }
    return 0;
}
