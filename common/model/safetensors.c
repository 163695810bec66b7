/* safetensors reader (mmap, every header invariant checked before use) and writer.
 *
 * Design: each file is mapped whole, read-only; its header is parsed with jansson into
 * pd_tensor views that point into the mapping, so opening a multi-gigabyte checkpoint costs
 * a few page faults plus header parsing. All tensors of all shards go into one array with an
 * open-addressing name index, so lookups during model load are O(1).
 */
#include "model/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json/json.h"
#include "util/status.h"

/* Header larger than this is refused (real checkpoints have < 1 MB). */
#define ST_MAX_HEADER ((uint64_t)100 << 20)

typedef struct {
    char *path;
    void *map; /* whole file, PROT_READ; NULL when the file is empty */
    size_t size;
    void *copy; /* 64-byte aligned copy of the data region when 8 + header length is not a
                   multiple of 8 (old writers did not pad); NULL otherwise */
} st_file;

struct pd_st {
    char *path;
    st_file *files;
    size_t n_files, cap_files;
    pd_tensor *tensors; /* name/file strings owned here (names[], files[].path) */
    char **names;
    size_t n, cap;
    size_t *index; /* open addressing, index_cap slots, value = tensor idx + 1 (0 empty) */
    size_t index_cap;
};

int64_t pd_tensor_numel(const pd_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

const char *pd_tensor_shape_str(const pd_tensor *t, char *buf, size_t n)
{
    size_t len = 0;
    if (n == 0) return buf;
    buf[0] = '\0';
    len += (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->ndim && len < n; i++)
        len +=
            (size_t)snprintf(buf + len, n - len, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (len < n) snprintf(buf + len, n - len, "]");
    return buf;
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static int index_rebuild(pd_st *st)
{
    size_t cap = 16;
    while (cap < st->n * 2) cap *= 2;
    size_t *idx = calloc(cap, sizeof *idx);
    if (!idx) return pd_error(PD_ENOMEM, "safetensors: out of memory");
    for (size_t i = 0; i < st->n; i++) {
        size_t h = (size_t)hash_str(st->tensors[i].name) & (cap - 1);
        while (idx[h]) h = (h + 1) & (cap - 1);
        idx[h] = i + 1;
    }
    free(st->index);
    st->index = idx;
    st->index_cap = cap;
    return PD_OK;
}

const pd_tensor *pd_st_get(const pd_st *st, const char *name)
{
    if (!st->index_cap) return NULL;
    size_t h = (size_t)hash_str(name) & (st->index_cap - 1);
    while (st->index[h]) {
        const pd_tensor *t = &st->tensors[st->index[h] - 1];
        if (strcmp(t->name, name) == 0) return t;
        h = (h + 1) & (st->index_cap - 1);
    }
    return NULL;
}

int pd_st_find(const pd_st *st, const char *name, const pd_tensor **out)
{
    const pd_tensor *t = pd_st_get(st, name);
    if (!t) return pd_error(PD_ENOTFOUND, "%s: tensor '%s' not found", st->path, name);
    *out = t;
    return PD_OK;
}

/* The file a missing tensor should have been in: the single file, else the directory. */
static const char *where(const pd_st *st)
{
    return st->n_files == 1 && st->n > 0 ? st->tensors[0].file : st->path;
}

int pd_st_expect(const pd_st *st, const char *name, int dtype, int ndim, const int64_t *shape,
                 pd_tensor *out)
{
    pd_tensor exp;
    memset(&exp, 0, sizeof exp);
    exp.ndim = ndim;
    for (int i = 0; i < ndim; i++) exp.shape[i] = shape[i];
    char es[96], as[96];
    const pd_tensor *t = pd_st_get(st, name);
    if (!t)
        return pd_error(PD_ENOTFOUND, "%s: tensor '%s' not found (expected shape %s)", where(st),
                        name, pd_tensor_shape_str(&exp, es, sizeof es));
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (!ok)
        return pd_error(PD_EINVAL, "%s: tensor '%s': expected shape %s, got %s", t->file, name,
                        pd_tensor_shape_str(&exp, es, sizeof es),
                        pd_tensor_shape_str(t, as, sizeof as));
    if (dtype == PD_ST_FLOAT ? !pd_dtype_is_float(t->dtype) : (int)t->dtype != dtype)
        return pd_error(PD_EINVAL, "%s: tensor '%s': expected dtype %s, got %s", t->file, name,
                        dtype == PD_ST_FLOAT ? "F32, F16 or BF16" : pd_dtype_st_name(dtype),
                        pd_dtype_st_name(t->dtype));
    *out = *t;
    return PD_OK;
}

size_t pd_st_count(const pd_st *st)
{
    return st->n;
}
const pd_tensor *pd_st_at(const pd_st *st, size_t i)
{
    return i < st->n ? &st->tensors[i] : NULL;
}
const char *pd_st_path(const pd_st *st)
{
    return st->path;
}
size_t pd_st_file_count(const pd_st *st)
{
    return st->n_files;
}

void pd_st_close(pd_st *st)
{
    if (!st) return;
    for (size_t i = 0; i < st->n_files; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].copy);
        free(st->files[i].path);
    }
    for (size_t i = 0; i < st->n; i++) free(st->names[i]);
    free(st->files);
    free(st->tensors);
    free(st->names);
    free(st->index);
    free(st->path);
    free(st);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return PD_OK;
    size_t nc = *cap ? *cap * 2 : 16;
    while (nc < need) nc *= 2;
    void *q = realloc(*p, nc * elem);
    if (!q) return pd_error(PD_ENOMEM, "safetensors: out of memory");
    *p = q;
    *cap = nc;
    return PD_OK;
}

static int map_file(const char *path, st_file *f)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return pd_error(errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return pd_error(PD_EIO, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return pd_error(PD_EINVAL, "%s: not a regular file", path);
    }
    f->size = (size_t)sb.st_size;
    f->map = NULL;
    if (f->size > 0) {
        void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            return pd_error(PD_EIO, "%s: mmap: %s", path, strerror(e));
        }
        f->map = m;
    }
    close(fd);
    return PD_OK;
}

