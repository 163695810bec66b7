/* Ranktable loading, validation, lookups, building and merging (see ranktable.h).
 *
 * One validating walk (walk_global / walk_local) both checks every rule and builds the
 * instance index, so a table that exists is a table that passed. The walk never stops at
 * the first problem: each one is recorded (rt_report) and the walk goes on where the
 * structure allows, which is what `pd-ranktable --mode check` prints. Tables keep their
 * jansson document; builders and merge edit the document and re-run the walk.
 */
#include "ranktable/ranktable.h"
#include "ranktable/rt_internal.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json/json.h"
#include "util/status.h"

#define REPORT_KEEP 1000

const char *rt_role_name(rt_role role)
{
    switch (role) {
    case RT_ROLE_SCHEDULER: return "scheduler";
    case RT_ROLE_PREFILL: return "prefill";
    case RT_ROLE_DECODE: return "decode";
    }
    return "unknown";
}

/* ---- reports ---------------------------------------------------------------------------- */

struct rt_report {
    char **msgs; /* kept messages, malloc'd each */
    size_t n_kept, cap, n_total;
};

rt_report *rt_report_create(void)
{
    return calloc(1, sizeof(rt_report));
}

void rt_report_clear(rt_report *r)
{
    if (!r) return;
    for (size_t i = 0; i < r->n_kept; i++) free(r->msgs[i]);
    r->n_kept = r->n_total = 0;
}

void rt_report_free(rt_report *r)
{
    if (!r) return;
    rt_report_clear(r);
    free(r->msgs);
    free(r);
}

size_t rt_report_count(const rt_report *r)
{
    return r ? r->n_total : 0;
}

const char *rt_report_message(const rt_report *r, size_t i)
{
    return r && i < r->n_kept ? r->msgs[i] : NULL;
}

static void report_add(rt_report *r, const char *msg)
{
    if (!r) return;
    r->n_total++;
    if (r->n_kept == REPORT_KEEP) return;
    if (r->n_kept == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 8;
        char **m = realloc(r->msgs, cap * sizeof *m);
        if (!m) return; /* out of memory: the message is counted, not kept */
        r->msgs = m;
        r->cap = cap;
    }
    char *copy = strdup(msg);
    if (copy) r->msgs[r->n_kept++] = copy;
}

/* ---- validation context ----------------------------------------------------------------- */

void rt_vctx_init(rt_vctx *c, const char *what, rt_report *rep)
{
    memset(c, 0, sizeof *c);
    c->what = what;
    c->rep = rep;
}

void rt_vctx_problem(rt_vctx *c, int rc, const char *fmt, ...)
{
    char body[1024], msg[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    snprintf(msg, sizeof msg, "%s: %s", c->what, body);
    if (c->n == 0) {
        c->first_rc = rc;
        snprintf(c->first, sizeof c->first, "%s", msg);
    }
    c->n++;
    report_add(c->rep, msg);
}

/* Records the message a pdj_* getter just set. */
static void problem_last(rt_vctx *c, int rc)
{
    rt_vctx_problem(c, rc, "%s", pd_last_error());
}

int rt_vctx_finish(rt_vctx *c)
{
    if (c->n == 0) return PD_OK;
    if (c->n == 1) return pd_error(c->first_rc, "%s", c->first);
    return pd_error(c->first_rc, "%s (and %zu more problem%s)", c->first, c->n - 1,
                    c->n == 2 ? "" : "s");
}

/* ---- field readers ---------------------------------------------------------------------- */

/* A required string field; returns NULL after recording the problem. */
static const char *req_string(rt_vctx *c, const json_t *obj, const char *path, const char *key)
{
    const char *s = NULL;
    int rc = pdj_get_string(obj, path, key, PDJ_REQUIRED, &s);
    if (rc < 0) {
        problem_last(c, rc);
        return NULL;
    }
    return s;
}

int rt_check_token(const char *s, size_t len, const char **why)
{
    if (len == 0) {
        *why = "must not be empty";
        return PD_EINVAL;
    }
    if (len > RT_MAX_STRING) {
        *why = "is longer than 255 bytes";
        return PD_EINVAL;
    }
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch <= ' ' || ch == 0x7f || ch == '/') {
            *why = "must not contain spaces, control characters or '/'";
            return PD_EINVAL;
        }
    }
    return PD_OK;
}

/* An address or name field (server_id, server_ip, device_ip). */
static const char *req_token(rt_vctx *c, const json_t *obj, const char *path, const char *key)
{
    const char *s = req_string(c, obj, path, key);
    if (!s) return NULL;
    const char *why;
    size_t len = json_string_length(json_object_get(obj, key));
    if (rt_check_token(s, len, &why) < 0) {
        char p[256];
        rt_vctx_problem(c, PD_EINVAL, "%s: %s", pdj_path_key(p, sizeof p, path, key), why);
        return NULL;
    }
    return s;
}

int rt_parse_decimal(const char *s, long max, long *out)
{
    if (!s || !*s) return PD_EINVAL;
    if (s[0] == '0' && s[1] != '\0') return PD_EINVAL; /* one spelling per number */
    long v = 0;
    for (const char *q = s; *q; q++) {
        if (*q < '0' || *q > '9') return PD_EINVAL;
        v = v * 10 + (*q - '0');
        if (v > max) return PD_ERANGE;
    }
    *out = v;
    return PD_OK;
}

