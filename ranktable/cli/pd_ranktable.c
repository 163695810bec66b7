/* pd-ranktable: generate, merge and check ranktables (command line of the Ascend tool
 * pd_ranktable_tools.py, plus our --mode check).
 *
 * Thin by design: argument splitting and printing only; the work is in ranktable/ so tests
 * link it directly. List options take every following argument up to the next "--option",
 * as Python argparse nargs='*' does, so existing runbooks keep working.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ranktable/ranktable.h"
#include "util/status.h"

static const char usage[] =
    "usage:\n"
    "  pd-ranktable --mode gen [--prefill-server-list 4,5 [6,7 ...]]\n"
    "               [--decode-server-list 6,7 [...]] [--api-server] [--save-dir DIR]\n"
    "               [--server-ip IP] [--device-ip-list IP,IP,...] [--allow-shared-devices]\n"
    "               [--prefill-pipeline-parallel-size P] [--decode-pipeline-parallel-size P]\n"
    "  pd-ranktable --mode merge --global-ranktable-list a.json b.json ... [--save-dir DIR]\n"
    "  pd-ranktable --mode check --global-ranktable-list g.json\n"
    "               [--local-ranktable-list l1.json ...] [--allow-shared-devices]\n"
    "               [--prefill-pipeline-parallel-size P] [--decode-pipeline-parallel-size P]\n"
    "\n"
    "gen writes global_ranktable_<ip>.json, local_ranktable_<ip>_<device ids>.json per\n"
    "instance and local_ranktable_<ip>_host.json with --api-server. Instances of a list are\n"
    "space-separated, the devices of one instance comma-separated. --server-ip (alias --ip)\n"
    "defaults to the first non-loopback IPv4 address; --device-ip-list gives the KV address\n"
    "of device k as entry k (default: the server ip). merge writes global_ranktable_merge.json.\n"
    "check validates every table, matches each local table against the global one and\n"
    "prints every problem; exit status 1 when there is any. An instance's devices are its\n"
    "ranks, pipeline stage by stage: with --<role>-pipeline-parallel-size P (default 1) gen\n"
    "and check refuse a device count that is not TP x P and print each role's TP x PP.\n";

#define MAX_ITEMS 4096

typedef struct {
    const char *mode;
    const char *save_dir;
    const char *server_ip;
    const char *device_ip_list;
    const char *pp[RT_ROLE_COUNT]; /* --<role>-pipeline-parallel-size (NULL: 1) */
    bool api_server;
    bool allow_shared;
    const char *prefill[MAX_ITEMS];
    size_t n_prefill;
    const char *decode[MAX_ITEMS];
    size_t n_decode;
    const char *globals[MAX_ITEMS];
    size_t n_globals;
    const char *locals[MAX_ITEMS];
    size_t n_locals;
} cli_args;

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "pd-ranktable: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n%s", usage);
    return 2;
}

/* Returns 0, or an exit status (2) after printing the problem. */
static int parse_args(int argc, char **argv, cli_args *a)
{
    for (int i = 1; i < argc; i++) {
        char opt[64];
        const char *arg = argv[i], *inline_val = NULL;
        if (strncmp(arg, "--", 2) != 0) return usage_error("unexpected argument \"%s\"", arg);
        const char *eq = strchr(arg, '=');
        size_t olen = eq ? (size_t)(eq - arg) : strlen(arg);
        if (olen >= sizeof opt) return usage_error("unknown option \"%s\"", arg);
        memcpy(opt, arg, olen);
        opt[olen] = '\0';
        if (eq) inline_val = eq + 1;

        const char **single = NULL;
        const char **list = NULL;
        size_t *count = NULL;
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            fputs(usage, stdout);
            exit(0);
        } else if (!strcmp(opt, "--api-server")) {
            a->api_server = true;
            continue;
        } else if (!strcmp(opt, "--allow-shared-devices")) {
            a->allow_shared = true;
            continue;
        } else if (!strcmp(opt, "--mode")) {
            single = &a->mode;
        } else if (!strcmp(opt, "--save-dir")) {
            single = &a->save_dir;
        } else if (!strcmp(opt, "--server-ip") || !strcmp(opt, "--ip")) {
            single = &a->server_ip;
        } else if (!strcmp(opt, "--device-ip-list")) {
            single = &a->device_ip_list;
        } else if (!strcmp(opt, "--prefill-pipeline-parallel-size")) {
            single = &a->pp[RT_ROLE_PREFILL];
        } else if (!strcmp(opt, "--decode-pipeline-parallel-size")) {
            single = &a->pp[RT_ROLE_DECODE];
        } else if (!strcmp(opt, "--prefill-server-list")) {
            list = a->prefill, count = &a->n_prefill;
        } else if (!strcmp(opt, "--decode-server-list")) {
            list = a->decode, count = &a->n_decode;
        } else if (!strcmp(opt, "--global-ranktable-list")) {
            list = a->globals, count = &a->n_globals;
        } else if (!strcmp(opt, "--local-ranktable-list")) {
            list = a->locals, count = &a->n_locals;
        } else {
            return usage_error("unknown option \"%s\"", opt);
        }
        if (single) {
            if (inline_val) {
                *single = inline_val;
            } else {
                if (i + 1 >= argc) return usage_error("%s needs a value", opt);
                *single = argv[++i];
            }
            continue;
        }
        if (inline_val) {
            if (*count == MAX_ITEMS) return usage_error("too many values for %s", opt);
            list[(*count)++] = inline_val;
        }
        while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
            if (*count == MAX_ITEMS) return usage_error("too many values for %s", opt);
            list[(*count)++] = argv[++i];
        }
    }
    if (!a->mode) a->mode = "gen"; /* the Ascend tool's default */
    if (!a->save_dir) a->save_dir = ".";
    return 0;
}