static int dtype_from_st(const char *s, pd_dtype *out)
{
    for (int d = 0; d < PD_DTYPE_ALL_COUNT; d++)
        if (strcmp(s, pd_dtype_st_name((pd_dtype)d)) == 0) {
            *out = (pd_dtype)d;
            return PD_OK;
        }
    return PD_EUNSUPPORTED;
}

typedef struct {
    size_t idx; /* into st->tensors */
    uint64_t begin, end;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Parses one tensor entry of a header; appends it to st. */
static int parse_entry(pd_st *st, const char *fpath, const char *name, const json_t *v,
                       const uint8_t *data, uint64_t data_size, span *sp)
{
    if (!json_is_object(v))
        return pd_error(PD_EPARSE, "%s: tensor '%s': expected an object, got %s", fpath, name,
                        pdj_type_name(v));
    const char *dts;
    json_t *shape, *offs;
    if (pdj_get_string(v, name, "dtype", PDJ_REQUIRED, &dts) < 0 ||
        pdj_get_array(v, name, "shape", PDJ_REQUIRED, &shape) < 0 ||
        pdj_get_array(v, name, "data_offsets", PDJ_REQUIRED, &offs) < 0)
        return pd_error_prefix(PD_EPARSE, "%s: tensor '%s'", fpath, name);
    pd_tensor t;
    memset(&t, 0, sizeof t);
    if (dtype_from_st(dts, &t.dtype) < 0)
        return pd_error(PD_EUNSUPPORTED,
                        "%s: tensor '%s': unsupported dtype \"%s\" (supported: F32, F16, BF16, "
                        "I32, I8, U8, F8_E4M3)",
                        fpath, name, dts);
    size_t nd = json_array_size(shape);
    if (nd > PD_TENSOR_MAX_DIMS)
        return pd_error(PD_EUNSUPPORTED, "%s: tensor '%s': %zu dimensions (at most %d)", fpath,
                        name, nd, PD_TENSOR_MAX_DIMS);
    t.ndim = (int)nd;
    uint64_t numel = 1;
    int overflow = 0;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(shape, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return pd_error(PD_EPARSE,
                            "%s: tensor '%s': shape[%zu]: expected a non-negative "
                            "integer",
                            fpath, name, i);
        t.shape[i] = json_integer_value(d);
        uint64_t dim = (uint64_t)t.shape[i];
        if (dim && numel > UINT64_MAX / dim) overflow = 1;
        numel *= dim;
    }
    if (json_array_size(offs) != 2 || !json_is_integer(json_array_get(offs, 0)) ||
        !json_is_integer(json_array_get(offs, 1)) ||
        json_integer_value(json_array_get(offs, 0)) < 0 ||
        json_integer_value(json_array_get(offs, 1)) < 0)
        return pd_error(PD_EPARSE,
                        "%s: tensor '%s': data_offsets: expected [begin, end] of "
                        "non-negative integers",
                        fpath, name);
    uint64_t b = (uint64_t)json_integer_value(json_array_get(offs, 0));
    uint64_t e = (uint64_t)json_integer_value(json_array_get(offs, 1));
    if (b > e)
        return pd_error(PD_EPARSE, "%s: tensor '%s': data_offsets [%llu, %llu]: begin after end",
                        fpath, name, (unsigned long long)b, (unsigned long long)e);
    if (e > data_size)
        return pd_error(PD_EPARSE,
                        "%s: tensor '%s': data_offsets [%llu, %llu] out of bounds (data region "
                        "is %llu bytes; file truncated?)",
                        fpath, name, (unsigned long long)b, (unsigned long long)e,
                        (unsigned long long)data_size);
    uint64_t es = pd_dtype_size(t.dtype);
    if (overflow || numel > UINT64_MAX / es || numel * es != e - b) {
        char sb[128];
        return pd_error(PD_EPARSE,
                        "%s: tensor '%s': shape %s x %s (%llu bytes each) does not match its "
                        "%llu data bytes",
                        fpath, name, pd_tensor_shape_str(&t, sb, sizeof sb), dts,
                        (unsigned long long)es, (unsigned long long)(e - b));
    }
    if (b % es != 0)
        return pd_error(PD_EUNSUPPORTED,
                        "%s: tensor '%s': data offset %llu is not a multiple of its %llu-byte "
                        "element size",
                        fpath, name, (unsigned long long)b, (unsigned long long)es);
    if (pd_st_get(st, name))
        return pd_error(PD_EINVAL, "%s: tensor '%s' also in %s", fpath, name,
                        pd_st_get(st, name)->file);
    PD_CHECK(grow((void **)&st->tensors, &st->cap, st->n + 1, sizeof *st->tensors));
    char **nn = realloc(st->names, st->cap * sizeof *nn);
    if (!nn) return pd_error(PD_ENOMEM, "safetensors: out of memory");
    st->names = nn;
    char *nm = strdup(name);
    if (!nm) return pd_error(PD_ENOMEM, "safetensors: out of memory");
    st->names[st->n] = nm;
    t.name = nm;
    t.data = data + b;
    t.nbytes = (size_t)(e - b);
    t.file = fpath;
    st->tensors[st->n] = t;
    sp->idx = st->n;
    sp->begin = b;
    sp->end = e;
    st->n++;
    /* keep the index current: sharded opens look names up while adding */
    if (st->n * 2 > st->index_cap) return index_rebuild(st);
    size_t h = (size_t)hash_str(nm) & (st->index_cap - 1);
    while (st->index[h]) h = (h + 1) & (st->index_cap - 1);
    st->index[h] = st->n;
    return PD_OK;
}

/* Maps file fpath (a string owned by st) and adds its tensors. */
static int add_file(pd_st *st, const char *path)
{
    PD_CHECK(grow((void **)&st->files, &st->cap_files, st->n_files + 1, sizeof *st->files));
    st_file *f = &st->files[st->n_files];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return pd_error(PD_ENOMEM, "safetensors: out of memory");
    st->n_files++;
    PD_CHECK(map_file(path, f));
    const char *fp = f->path;
    if (f->size < 8)
        return pd_error(PD_EPARSE, "%s: file is %zu bytes, too short for the 8-byte header length",
                        fp, f->size);
    const uint8_t *p = f->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
    if (hlen < 2 || hlen > ST_MAX_HEADER || hlen > f->size - 8)
        return pd_error(PD_EPARSE, "%s: bad header length %llu (file is %zu bytes; limit %llu)", fp,
                        (unsigned long long)hlen, f->size, (unsigned long long)ST_MAX_HEADER);
    json_t *root = NULL;
    char what[4200];
    snprintf(what, sizeof what, "%s: header", fp);
    PD_CHECK(pdj_loads((const char *)p + 8, (size_t)hlen, what, &root));
    int rc = PD_OK;
    span *spans = NULL;
    if (!json_is_object(root)) {
        rc = pd_error(PD_EPARSE, "%s: header: expected a JSON object, got %s", fp,
                      pdj_type_name(root));
        goto done;
    }
    const uint8_t *data = p + 8 + hlen;
    uint64_t data_size = f->size - 8 - hlen;
    if ((8 + hlen) % 8 != 0 && data_size > 0) {
        /* typed loads need aligned data: copy the region rather than hand out odd pointers */
        size_t cap = ((size_t)data_size + 63) / 64 * 64;
        f->copy = aligned_alloc(64, cap);
        if (!f->copy) {
            rc = pd_error(PD_ENOMEM, "%s: out of memory copying %llu unaligned data bytes", fp,
                          (unsigned long long)data_size);
            goto done;
        }
        memcpy(f->copy, data, (size_t)data_size);
        data = f->copy;
    }
    size_t n_entries = json_object_size(root);
    spans = calloc(n_entries ? n_entries : 1, sizeof *spans);
    if (!spans) {
        rc = pd_error(PD_ENOMEM, "safetensors: out of memory");
        goto done;
    }
    size_t ns = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(val)) {
                rc = pd_error(PD_EPARSE, "%s: __metadata__: expected an object, got %s", fp,
                              pdj_type_name(val));
                goto done;
            }
            continue;
        }
        PD_CHECK_GOTO(parse_entry(st, fp, key, val, data, data_size, &spans[ns]), rc, done);
        ns++;
    }
    /* the data region must be covered exactly: sorted spans contiguous from 0 to the end */
    qsort(spans, ns, sizeof *spans, span_cmp);
    uint64_t at = 0;
    for (size_t i = 0; i < ns; i++) {
        const char *nm = st->tensors[spans[i].idx].name;
        if (spans[i].begin < at) {
            rc = pd_error(PD_EPARSE, "%s: tensor '%s' [%llu, %llu) overlaps tensor '%s'", fp, nm,
                          (unsigned long long)spans[i].begin, (unsigned long long)spans[i].end,
                          st->tensors[spans[i - 1].idx].name);
            goto done;
        }
        if (spans[i].begin > at) {
            rc = pd_error(PD_EPARSE,
                          "%s: tensor '%s' starts at byte %llu, leaving a hole after byte %llu "
                          "(tensors must be contiguous)",
                          fp, nm, (unsigned long long)spans[i].begin, (unsigned long long)at);
            goto done;
        }
        at = spans[i].end;
    }
    if (at != data_size) {
        rc = pd_error(PD_EPARSE,
                      "%s: %llu trailing bytes after the last tensor (data region "
                      "%llu bytes, tensors cover %llu)",
                      fp, (unsigned long long)(data_size - at), (unsigned long long)data_size,
                      (unsigned long long)at);
        goto done;
    }