/* A count or id: a JSON string holding a canonical decimal number <= max. */
static int req_decimal(rt_vctx *c, const json_t *obj, const char *path, const char *key, long max,
                       long *out)
{
    char p[256];
    pdj_path_key(p, sizeof p, path, key);
    json_t *v = json_object_get(obj, key);
    if (v && json_is_integer(v)) {
        rt_vctx_problem(c, PD_EINVAL, "%s: must be a string (\"%lld\"), got integer", p,
                        (long long)json_integer_value(v));
        return PD_EINVAL;
    }
    const char *s = req_string(c, obj, path, key);
    if (!s) return PD_EINVAL;
    int rc = rt_parse_decimal(s, max, out);
    if (rc == PD_ERANGE) {
        rt_vctx_problem(c, PD_EINVAL, "%s: \"%s\" is larger than %ld", p, s, max);
        return PD_EINVAL;
    }
    if (rc < 0 || strlen(s) != json_string_length(v)) {
        rt_vctx_problem(c, PD_EINVAL, "%s: expected a decimal number string like \"4\", got \"%s\"",
                        p, s);
        return PD_EINVAL;
    }
    return PD_OK;
}

/* ---- servers ------------------------------------------------------------------------------ */

void rt_instance_clear(rt_instance *inst)
{
    free((void *)inst->devices);
    inst->devices = NULL;
    inst->n_devices = 0;
}

enum { SRV_SCHEDULER, SRV_INSTANCE, SRV_LOCAL_ANY };

/* A scheduler entry: no "device", or an empty one (both spellings are "no devices"). */
static bool is_host_server(const json_t *srv)
{
    const json_t *dev = json_object_get(srv, "device");
    return json_is_object(srv) && (!dev || (json_is_array(dev) && json_array_size(dev) == 0));
}

/* Validates one server_list entry and fills *out (devices malloc'd). kind says what is
 * expected; for SRV_LOCAL_ANY a server without "device" is a host table. Returns true when
 * the entry was valid. */
static bool walk_server(rt_vctx *c, const json_t *srv, const char *path, int kind,
                        const char *role_name, rt_instance *out)
{
    size_t before = c->n;
    memset(out, 0, sizeof *out);
    if (!json_is_object(srv)) {
        rt_vctx_problem(c, PD_EINVAL, "%s: expected object, got %s", path, pdj_type_name(srv));
        return false;
    }
    out->server_id = req_token(c, srv, path, "server_id");
    out->server_ip = req_token(c, srv, path, "server_ip");

    char dpath[256];
    pdj_path_key(dpath, sizeof dpath, path, "device");
    json_t *dev = json_object_get(srv, "device");
    if (kind == SRV_SCHEDULER || (kind == SRV_LOCAL_ANY && is_host_server(srv))) {
        if (dev && !(json_is_array(dev) && json_array_size(dev) == 0)) {
            size_t n = json_is_array(dev) ? json_array_size(dev) : 1;
            rt_vctx_problem(c, PD_EINVAL, "%s: the scheduler group has no devices, got %zu", dpath,
                            n);
        }
        return c->n == before;
    }
    if (!dev) {
        rt_vctx_problem(c, PD_EINVAL, "%s: required (a %s instance lists its devices)", dpath,
                        role_name);
        return false;
    }
    if (!json_is_array(dev)) {
        rt_vctx_problem(c, PD_EINVAL, "%s: expected array, got %s", dpath, pdj_type_name(dev));
        return false;
    }
    size_t nd = json_array_size(dev);
    if (nd == 0) {
        rt_vctx_problem(c, PD_EINVAL, "%s: a %s instance needs at least one device", dpath,
                        role_name);
        return false;
    }
    if (nd > RT_MAX_DEVICES) {
        rt_vctx_problem(c, PD_EINVAL, "%s: %zu devices, at most %d per instance", dpath, nd,
                        RT_MAX_DEVICES);
        return false;
    }
    rt_device *devs = calloc(nd, sizeof *devs);
    if (!devs) {
        rt_vctx_problem(c, PD_ENOMEM, "%s: out of memory", dpath);
        return false;
    }
    /* seen[ordinal] = 1 + index of the device that has it (0: not seen). */
    unsigned short seen[RT_MAX_DEVICES];
    memset(seen, 0, sizeof seen);
    for (size_t k = 0; k < nd; k++) {
        char p[256];
        pdj_path_index(p, sizeof p, dpath, k);
        json_t *d = json_array_get(dev, k);
        if (!json_is_object(d)) {
            rt_vctx_problem(c, PD_EINVAL, "%s: expected object, got %s", p, pdj_type_name(d));
            continue;
        }
        long ord = -1, rank = -1;
        if (req_decimal(c, d, p, "device_id", RT_MAX_DEVICES - 1, &ord) == PD_OK) {
            devs[k].device_id = json_string_value(json_object_get(d, "device_id"));
            devs[k].ordinal = (int)ord;
            if (seen[ord]) {
                char q[256];
                rt_vctx_problem(c, PD_EINVAL,
                                "%s: device %ld appears twice in this instance (also device[%d])",
                                pdj_path_key(q, sizeof q, p, "device_id"), ord, seen[ord] - 1);
            } else {
                seen[ord] = (unsigned short)(k + 1);
            }
        }
        devs[k].device_ip = req_token(c, d, p, "device_ip");
        if (req_decimal(c, d, p, "rank_id", RT_MAX_DEVICES - 1, &rank) == PD_OK) {
            devs[k].rank_id = json_string_value(json_object_get(d, "rank_id"));
            devs[k].rank = (int)rank;
            if (rank != (long)k) {
                char q[256];
                rt_vctx_problem(c, PD_EINVAL,
                                "%s: expected \"%zu\" (rank ids count 0..%zu in device order), "
                                "got \"%ld\"",
                                pdj_path_key(q, sizeof q, p, "rank_id"), k, nd - 1, rank);
            }
        }
    }
    out->n_devices = nd;
    out->devices = devs;
    return c->n == before;
}

