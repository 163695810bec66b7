/* Typed jansson getters with JSON-path error messages (see json.h). */
#include "json/json.h"
#include "util/status.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *pdj_path_key(char *buf, size_t n, const char *path, const char *key)
{
    if (!path || !*path)
        snprintf(buf, n, "%s", key);
    else
        snprintf(buf, n, "%s.%s", path, key);
    return buf;
}

const char *pdj_path_index(char *buf, size_t n, const char *path, size_t index)
{
    snprintf(buf, n, "%s[%zu]", path ? path : "", index);
    return buf;
}

const char *pdj_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "number";
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    }
    return "unknown";
}

int pdj_as_double(const json_t *v, const char *path, double *out)
{
    if (!json_is_number(v))
        return pd_error(PD_EINVAL, "%s: expected number, got %s", path, pdj_type_name(v));
    double d = json_number_value(v);
    if (!isfinite(d)) return pd_error(PD_EINVAL, "%s: must be a finite number", path);
    *out = d;
    return PD_OK;
}

int pdj_as_int(const json_t *v, const char *path, int64_t *out)
{
    if (json_is_integer(v)) {
        *out = (int64_t)json_integer_value(v);
        return PD_OK;
    }
    if (!json_is_real(v))
        return pd_error(PD_EINVAL, "%s: expected integer, got %s", path, pdj_type_name(v));
    double d = json_real_value(v);
    /* 2^63 is exactly representable; anything >= it does not fit int64. */
    if (!isfinite(d) || d != floor(d) || d < -9223372036854775808.0 || d >= 9223372036854775808.0)
        return pd_error(PD_EINVAL, "%s: expected integer, got %g", path, d);
    *out = (int64_t)d;
    return PD_OK;
}

int pdj_as_bool(const json_t *v, const char *path, bool *out)
{
    if (!json_is_boolean(v))
        return pd_error(PD_EINVAL, "%s: expected boolean, got %s", path, pdj_type_name(v));
    *out = json_is_true(v);
    return PD_OK;
}

int pdj_as_string(const json_t *v, const char *path, const char **out)
{
    if (!json_is_string(v))
        return pd_error(PD_EINVAL, "%s: expected string, got %s", path, pdj_type_name(v));
    *out = json_string_value(v);
    return PD_OK;
}

/* Looks up key; returns 1 with *v set, 0 when absent/optional, or an error. */
static int lookup(const json_t *obj, const char *path, const char *key, int flags, json_t **v,
                  char *pbuf, size_t pn)
{
    pdj_path_key(pbuf, pn, path, key);
    if (!json_is_object(obj))
        return pd_error(PD_EINVAL, "%s: expected object, got %s", path && *path ? path : "(root)",
                        obj ? pdj_type_name(obj) : "nothing");
    *v = json_object_get(obj, key);
    if (*v && json_is_null(*v) && (flags & PDJ_NULL_IS_ABSENT)) *v = NULL;
    if (!*v) {
        if (flags & PDJ_REQUIRED) return pd_error(PD_EINVAL, "%s: required", pbuf);
        return 0;
    }
    return 1;
}

#define GETTER(name, ctype, conv)                                                                  \
    int name(const json_t *obj, const char *path, const char *key, int flags, ctype *out)          \
    {                                                                                              \
        char p[256];                                                                               \
        json_t *v;                                                                                 \
        int rc = lookup(obj, path, key, flags, &v, p, sizeof p);                                   \
        if (rc <= 0) return rc;                                                                    \
        rc = conv(v, p, out);                                                                      \
        return rc < 0 ? rc : 1;                                                                    \
    }

GETTER(pdj_get_int, int64_t, pdj_as_int)
GETTER(pdj_get_double, double, pdj_as_double)
GETTER(pdj_get_bool, bool, pdj_as_bool)
GETTER(pdj_get_string, const char *, pdj_as_string)

static int typed_container(const json_t *obj, const char *path, const char *key, int flags,
                           json_t **out, json_type want, const char *want_name)
{
    char p[256];
    json_t *v;
    int rc = lookup(obj, path, key, flags, &v, p, sizeof p);
    if (rc <= 0) return rc;
    if (json_typeof(v) != want)
        return pd_error(PD_EINVAL, "%s: expected %s, got %s", p, want_name, pdj_type_name(v));
    *out = v;
    return 1;
}

int pdj_get_object(const json_t *obj, const char *path, const char *key, int flags, json_t **out)
{
    return typed_container(obj, path, key, flags, out, JSON_OBJECT, "object");
}

int pdj_get_array(const json_t *obj, const char *path, const char *key, int flags, json_t **out)
{
    return typed_container(obj, path, key, flags, out, JSON_ARRAY, "array");
}

