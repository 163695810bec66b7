/* Internals shared by the ranktable sources (not part of the public API).
 *
 * The table structs live here so ranktable.c (walk, lookups, build, merge), rt_dump.c
 * (serialization, files) and rt_gen.c (gen) can share them while callers see opaque types.
 */
#ifndef PD_RANKTABLE_RT_INTERNAL_H
#define PD_RANKTABLE_RT_INTERNAL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "ranktable/ranktable.h"

struct rt_global {
    json_t *root;                     /* owned document; unknown fields live here */
    char *what;                       /* owned name for messages */
    bool has_group[RT_ROLE_COUNT];    /* group present in the document */
    size_t n[RT_ROLE_COUNT];          /* instances per role (scheduler: 0 or 1) */
    rt_instance *inst[RT_ROLE_COUNT]; /* n[r] views; devices malloc'd per instance */
};

struct rt_local {
    json_t *root;     /* owned document */
    char *what;       /* owned name for messages */
    bool host;        /* server without "device": the scheduler's table */
    rt_instance inst; /* the one server; devices malloc'd */
};

/* Problem collector of one validation run. */
typedef struct {
    const char *what; /* prefix of every message */
    rt_report *rep;   /* may be NULL */
    size_t n;         /* problems so far */
    int first_rc;     /* status of the first problem */
    char first[1400]; /* message of the first problem */
} rt_vctx;

void rt_vctx_init(rt_vctx *c, const char *what, rt_report *rep);
void rt_vctx_problem(rt_vctx *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* PD_OK, or the first problem's status with pd_error() set to its message. */
int rt_vctx_finish(rt_vctx *c);

/* Canonical decimal ("0", "12"; not "", "01", "+1") no larger than max: PD_OK, PD_EINVAL,
 * or PD_ERANGE. */
int rt_parse_decimal(const char *s, long max, long *out);
/* A name/address field: 1..RT_MAX_STRING bytes, no spaces, controls or '/' (it ends up in
 * file names). On failure *why says what is wrong. */
int rt_check_token(const char *s, size_t len, const char **why);

void rt_instance_clear(rt_instance *inst);
void rt_global_index_free(rt_global *g);
int rt_global_walk(rt_global *g, json_t *root, const char *what, unsigned flags, bool cross,
                   rt_report *rep);

/* Python json.dumps(v, indent=4) text; caller frees. NULL when out of memory. */
char *rt_json_dumps_py(const json_t *v);

#endif