static void print_saved(const char *path, void *arg)
{
    (void)arg;
    printf("saved %s\n", path);
}

static void print_report(const rt_report *rep)
{
    size_t kept = 0;
    for (size_t i = 0; rt_report_message(rep, i); i++, kept++)
        fprintf(stderr, "error: %s\n", rt_report_message(rep, i));
    if (rt_report_count(rep) > kept)
        fprintf(stderr, "error: ... and %zu more problems\n", rt_report_count(rep) - kept);
}

/* Each role's devices as TP x PP ranks (--<role>-pipeline-parallel-size): 0 and "TP t x PP p"
 * per role in desc, or 1 after printing the problem. */
static int check_shapes(const cli_args *a, const rt_global *g, char *desc, size_t n)
{
    static const rt_role roles[2] = {RT_ROLE_PREFILL, RT_ROLE_DECODE};
    size_t used = 0;
    for (int i = 0; i < 2; i++) {
        rt_role role = roles[i];
        const char *v = a->pp[role];
        char *end = NULL;
        long pp = v ? strtol(v, &end, 10) : 1;
        if (v && (end == v || *end || pp < 1 || pp > 16)) {
            fprintf(stderr, "error: --%s-pipeline-parallel-size: expected 1 to 16, got \"%s\"\n",
                    rt_role_name(role), v);
            return 1;
        }
        int devices = rt_global_tp_size(g, role);
        if (rt_global_instance_count(g, role) && devices % pp) {
            fprintf(stderr,
                    "error: %s instances have %d device(s): not tensor-parallel size x %ld "
                    "pipeline stages (--%s-pipeline-parallel-size)\n",
                    rt_role_name(role), devices, pp, rt_role_name(role));
            return 1;
        }
        size_t count = rt_global_instance_count(g, role);
        int w = count
                    ? snprintf(desc + used, n - used, "%s%zu %s (TP %ld x PP %ld)", i ? "; " : "",
                               count, rt_role_name(role), devices / pp, pp)
                    : snprintf(desc + used, n - used, "%s0 %s", i ? "; " : "", rt_role_name(role));
        if (w > 0 && (size_t)w < n - used) used += (size_t)w;
    }
    return 0;
}

static int run_gen(const cli_args *a)
{
    rt_gen_params p = rt_gen_default_params();
    p.server_ip = a->server_ip;
    p.device_ip_list = a->device_ip_list;
    p.api_server = a->api_server;
    p.prefill = a->prefill;
    p.n_prefill = a->n_prefill;
    p.decode = a->decode;
    p.n_decode = a->n_decode;
    p.flags = a->allow_shared ? RT_ALLOW_SHARED_DEVICES : 0;
    char host[64];
    if (!p.server_ip) {
        if (rt_host_ipv4(host, sizeof host) < 0) {
            fprintf(stderr, "error: %s\n", pd_last_error());
            return 1;
        }
        p.server_ip = host;
    }
    rt_global *g = NULL;
    char shapes[256];
    if (rt_gen(&p, &g) < 0) {
        fprintf(stderr, "error: %s\n", pd_last_error());
        return 1;
    }
    if (check_shapes(a, g, shapes, sizeof shapes)) { /* before anything is written */
        rt_global_free(g);
        return 1;
    }
    if (rt_write_tables(g, p.server_ip, a->save_dir, print_saved, NULL) < 0) {
        fprintf(stderr, "error: %s\n", pd_last_error());
        rt_global_free(g);
        return 1;
    }
    printf("host %s: %s%s\n", p.server_ip, shapes, a->api_server ? "; scheduler" : "");
    rt_global_free(g);
    return 0;
}