/* Common top-level fields of both table kinds. */
static void walk_header(rt_vctx *c, const json_t *root)
{
    const char *v = req_string(c, root, "", "version");
    if (v && strcmp(v, "1.0") != 0)
        rt_vctx_problem(c, PD_EUNSUPPORTED, "version: \"%s\" is not supported (expected \"1.0\")",
                        v);
    const char *s = req_string(c, root, "", "status");
    if (s && strcmp(s, "completed") != 0)
        rt_vctx_problem(c, PD_EINVAL,
                        "status: expected \"completed\", got \"%s\" (the table is not final)", s);
}

/* ---- global tables ------------------------------------------------------------------------ */

/* One device of one instance, for the "no device twice on one host" rule. */
typedef struct {
    const char *host; /* server_id */
    int ordinal;
    int role;
    size_t inst, dev;
} dev_use;

static int cmp_position(const dev_use *a, const dev_use *b)
{
    if (a->role != b->role) return a->role < b->role ? -1 : 1;
    if (a->inst != b->inst) return a->inst < b->inst ? -1 : 1;
    return a->dev < b->dev ? -1 : a->dev > b->dev;
}

static int cmp_use(const void *x, const void *y)
{
    const dev_use *a = x, *b = y;
    int h = strcmp(a->host, b->host);
    if (h) return h;
    if (a->ordinal != b->ordinal) return a->ordinal < b->ordinal ? -1 : 1;
    return cmp_position(a, b);
}

static int cmp_dup(const void *x, const void *y)
{
    return cmp_position(&((const dev_use *)x)[0], &((const dev_use *)y)[0]);
}

/* Sorting by (host, device) finds every reuse in O(n log n) however large the table; each
 * reuse is reported against the first use, in document order. */
static void check_shared_devices(rt_vctx *c, rt_instance *const inst[RT_ROLE_COUNT],
                                 const size_t n[RT_ROLE_COUNT], const size_t gpos[RT_ROLE_COUNT])
{
    size_t total = 0;
    for (int r = RT_ROLE_PREFILL; r <= RT_ROLE_DECODE; r++)
        for (size_t i = 0; i < n[r]; i++) total += inst[r][i].n_devices;
    if (total < 2) return;
    dev_use *u = malloc(total * sizeof *u);
    dev_use *dup = malloc(2 * total * sizeof *dup); /* pairs: (reuse, first use) */
    if (!u || !dup) {
        free(u);
        free(dup);
        rt_vctx_problem(c, PD_ENOMEM, "out of memory checking devices");
        return;
    }
    size_t m = 0, nd = 0;
    for (int r = RT_ROLE_PREFILL; r <= RT_ROLE_DECODE; r++)
        for (size_t i = 0; i < n[r]; i++)
            for (size_t k = 0; k < inst[r][i].n_devices; k++)
                u[m++] = (dev_use){inst[r][i].server_id, inst[r][i].devices[k].ordinal, r, i, k};
    qsort(u, m, sizeof *u, cmp_use);
    for (size_t a = 0; a < m;) {
        size_t b = a + 1;
        for (; b < m && strcmp(u[b].host, u[a].host) == 0 && u[b].ordinal == u[a].ordinal; b++) {
            /* Uses inside one instance were reported by walk_server already. */
            if (u[b].role == u[a].role && u[b].inst == u[a].inst) continue;
            dup[2 * nd] = u[b];
            dup[2 * nd + 1] = u[a];
            nd++;
        }
        a = b;
    }
    qsort(dup, nd, 2 * sizeof *dup, cmp_dup);
    for (size_t d = 0; d < nd; d++) {
        const dev_use *x = &dup[2 * d], *first = &dup[2 * d + 1];
        rt_vctx_problem(c, PD_EINVAL,
                        "server_group_list[%zu].server_list[%zu].device[%zu].device_id: device %d "
                        "on host %s is already used by server_group_list[%zu].server_list[%zu] "
                        "(%s %zu)",
                        gpos[x->role], x->inst, x->dev, x->ordinal, x->host, gpos[first->role],
                        first->inst, rt_role_name((rt_role)first->role), first->inst);
    }
    free(dup);
    free(u);
}

void rt_global_index_free(rt_global *g)
{
    for (int r = 0; r < RT_ROLE_COUNT; r++) {
        for (size_t i = 0; i < g->n[r]; i++) rt_instance_clear(&g->inst[r][i]);
        free(g->inst[r]);
        g->inst[r] = NULL;
        g->n[r] = 0;
        g->has_group[r] = false;
    }
}

/* Validates root as a global table and, when it passes, installs the index into g
 * (replacing the old one). cross=false skips the cross-instance rules (builders). */