done:
    free(spans);
    json_decref(root);
    return rc;
}

static int is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static int file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static int open_sharded(pd_st *st, const char *dir, const char *index_path)
{
    json_t *root = NULL;
    PD_CHECK(pdj_load_file(index_path, &root));
    int rc = PD_OK;
    json_t *wm = NULL;
    rc = pdj_get_object(root, "", "weight_map", PDJ_REQUIRED, &wm);
    if (rc < 0) {
        pd_error_prefix(rc, "%s", index_path);
        goto done;
    }
    /* open each distinct shard once, in order of first appearance */
    const char *name;
    json_t *v;
    json_object_foreach(wm, name, v)
    {
        if (!json_is_string(v)) {
            rc = pd_error(PD_EINVAL, "%s: weight_map.%s: expected a file name string, got %s",
                          index_path, name, pdj_type_name(v));
            goto done;
        }
        const char *shard = json_string_value(v);
        if (!*shard || strchr(shard, '/') || strcmp(shard, "..") == 0 || strcmp(shard, ".") == 0) {
            rc = pd_error(PD_EINVAL, "%s: weight_map.%s: \"%s\" is not a plain file name",
                          index_path, name, shard);
            goto done;
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, shard);
        int seen = 0;
        for (size_t i = 0; i < st->n_files; i++)
            if (strcmp(st->files[i].path, path) == 0) seen = 1;
        if (seen) continue;
        if (!file_exists(path)) {
            rc = pd_error(PD_ENOTFOUND, "%s: shard %s (holding tensor '%s') is missing", index_path,
                          path, name);
            goto done;
        }
        PD_CHECK_GOTO(add_file(st, path), rc, done);
    }
    /* every tensor the index names must be in the shard it names */
    json_object_foreach(wm, name, v)
    {
        const pd_tensor *t = pd_st_get(st, name);
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, json_string_value(v));
        if (!t) {
            rc = pd_error(PD_ENOTFOUND, "%s: tensor '%s' listed in the index is not in %s",
                          index_path, name, path);
            goto done;
        }
        if (strcmp(t->file, path) != 0) {
            rc = pd_error(PD_EINVAL, "%s: tensor '%s' listed in %s is in %s", index_path, name,
                          path, t->file);
            goto done;
        }
    }