int pdj_get_int_range(const json_t *obj, const char *path, const char *key, int flags, int64_t lo,
                      int64_t hi, int64_t *out)
{
    int64_t v;
    int rc = pdj_get_int(obj, path, key, flags, &v);
    if (rc <= 0) return rc;
    if (v < lo || v > hi) {
        char p[256];
        return pd_error(PD_EINVAL, "%s: must be between %lld and %lld, got %lld",
                        pdj_path_key(p, sizeof p, path, key), (long long)lo, (long long)hi,
                        (long long)v);
    }
    *out = v;
    return 1;
}

int pdj_get_double_range(const json_t *obj, const char *path, const char *key, int flags, double lo,
                         double hi, double *out)
{
    double v;
    int rc = pdj_get_double(obj, path, key, flags, &v);
    if (rc <= 0) return rc;
    if (v < lo || v > hi) {
        char p[256];
        return pd_error(PD_EINVAL, "%s: must be between %g and %g, got %g",
                        pdj_path_key(p, sizeof p, path, key), lo, hi, v);
    }
    *out = v;
    return 1;
}

int pdj_loads(const char *text, size_t len, const char *what, json_t **out)
{
    json_error_t err;
    /* Request bodies: a duplicate key is accepted and the last one wins (as in vLLM / Python's
     * json module; the API contract §0 requires it). Files are stricter: see pdj_load_file. */
    json_t *v = pdj_loadb(text, len, JSON_ALLOW_NUL, &err);
    if (!v)
        return pd_error(PD_EPARSE, "%s: line %d column %d: %s", what, err.line, err.column,
                        err.text);
    *out = v;
    return PD_OK;
}

/* x as an integer (a new reference) when it is a whole real within int64, else NULL. */
static json_t *whole(const json_t *x)
{
    double d = json_is_real(x) ? json_real_value(x) : 0.5;
    return d == floor(d) && fabs(d) < 9.2e18 ? json_integer((json_int_t)d) : NULL;
}

/* The whole reals within int64 of v made integers again, in place (see pdj_loadb). */
static int restore_ints(json_t *v)
{
    if (json_is_object(v)) {
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x)
        {
            json_t *w = whole(x);
            if (w ? json_object_set_new(v, k, w) < 0 : restore_ints(x) < 0) return -1;
        }
    } else if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) {
            json_t *x = json_array_get(v, i), *w = whole(x);
            if (w ? json_array_set_new(v, i, w) < 0 : restore_ints(x) < 0) return -1;
        }
    }
    return 0;
}

json_t *pdj_loadb(const char *text, size_t len, size_t flags, json_error_t *err)
{
    json_t *v = json_loadb(text, len, flags, err);
    if (v || !strstr(err->text, "too big")) return v;
    v = json_loadb(text, len, flags | JSON_DECODE_INT_AS_REAL, err);
    json_t *w = whole(v); /* a document that is one number */
    if (w) {
        json_decref(v);
        v = w;
    }
    if (v && restore_ints(v) < 0) {
        json_decref(v);
        snprintf(err->text, sizeof err->text, "out of memory");
        return NULL;
    }
    return v;
}

int pdj_load_file(const char *file, json_t **out)
{
    FILE *f = fopen(file, "rb");
    if (!f)
        return pd_error(errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: %s", file, strerror(errno));
    json_error_t err;
    /* A key given twice in a configuration file is a mistake to report, not to resolve. */
    json_t *v = json_loadf(f, JSON_REJECT_DUPLICATES, &err);
    if (!v && strstr(err.text, "too big integer")) {
        /* Published tokenizer_config.json files write model_max_length = 1e30 as an integer
         * literal; read integers as reals then (pdj_as_int still takes whole values). */
        rewind(f);
        v = json_loadf(f, JSON_REJECT_DUPLICATES | JSON_DECODE_INT_AS_REAL, &err);
    }
    fclose(f);
    if (!v)
        return pd_error(PD_EPARSE, "%s: line %d column %d: %s", file, err.line, err.column,
                        err.text);
    *out = v;
    return PD_OK;
}

char *pdj_dumps(const json_t *v)
{
    return json_dumps(v, JSON_COMPACT | JSON_REAL_PRECISION(15) | JSON_ENCODE_ANY);
}

int pdj_dump_file(const json_t *v, const char *file, int indent)
{
    size_t flags = JSON_REAL_PRECISION(15) | JSON_PRESERVE_ORDER;
    flags |= indent > 0 ? JSON_INDENT(indent) : JSON_COMPACT;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", file, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return pd_error(PD_EIO, "%s: %s", tmp, strerror(errno));
    int bad = json_dumpf(v, f, flags) != 0 || fputc('\n', f) == EOF;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, file) != 0) {
        int e = errno;
        unlink(tmp);
        return pd_error(PD_EIO, "%s: write failed: %s", file, strerror(e));
    }
    return PD_OK;
}