int rt_global_walk(rt_global *g, json_t *root, const char *what, unsigned flags, bool cross,
                   rt_report *rep)
{
    rt_vctx c;
    rt_vctx_init(&c, what, rep);
    rt_instance *inst[RT_ROLE_COUNT] = {0};
    size_t n[RT_ROLE_COUNT] = {0};
    bool has[RT_ROLE_COUNT] = {0};
    size_t gpos[RT_ROLE_COUNT] = {0}; /* position of each role's group in server_group_list */
    bool fragment = flags & RT_LOAD_FRAGMENT;

    if (!json_is_object(root)) {
        rt_vctx_problem(&c, PD_EINVAL, "(root): expected object, got %s", pdj_type_name(root));
        return rt_vctx_finish(&c);
    }
    walk_header(&c, root);
    json_t *groups = NULL;
    int rc = pdj_get_array(root, "", "server_group_list", PDJ_REQUIRED, &groups);
    if (rc < 0) {
        problem_last(&c, rc);
        return rt_vctx_finish(&c);
    }
    size_t ng = json_array_size(groups);
    if (!fragment && ng != 3)
        rt_vctx_problem(&c, PD_EINVAL,
                        "server_group_list: expected exactly 3 groups (\"0\" scheduler, \"1\" "
                        "prefill, \"2\" decode), got %zu%s",
                        ng,
                        ng < 3 ? " (a table made on one host without the others is a merge "
                                 "input: run --mode merge)"
                               : "");
    else if (fragment && (ng == 0 || ng > 3))
        rt_vctx_problem(&c, PD_EINVAL, "server_group_list: expected 1 to 3 groups, got %zu", ng);

    int last_gid = -1;
    for (size_t gi = 0; gi < ng && gi < 3; gi++) {
        char gpath[64];
        pdj_path_index(gpath, sizeof gpath, "server_group_list", gi);
        json_t *grp = json_array_get(groups, gi);
        if (!json_is_object(grp)) {
            rt_vctx_problem(&c, PD_EINVAL, "%s: expected object, got %s", gpath,
                            pdj_type_name(grp));
            continue;
        }
        /* The role of a group is its group_id; ids must ascend, so with three groups the
         * position and the id agree. */
        long gid = -1;
        char gidp[96];
        pdj_path_key(gidp, sizeof gidp, gpath, "group_id");
        if (req_decimal(&c, grp, gpath, "group_id", 1000000, &gid) < 0) continue;
        if (gid > 2) {
            rt_vctx_problem(&c, PD_EINVAL,
                            "%s: expected \"0\" (scheduler), \"1\" (prefill) or \"2\" (decode), "
                            "got \"%ld\"",
                            gidp, gid);
            continue;
        }
        if (gid <= last_gid) {
            rt_vctx_problem(&c, PD_EINVAL,
                            "%s: group \"%ld\" out of order or repeated (groups are \"0\" "
                            "scheduler, \"1\" prefill, \"2\" decode, each once, in this order)",
                            gidp, gid);
            continue;
        }
        last_gid = (int)gid;
        rt_role role = (rt_role)gid;
        has[role] = true;
        gpos[role] = gi;

        long count = -1;
        bool count_ok = req_decimal(&c, grp, gpath, "server_count", RT_MAX_INSTANCES, &count) == 0;
        json_t *list = NULL;
        rc = pdj_get_array(grp, gpath, "server_list", PDJ_REQUIRED, &list);
        if (rc < 0) {
            problem_last(&c, rc);
            continue;
        }
        char lpath[96];
        pdj_path_key(lpath, sizeof lpath, gpath, "server_list");
        size_t ns = json_array_size(list);
        if (role == RT_ROLE_SCHEDULER && ns != 1) {
            rt_vctx_problem(&c, PD_EINVAL,
                            "%s: the scheduler group must have exactly one server, got %zu", lpath,
                            ns);
            if (ns == 0) continue;
        } else if (ns == 0) {
            rt_vctx_problem(&c, PD_EINVAL, "%s: the %s group has no instances", lpath,
                            rt_role_name(role));
            continue;
        } else if (ns > RT_MAX_INSTANCES) {
            rt_vctx_problem(&c, PD_EINVAL, "%s: %zu instances, at most %d per group", lpath, ns,
                            RT_MAX_INSTANCES);
            continue;
        }
        if (count_ok && (size_t)count != ns) {
            char cp[96];
            rt_vctx_problem(&c, PD_EINVAL, "%s: \"%ld\" but server_list has %zu entr%s",
                            pdj_path_key(cp, sizeof cp, gpath, "server_count"), count, ns,
                            ns == 1 ? "y" : "ies");
        }
        size_t keep = role == RT_ROLE_SCHEDULER ? 1 : ns;
        inst[role] = calloc(keep, sizeof(rt_instance));
        if (!inst[role]) {
            rt_vctx_problem(&c, PD_ENOMEM, "%s: out of memory", lpath);
            continue;
        }
        n[role] = keep;
        for (size_t si = 0; si < keep; si++) {
            char spath[128];
            pdj_path_index(spath, sizeof spath, lpath, si);
            rt_instance *it = &inst[role][si];
            walk_server(&c, json_array_get(list, si), spath,
                        role == RT_ROLE_SCHEDULER ? SRV_SCHEDULER : SRV_INSTANCE,
                        rt_role_name(role), it);
            it->role = role;
            it->index = si;
        }
    }
    /* A complete table missing a group already failed the count or order rule above. */

    if (cross && c.n == 0) {
        /* One tensor-parallel size per role. */
        for (int r = RT_ROLE_PREFILL; r <= RT_ROLE_DECODE; r++)
            for (size_t i = 1; i < n[r]; i++)
                if (inst[r][i].n_devices != inst[r][0].n_devices) {
                    rt_vctx_problem(&c, PD_EINVAL,
                                    "server_group_list[%zu].server_list[%zu].device: %s instances "
                                    "must share one tensor-parallel size: this one has %zu "
                                    "device%s, server_list[0] has %zu",
                                    gpos[r], i, rt_role_name((rt_role)r), inst[r][i].n_devices,
                                    inst[r][i].n_devices == 1 ? "" : "s", inst[r][0].n_devices);
                    break;
                }
        if (!(flags & RT_ALLOW_SHARED_DEVICES)) check_shared_devices(&c, inst, n, gpos);
    }

    if (c.n) {
        for (int r = 0; r < RT_ROLE_COUNT; r++) {
            for (size_t i = 0; i < n[r]; i++) rt_instance_clear(&inst[r][i]);
            free(inst[r]);
        }
        return rt_vctx_finish(&c);
    }
    rt_global_index_free(g);
    for (int r = 0; r < RT_ROLE_COUNT; r++) {
        g->inst[r] = inst[r];
        g->n[r] = n[r];
        g->has_group[r] = has[r];
    }
    return PD_OK;
}