done:
    json_decref(root);
    return rc;
}

int pd_st_open(const char *path, pd_st **out)
{
    *out = NULL;
    pd_st *st = calloc(1, sizeof *st);
    if (!st || !(st->path = strdup(path))) {
        free(st);
        return pd_error(PD_ENOMEM, "safetensors: out of memory");
    }
    int rc = index_rebuild(st);
    if (rc < 0) goto fail;
    if (is_dir(path)) {
        char p[4096];
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", path);
        if (file_exists(p)) {
            PD_CHECK_GOTO(open_sharded(st, path, p), rc, fail);
        } else {
            snprintf(p, sizeof p, "%s/model.safetensors", path);
            if (!file_exists(p)) {
                rc = pd_error(PD_ENOTFOUND,
                              "%s: no model.safetensors or model.safetensors.index.json", path);
                goto fail;
            }
            PD_CHECK_GOTO(add_file(st, p), rc, fail);
        }
    } else {
        PD_CHECK_GOTO(add_file(st, path), rc, fail);
    }
    *out = st;
    return PD_OK;
fail:
    pd_st_close(st);
    return rc;
}

/* ---- writer ------------------------------------------------------------------------------ */

static int write_all(FILE *f, const void *buf, size_t n, const char *path)
{
    if (n && fwrite(buf, 1, n, f) != n)
        return pd_error(PD_EIO, "%s: write failed: %s", path, strerror(errno));
    return PD_OK;
}