static int run_merge(const cli_args *a, unsigned flags)
{
    if (a->n_globals < 2) {
        fprintf(stderr, "error: merge needs at least two --global-ranktable-list files, got %zu\n",
                a->n_globals);
        return 1;
    }
    rt_global *in[MAX_ITEMS] = {0};
    rt_report *rep = rt_report_create();
    int status = rep ? 0 : 1;
    for (size_t i = 0; i < a->n_globals && rep; i++)
        if (rt_global_load_file(a->globals[i], RT_LOAD_FRAGMENT | flags, rep, &in[i]) < 0)
            status = 1;
    if (status) {
        if (rep) print_report(rep);
    } else {
        rt_global *m = NULL;
        char path[4096];
        int n = snprintf(path, sizeof path, "%s/%s", a->save_dir, RT_MERGE_FILE_NAME);
        if (n < 0 || (size_t)n >= sizeof path) {
            fprintf(stderr, "error: --save-dir %s: path too long\n", a->save_dir);
            status = 1;
        } else if (rt_global_merge((const rt_global *const *)in, a->globals, a->n_globals, flags,
                                   &m) < 0) {
            fprintf(stderr, "error: %s\n", pd_last_error());
            status = 1;
        } else if (mkdir(a->save_dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "error: --save-dir %s: %s\n", a->save_dir, strerror(errno));
            status = 1;
        } else if (rt_global_save(m, path) < 0) {
            fprintf(stderr, "error: %s\n", pd_last_error());
            status = 1;
        } else {
            printf("saved %s: %zu prefill (TP %d), %zu decode (TP %d) from %zu tables\n", path,
                   rt_global_instance_count(m, RT_ROLE_PREFILL),
                   rt_global_tp_size(m, RT_ROLE_PREFILL),
                   rt_global_instance_count(m, RT_ROLE_DECODE),
                   rt_global_tp_size(m, RT_ROLE_DECODE), a->n_globals);
        }
        rt_global_free(m);
    }
    for (size_t i = 0; i < a->n_globals; i++) rt_global_free(in[i]);
    rt_report_free(rep);
    return status;
}

static int run_check(const cli_args *a, unsigned flags)
{
    if (a->n_globals == 0 && a->n_locals == 0) {
        fprintf(stderr, "error: check needs --global-ranktable-list (and optionally "
                        "--local-ranktable-list)\n");
        return 1;
    }
    rt_report *rep = rt_report_create();
    if (!rep) return 1;
    rt_global *g[MAX_ITEMS] = {0};
    int status = 0;
    for (size_t i = 0; i < a->n_globals; i++) {
        if (rt_global_load_file(a->globals[i], flags, rep, &g[i]) < 0) {
            status = 1;
            continue;
        }
        char shapes[256];
        if (check_shapes(a, g[i], shapes, sizeof shapes)) {
            status = 1;
            continue;
        }
        printf("ok: %s: scheduler %s; %s\n", a->globals[i], rt_global_scheduler(g[i])->server_ip,
               shapes);
    }
    for (size_t j = 0; j < a->n_locals; j++) {
        rt_local *l = NULL;
        if (rt_local_load_file(a->locals[j], 0, rep, &l) < 0) {
            status = 1;
            continue;
        }
        for (size_t i = 0; i < a->n_globals; i++) {
            if (!g[i]) continue;
            rt_role role;
            size_t idx;
            if (rt_find_instance(g[i], l, &role, &idx) < 0) {
                fprintf(stderr, "error: %s\n", pd_last_error());
                status = 1;
            } else {
                printf("ok: %s: %s %zu of %s\n", a->locals[j], rt_role_name(role), idx,
                       a->globals[i]);
            }
        }
        rt_local_free(l);
    }
    print_report(rep);
    for (size_t i = 0; i < a->n_globals; i++) rt_global_free(g[i]);
    rt_report_free(rep);
    return status;
}

int main(int argc, char **argv)
{
    static cli_args a; /* large lists: not on the stack */
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    unsigned flags = a.allow_shared ? RT_ALLOW_SHARED_DEVICES : 0;
    if (!strcmp(a.mode, "gen")) return run_gen(&a);
    if (!strcmp(a.mode, "merge")) return run_merge(&a, flags);
    if (!strcmp(a.mode, "check")) return run_check(&a, flags);
    return usage_error("--mode must be gen, merge or check, got \"%s\"", a.mode);
}