static rt_global *global_new(json_t *root, const char *what)
{
    rt_global *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->what = strdup(what);
    if (!g->what) {
        free(g);
        return NULL;
    }
    g->root = root;
    return g;
}

void rt_global_free(rt_global *g)
{
    if (!g) return;
    rt_global_index_free(g);
    json_decref(g->root);
    free(g->what);
    free(g);
}

/* Takes ownership of root (freed on failure). */
static int global_from_json(json_t *root, const char *what, unsigned flags, rt_report *rep,
                            rt_global **out)
{
    *out = NULL;
    rt_global *g = global_new(root, what);
    if (!g) {
        json_decref(root);
        return pd_error(PD_ENOMEM, "%s: out of memory", what);
    }
    int rc = rt_global_walk(g, root, what, flags, true, rep);
    if (rc < 0) {
        rt_global_free(g);
        return rc;
    }
    *out = g;
    return PD_OK;
}

/* Parse failures go to the report too, so `check` prints them like any other problem. */
static int parse_failed(int rc, rt_report *rep)
{
    report_add(rep, pd_last_error());
    return rc;
}

/* a and b spell the same name but for underscores ("local_rank_table_x" and
 * "local_ranktable_x"). */
static bool same_but_underscores(const char *a, const char *b)
{
    for (;; a++, b++) {
        while (*a == '_') a++;
        while (*b == '_') b++;
        if (*a != *b) return false;
        if (!*a) return true;
    }
}

/* pdj_load_file; a file that is missing but has a sibling spelt the same but for underscores
 * (the guide exports local_rank_table_<ip>_<n>.json, pd-ranktable gen writes
 * local_ranktable_<ip>_<n>.json) is refused naming the sibling. */
static int load_file(const char *file, json_t **root)
{
    int rc = pdj_load_file(file, root);
    if (rc != PD_ENOTFOUND) return rc;
    const char *slash = strrchr(file, '/');
    const char *base = slash ? slash + 1 : file;
    char dir[4096];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - file) : 1, slash ? file : ".");
    DIR *d = opendir(dir[0] ? dir : "/");
    if (!d) return rc;
    char near[256] = "";
    for (struct dirent *e; !near[0] && (e = readdir(d));)
        if (strcmp(e->d_name, base) != 0 && same_but_underscores(e->d_name, base))
            snprintf(near, sizeof near, "%s", e->d_name);
    closedir(d);
    if (!near[0]) return rc;
    return pd_error(rc,
                    "%s: No such file or directory; %s%s%s exists next to it (pd-ranktable "
                    "writes local_ranktable_<ip>_<n>.json)",
                    file, slash ? dir : "", slash ? "/" : "", near);
}

int rt_global_load_string(const char *text, size_t len, const char *what, unsigned flags,
                          rt_report *report, rt_global **out)
{
    *out = NULL;
    json_t *root = NULL;
    int rc = pdj_loads(text, len, what, &root);
    if (rc < 0) return parse_failed(rc, report);
    return global_from_json(root, what, flags, report, out);
}

int rt_global_load_file(const char *file, unsigned flags, rt_report *report, rt_global **out)
{
    *out = NULL;
    json_t *root = NULL;
    int rc = load_file(file, &root);
    if (rc < 0) return parse_failed(rc, report);
    return global_from_json(root, file, flags, report, out);
}

int rt_global_validate(const rt_global *g, const char *what, unsigned flags, rt_report *report)
{
    /* Walk a scratch table over the same document: g itself is left untouched. */
    rt_global scratch;
    memset(&scratch, 0, sizeof scratch);
    int rc = rt_global_walk(&scratch, g->root, what ? what : g->what, flags, true, report);
    rt_global_index_free(&scratch);
    return rc;
}

const char *rt_global_what(const rt_global *g)
{
    return g->what;
}

bool rt_global_is_complete(const rt_global *g)
{
    return g->has_group[0] && g->has_group[1] && g->has_group[2];
}

size_t rt_global_instance_count(const rt_global *g, rt_role role)
{
    return (unsigned)role < RT_ROLE_COUNT ? g->n[role] : 0;
}

const rt_instance *rt_global_instance(const rt_global *g, rt_role role, size_t i)
{
    if ((unsigned)role >= RT_ROLE_COUNT || i >= g->n[role]) return NULL;
    return &g->inst[role][i];
}

const rt_instance *rt_global_scheduler(const rt_global *g)
{
    return rt_global_instance(g, RT_ROLE_SCHEDULER, 0);
}

size_t rt_global_node_count(const rt_global *g)
{
    return g->n[RT_ROLE_PREFILL] + g->n[RT_ROLE_DECODE];
}

const rt_instance *rt_global_node(const rt_global *g, size_t k)
{
    if (k < g->n[RT_ROLE_PREFILL]) return &g->inst[RT_ROLE_PREFILL][k];
    k -= g->n[RT_ROLE_PREFILL];
    return k < g->n[RT_ROLE_DECODE] ? &g->inst[RT_ROLE_DECODE][k] : NULL;
}

int rt_global_tp_size(const rt_global *g, rt_role role)
{
    if (role != RT_ROLE_PREFILL && role != RT_ROLE_DECODE) return 0;
    return g->n[role] ? (int)g->inst[role][0].n_devices : 0;
}

/* ---- local tables ---------------------------------------------------------------------------- */