int pd_st_write(const char *file, const pd_tensor *tensors, size_t n, pd_st_fill_fn fill, void *ctx)
{
    json_t *hdr = json_object();
    json_t *meta = json_object();
    if (!hdr || !meta) {
        json_decref(hdr);
        json_decref(meta);
        return pd_error(PD_ENOMEM, "%s: out of memory", file);
    }
    json_object_set_new(meta, "format", json_string("pt"));
    json_object_set_new(hdr, "__metadata__", meta);
    uint64_t off = 0;
    size_t max_bytes = 0;
    for (size_t i = 0; i < n; i++) {
        const pd_tensor *t = &tensors[i];
        if (t->ndim < 0 || t->ndim > PD_TENSOR_MAX_DIMS || pd_dtype_size(t->dtype) == 0 ||
            !t->name) {
            json_decref(hdr);
            return pd_error(PD_EINVAL, "%s: tensor %zu: bad name, dtype or ndim", file, i);
        }
        size_t nb = (size_t)pd_tensor_numel(t) * pd_dtype_size(t->dtype);
        if (nb > max_bytes) max_bytes = nb;
        json_t *e = json_object();
        json_object_set_new(e, "dtype", json_string(pd_dtype_st_name(t->dtype)));
        json_t *sh = json_array();
        for (int d = 0; d < t->ndim; d++) json_array_append_new(sh, json_integer(t->shape[d]));
        json_object_set_new(e, "shape", sh);
        json_t *o = json_array();
        json_array_append_new(o, json_integer((json_int_t)off));
        json_array_append_new(o, json_integer((json_int_t)(off + nb)));
        json_object_set_new(e, "data_offsets", o);
        if (json_object_get(hdr, t->name)) {
            json_decref(e);
            json_decref(hdr);
            return pd_error(PD_EINVAL, "%s: tensor '%s' given twice", file, t->name);
        }
        json_object_set_new(hdr, t->name, e);
        off += nb;
    }
    char *text = json_dumps(hdr, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(hdr);
    if (!text) return pd_error(PD_ENOMEM, "%s: out of memory", file);
    size_t tl = strlen(text);
    size_t padded = (tl + 7) / 8 * 8; /* data starts 8-byte aligned */
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (uint8_t)((uint64_t)padded >> (8 * i));

    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", file, (int)getpid());
    int rc = PD_OK;
    void *buf = NULL;
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        free(text);
        return pd_error(PD_EIO, "%s: %s", tmp, strerror(errno));
    }
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    PD_CHECK_GOTO(write_all(f, lenb, 8, file), rc, fail);
    PD_CHECK_GOTO(write_all(f, text, tl, file), rc, fail);
    static const char spaces[8] = "        ";
    PD_CHECK_GOTO(write_all(f, spaces, padded - tl, file), rc, fail);
    if (fill && max_bytes) {
        buf = malloc(max_bytes);
        if (!buf) {
            rc = pd_error(PD_ENOMEM, "%s: out of memory for a %zu-byte tensor", file, max_bytes);
            goto fail;
        }
    }
    for (size_t i = 0; i < n; i++) {
        size_t nb = (size_t)pd_tensor_numel(&tensors[i]) * pd_dtype_size(tensors[i].dtype);
        if (nb == 0) continue;
        const void *src = tensors[i].data;
        if (fill) {
            PD_CHECK_GOTO(fill(ctx, i, buf, nb), rc, fail);
            src = buf;
        } else if (!src) {
            rc = pd_error(PD_EINVAL, "%s: tensor '%s' has no data", file, tensors[i].name);
            goto fail;
        }
        PD_CHECK_GOTO(write_all(f, src, nb, file), rc, fail);
    }
    free(buf);
    buf = NULL;
    free(text);
    text = NULL;
    if (fclose(f) != 0) {
        f = NULL;
        rc = pd_error(PD_EIO, "%s: write failed: %s", file, strerror(errno));
        goto fail;
    }
    f = NULL;
    if (rename(tmp, file) != 0) {
        rc = pd_error(PD_EIO, "%s: rename: %s", file, strerror(errno));
        goto fail;
    }
    return PD_OK;
fail:
    if (f) fclose(f);
    unlink(tmp);
    free(buf);
    free(text);
    return rc;
}