static int local_walk(rt_local *l, rt_report *rep)
{
    rt_vctx c;
    rt_vctx_init(&c, l->what, rep);
    json_t *root = l->root;
    rt_instance inst;
    memset(&inst, 0, sizeof inst);
    if (!json_is_object(root)) {
        rt_vctx_problem(&c, PD_EINVAL, "(root): expected object, got %s", pdj_type_name(root));
        return rt_vctx_finish(&c);
    }
    walk_header(&c, root);
    long gid = -1, count = -1;
    if (req_decimal(&c, root, "", "group_id", 1000000, &gid) == PD_OK && gid != 0)
        rt_vctx_problem(&c, PD_EINVAL,
                        "group_id: expected \"0\" (a local table is one group), got \"%ld\"", gid);
    bool count_ok = req_decimal(&c, root, "", "server_count", RT_MAX_INSTANCES, &count) == 0;
    json_t *list = NULL;
    int rc = pdj_get_array(root, "", "server_list", PDJ_REQUIRED, &list);
    if (rc < 0) {
        problem_last(&c, rc);
        return rt_vctx_finish(&c);
    }
    size_t ns = json_array_size(list);
    if (ns != 1)
        rt_vctx_problem(&c, PD_EINVAL,
                        "server_list: a local table holds exactly one server, got %zu", ns);
    if (count_ok && (size_t)count != ns)
        rt_vctx_problem(&c, PD_EINVAL, "server_count: \"%ld\" but server_list has %zu entr%s",
                        count, ns, ns == 1 ? "y" : "ies");
    if (ns >= 1) {
        json_t *srv = json_array_get(list, 0);
        walk_server(&c, srv, "server_list[0]", SRV_LOCAL_ANY, "local", &inst);
        l->host = is_host_server(srv);
    }
    if (c.n) {
        rt_instance_clear(&inst);
        return rt_vctx_finish(&c);
    }
    inst.role = l->host ? RT_ROLE_SCHEDULER : RT_ROLE_PREFILL;
    inst.index = 0;
    rt_instance_clear(&l->inst);
    l->inst = inst;
    return PD_OK;
}

void rt_local_free(rt_local *l)
{
    if (!l) return;
    rt_instance_clear(&l->inst);
    json_decref(l->root);
    free(l->what);
    free(l);
}

/* Takes ownership of root. */
static int local_from_json(json_t *root, const char *what, rt_report *rep, rt_local **out)
{
    *out = NULL;
    rt_local *l = calloc(1, sizeof *l);
    char *w = strdup(what);
    if (!l || !w) {
        free(l);
        free(w);
        json_decref(root);
        return pd_error(PD_ENOMEM, "%s: out of memory", what);
    }
    l->root = root;
    l->what = w;
    int rc = local_walk(l, rep);
    if (rc < 0) {
        rt_local_free(l);
        return rc;
    }
    *out = l;
    return PD_OK;
}

int rt_local_load_string(const char *text, size_t len, const char *what, unsigned flags,
                         rt_report *report, rt_local **out)
{
    (void)flags;
    *out = NULL;
    json_t *root = NULL;
    int rc = pdj_loads(text, len, what, &root);
    if (rc < 0) return parse_failed(rc, report);
    return local_from_json(root, what, report, out);
}

int rt_local_load_file(const char *file, unsigned flags, rt_report *report, rt_local **out)
{
    (void)flags;
    *out = NULL;
    json_t *root = NULL;
    int rc = load_file(file, &root);
    if (rc < 0) return parse_failed(rc, report);
    return local_from_json(root, file, report, out);
}

const char *rt_local_what(const rt_local *l)
{
    return l->what;
}

const rt_instance *rt_local_instance(const rt_local *l)
{
    return &l->inst;
}

bool rt_local_is_host(const rt_local *l)
{
    return l->host;
}

static bool same_instance(const rt_instance *a, const rt_instance *b)
{
    if (strcmp(a->server_id, b->server_id) != 0 || strcmp(a->server_ip, b->server_ip) != 0 ||
        a->n_devices != b->n_devices)
        return false;
    for (size_t k = 0; k < a->n_devices; k++) {
        const rt_device *x = &a->devices[k], *y = &b->devices[k];
        if (strcmp(x->device_id, y->device_id) != 0 || strcmp(x->device_ip, y->device_ip) != 0 ||
            strcmp(x->rank_id, y->rank_id) != 0)
            return false;
    }
    return true;
}

static void describe_devices(char *buf, size_t n, const rt_instance *in)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t k = 0; k < in->n_devices && used + 1 < n; k++) {
        int w = snprintf(buf + used, n - used, "%s%s@%s", k ? "," : "", in->devices[k].device_id,
                         in->devices[k].device_ip);
        if (w < 0) break;
        used += (size_t)w;
    }
}

int rt_find_instance(const rt_global *g, const rt_local *l, rt_role *role, size_t *index)
{
    const rt_instance *li = &l->inst;
    if (l->host) {
        const rt_instance *s = rt_global_scheduler(g);
        if (!s)
            return pd_error(PD_ENOTFOUND,
                            "%s: a host (scheduler) table, but %s has no scheduler group \"0\"",
                            l->what, g->what);
        if (strcmp(s->server_id, li->server_id) != 0 || strcmp(s->server_ip, li->server_ip) != 0)
            return pd_error(PD_ENOTFOUND,
                            "%s: a host (scheduler) table for server_id %s, server_ip %s, but the "
                            "scheduler of %s is server_id %s, server_ip %s",
                            l->what, li->server_id, li->server_ip, g->what, s->server_id,
                            s->server_ip);
        if (role) *role = RT_ROLE_SCHEDULER;
        if (index) *index = 0;
        return PD_OK;
    }
    const rt_instance *hit = NULL, *second = NULL;
    for (int r = RT_ROLE_PREFILL; r <= RT_ROLE_DECODE; r++)
        for (size_t i = 0; i < g->n[r]; i++)
            if (same_instance(&g->inst[r][i], li)) {
                if (!hit)
                    hit = &g->inst[r][i];
                else if (!second)
                    second = &g->inst[r][i];
            }
    char devs[512];
    describe_devices(devs, sizeof devs, li);
    if (!hit)
        return pd_error(PD_ENOTFOUND,
                        "%s: matches no instance of %s (server_id %s, server_ip %s, devices %s)",
                        l->what, g->what, li->server_id, li->server_ip, devs);
    if (second)
        return pd_error(PD_EINVAL,
                        "%s: matches more than one instance of %s (%s %zu and %s %zu): the "
                        "instance is ambiguous",
                        l->what, g->what, rt_role_name(hit->role), hit->index,
                        rt_role_name(second->role), second->index);
    if (role) *role = hit->role;
    if (index) *index = hit->index;
    return PD_OK;
}

/* ---- building ----------------------------------------------------------------------------------
 */

rt_global *rt_global_create(void)
{
    json_t *root =
        json_pack("{s:s, s:s, s:[]}", "version", "1.0", "status", "completed", "server_group_list");
    if (!root) return NULL;
    rt_global *g = global_new(root, "(built)");
    if (!g) json_decref(root);
    return g;
}

/* The group object of role in g's document, created in its place when absent. */
static json_t *group_for(rt_global *g, rt_role role)
{
    json_t *groups = json_object_get(g->root, "server_group_list");
    size_t ng = json_array_size(groups), pos = ng;
    for (size_t i = 0; i < ng; i++) {
        json_t *grp = json_array_get(groups, i);
        const char *id = json_string_value(json_object_get(grp, "group_id"));
        long gid;
        if (id && rt_parse_decimal(id, 2, &gid) == PD_OK) {
            if (gid == (long)role) return grp;
            if (gid > (long)role && pos == ng) pos = i;
        }
    }
    char id[4];
    snprintf(id, sizeof id, "%d", (int)role);
    json_t *grp = json_pack("{s:s, s:s, s:[]}", "group_id", id, "server_count", "0", "server_list");
    if (!grp) return NULL;
    if (json_array_insert_new(groups, pos, grp) != 0) return NULL;
    return grp;
}

static int set_count(json_t *grp)
{
    char cnt[24];
    snprintf(cnt, sizeof cnt, "%zu", json_array_size(json_object_get(grp, "server_list")));
    return json_object_set_new(grp, "server_count", json_string(cnt)) == 0 ? PD_OK : PD_ENOMEM;
}

static int check_arg(const char *name, const char *s)
{
    const char *why;
    if (!s) return pd_error(PD_EINVAL, "%s: required", name);
    if (rt_check_token(s, strlen(s), &why) < 0)
        return pd_error(PD_EINVAL, "%s \"%s\": %s", name, s, why);
    return PD_OK;
}

static int reindex(rt_global *g)
{
    int rc = rt_global_walk(g, g->root, g->what, RT_LOAD_FRAGMENT | RT_ALLOW_SHARED_DEVICES, false,
                            NULL);
    if (rc < 0)
        return pd_error(PD_EINTERNAL, "ranktable builder made an invalid table: %s",
                        pd_last_error());
    return PD_OK;
}

int rt_global_set_scheduler(rt_global *g, const char *server_id, const char *server_ip)
{
    PD_CHECK(check_arg("server_id", server_id));
    PD_CHECK(check_arg("server_ip", server_ip));
    json_t *grp = group_for(g, RT_ROLE_SCHEDULER);
    json_t *srv = json_pack("[{s:s, s:s}]", "server_id", server_id, "server_ip", server_ip);
    if (!grp || !srv || json_object_set_new(grp, "server_list", srv) != 0)
        return pd_error(PD_ENOMEM, "ranktable: out of memory");
    if (set_count(grp) < 0) return pd_error(PD_ENOMEM, "ranktable: out of memory");
    return reindex(g);
}

int rt_global_add_instance(rt_global *g, rt_role role, const char *server_id, const char *server_ip,
                           size_t n_devices, const int *ordinals, const char *const *device_ips,
                           size_t *index)
{
    if (role != RT_ROLE_PREFILL && role != RT_ROLE_DECODE)
        return pd_error(PD_EINVAL, "rt_global_add_instance: role must be prefill or decode");
    PD_CHECK(check_arg("server_id", server_id));
    PD_CHECK(check_arg("server_ip", server_ip));
    if (n_devices == 0 || n_devices > RT_MAX_DEVICES)
        return pd_error(PD_EINVAL, "%s instance: %zu devices, expected 1..%d", rt_role_name(role),
                        n_devices, RT_MAX_DEVICES);
    if (g->n[role] >= RT_MAX_INSTANCES)
        return pd_error(PD_EINVAL, "%s group: more than %d instances", rt_role_name(role),
                        RT_MAX_INSTANCES);
    for (size_t k = 0; k < n_devices; k++) {
        if (ordinals[k] < 0 || ordinals[k] >= RT_MAX_DEVICES)
            return pd_error(PD_EINVAL, "%s instance: device %d out of range 0..%d",
                            rt_role_name(role), ordinals[k], RT_MAX_DEVICES - 1);
        if (device_ips && device_ips[k]) PD_CHECK(check_arg("device_ip", device_ips[k]));
    }
    json_t *devs = json_array();
    json_t *srv = json_pack("{s:s, s:s}", "server_id", server_id, "server_ip", server_ip);
    int bad = !devs || !srv;
    for (size_t k = 0; k < n_devices && !bad; k++) {
        char id[16], rank[16];
        snprintf(id, sizeof id, "%d", ordinals[k]);
        snprintf(rank, sizeof rank, "%zu", k);
        const char *ip = device_ips && device_ips[k] ? device_ips[k] : server_ip;
        bad |= json_array_append_new(devs, json_pack("{s:s, s:s, s:s}", "device_id", id,
                                                     "device_ip", ip, "rank_id", rank)) != 0;
    }
    json_t *grp = bad ? NULL : group_for(g, role);
    if (!grp || json_object_set_new(srv, "device", devs) != 0) {
        json_decref(srv);
        return pd_error(PD_ENOMEM, "ranktable: out of memory");
    }
    devs = NULL;
    if (json_array_append_new(json_object_get(grp, "server_list"), srv) != 0 || set_count(grp) < 0)
        return pd_error(PD_ENOMEM, "ranktable: out of memory");
    PD_CHECK(reindex(g));
    if (index) *index = g->n[role] - 1;
    return PD_OK;
}

int rt_local_from_global(const rt_global *g, rt_role role, size_t i, rt_local **out)
{
    *out = NULL;
    const rt_instance *in = rt_global_instance(g, role, i);
    if (!in)
        return pd_error(PD_ENOTFOUND, "%s: no %s instance %zu", g->what, rt_role_name(role), i);
    json_t *groups = json_object_get(g->root, "server_group_list");
    json_t *srv = NULL;
    for (size_t k = 0; k < json_array_size(groups); k++) {
        json_t *grp = json_array_get(groups, k);
        const char *id = json_string_value(json_object_get(grp, "group_id"));
        long gid;
        if (id && rt_parse_decimal(id, 2, &gid) == PD_OK && gid == (long)role)
            srv = json_array_get(json_object_get(grp, "server_list"), i);
    }
    if (!srv) return pd_error(PD_EINTERNAL, "%s: index and document disagree", g->what);
    json_t *root =
        json_pack("{s:O, s:O, s:s, s:s, s:[o]}", "version", json_object_get(g->root, "version"),
                  "status", json_object_get(g->root, "status"), "group_id", "0", "server_count",
                  "1", "server_list", json_deep_copy(srv));
    if (!root) return pd_error(PD_ENOMEM, "ranktable: out of memory");
    char what[512];
    snprintf(what, sizeof what, "%s (local table of %s %zu)", g->what, rt_role_name(role), i);
    return local_from_json(root, what, NULL, out);
}

/* ---- merge
 * ----------------------------------------------------------------------------------------- */

/* Copies the keys of src that dst lacks, in src's order; key skip gets placeholder
 * (a new empty array) so its position is kept. */
static int merge_keys(json_t *dst, const json_t *src, const char *skip)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)src, key, v)
    {
        if (json_object_get(dst, key)) continue;
        json_t *copy = strcmp(key, skip) == 0 ? json_array() : json_deep_copy(v);
        if (!copy || json_object_set_new(dst, key, copy) != 0) return PD_ENOMEM;
    }
    return PD_OK;
}

int rt_global_merge(const rt_global *const *inputs, const char *const *names, size_t n,
                    unsigned flags, rt_global **out)
{
    *out = NULL;
    if (n == 0) return pd_error(PD_EINVAL, "merge: no input tables");
    size_t sched_count = 0, first_sched = 0;
    for (size_t i = 0; i < n; i++)
        if (rt_global_scheduler(inputs[i])) {
            if (sched_count == 1)
                return pd_error(PD_EINVAL,
                                "merge: %s and %s both carry a scheduler (group \"0\"); exactly "
                                "one input may have one (run gen with --api-server on one host "
                                "only)",
                                names[first_sched], names[i]);
            first_sched = i;
            sched_count++;
        }
    if (sched_count == 0)
        return pd_error(PD_EINVAL,
                        "merge: no input carries a scheduler (group \"0\"); run gen with "
                        "--api-server on exactly one host");

    json_t *root = json_object();
    json_t *grp[RT_ROLE_COUNT] = {0};
    int rc = root ? PD_OK : PD_ENOMEM;
    for (size_t i = 0; i < n && rc == PD_OK; i++) {
        const json_t *src = inputs[i]->root;
        rc = merge_keys(root, src, "server_group_list");
        json_t *groups = json_object_get(src, "server_group_list");
        for (size_t k = 0; k < json_array_size(groups) && rc == PD_OK; k++) {
            json_t *sg = json_array_get(groups, k);
            long gid;
            if (rt_parse_decimal(json_string_value(json_object_get(sg, "group_id")), 2, &gid) < 0)
                continue; /* cannot happen: inputs passed the walk */
            if (!grp[gid] && !(grp[gid] = json_object())) rc = PD_ENOMEM;
            if (rc == PD_OK) rc = merge_keys(grp[gid], sg, "server_list");
            json_t *dst = json_object_get(grp[gid], "server_list");
            json_t *list = json_object_get(sg, "server_list");
            for (size_t s = 0; s < json_array_size(list) && rc == PD_OK; s++)
                if (json_array_append_new(dst, json_deep_copy(json_array_get(list, s))) != 0)
                    rc = PD_ENOMEM;
        }
    }
    json_t *dst_groups = root ? json_object_get(root, "server_group_list") : NULL;
    for (int r = 0; r < RT_ROLE_COUNT; r++) {
        if (!grp[r]) continue;
        if (rc == PD_OK) rc = set_count(grp[r]);
        if (rc == PD_OK && json_array_append(dst_groups, grp[r]) != 0) rc = PD_ENOMEM;
        json_decref(grp[r]);
    }
    if (rc < 0) {
        json_decref(root);
        return pd_error(PD_ENOMEM, "merge: out of memory");
    }
    rt_report *none = NULL;
    return global_from_json(root, RT_MERGE_FILE_NAME, flags & ~(unsigned)RT_LOAD_FRAGMENT, none,
                            out);
}
