/* Unit tests of the ranktable library: one bad file per validation rule (message names the
 * file and the JSON path), the Ascend guide's example tables as byte goldens, lookups,
 * building, gen, merge, and the Python-compatible serializer.
 * Data: tests/data/ranktable (make_data.py says where each file comes from). */
#include "harness.h"

#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>

#include "ranktable/ranktable.h"

static char *read_all(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    if (buf) buf[n] = '\0';
    fclose(f);
    return buf;
}

static const char *data(const char *name)
{
    static char path[8][1024];
    static int next;
    char *p = path[next++ % 8];
    snprintf(p, sizeof path[0], "%s/ranktable/%s", pdt_data_dir(), name);
    return p;
}

/* ---- one bad file per rule ---------------------------------------------------------------- */

typedef struct {
    const char *file; /* under tests/data/ranktable/bad */
    int status;
    const char *msg; /* expected after "<path of file>: " */
} bad_case;

static const bad_case bad_globals[] = {
    {"g_parse_error.json", PD_EPARSE, "line 4 column 23: '}' expected"},
    {"g_root_array.json", PD_EINVAL, "(root): expected object, got array"},
    {"g_missing_version.json", PD_EINVAL, "version: required"},
    {"g_bad_version.json", PD_EUNSUPPORTED, "version: \"2.0\" is not supported"},
    {"g_bad_status.json", PD_EINVAL, "status: expected \"completed\", got \"initializing\""},
    {"g_two_groups.json", PD_EINVAL, "server_group_list: expected exactly 3 groups"},
    {"g_group_order.json", PD_EINVAL,
     "server_group_list[2].group_id: group \"1\" out of order or repeated"},
    {"g_count_integer.json", PD_EINVAL,
     "server_group_list[1].server_count: must be a string (\"1\"), got integer"},
    {"g_count_mismatch.json", PD_EINVAL,
     "server_group_list[2].server_count: \"2\" but server_list has 1 entry"},
    {"g_rank_id.json", PD_EINVAL,
     "server_group_list[1].server_list[0].device[0].rank_id: expected \"0\""},
    {"g_device_id_text.json", PD_EINVAL,
     "server_group_list[1].server_list[0].device[0].device_id: expected a decimal number string "
     "like \"4\", got \"gpu4\""},
    {"g_device_id_leading_zero.json", PD_EINVAL,
     "server_group_list[2].server_list[0].device[1].device_id: expected a decimal number string "
     "like \"4\", got \"07\""},
    {"g_device_twice_host.json", PD_EINVAL,
     "server_group_list[2].server_list[0].device[0].device_id: device 5 on host 10.0.0.1 is "
     "already used by server_group_list[1].server_list[0] (prefill 0)"},
    {"g_device_twice_instance.json", PD_EINVAL,
     "server_group_list[1].server_list[0].device[1].device_id: device 4 appears twice in this "
     "instance"},
    {"g_tp_mismatch.json", PD_EINVAL,
     "server_group_list[1].server_list[1].device: prefill instances must share one "
     "tensor-parallel size: this one has 1 device, server_list[0] has 2"},
    {"g_two_schedulers.json", PD_EINVAL,
     "server_group_list[0].server_list: the scheduler group must have exactly one server, got 2"},
    {"g_scheduler_devices.json", PD_EINVAL,
     "server_group_list[0].server_list[0].device: the scheduler group has no devices, got 1"},
    {"g_no_devices.json", PD_EINVAL, "server_group_list[1].server_list[0].device: required"},
    {"g_empty_decode.json", PD_EINVAL,
     "server_group_list[2].server_list: the decode group has no instances"},
    {"g_missing_server_ip.json", PD_EINVAL,
     "server_group_list[1].server_list[0].server_ip: required"},
    {"g_empty_device_ip.json", PD_EINVAL,
     "server_group_list[1].server_list[0].device[1].device_ip: must not be empty"},
    {"g_server_ip_space.json", PD_EINVAL,
     "server_group_list[2].server_list[0].server_ip: must not contain spaces"},
};

static const bad_case bad_locals[] = {
    {"l_group_id.json", PD_EINVAL, "group_id: expected \"0\" (a local table is one group)"},
    {"l_count_mismatch.json", PD_EINVAL, "server_count: \"2\" but server_list has 1 entry"},
    {"l_two_servers.json", PD_EINVAL, "server_list: a local table holds exactly one server"},
    {"l_rank_id.json", PD_EINVAL, "server_list[0].device[1].rank_id: expected \"1\""},
};

static int check_bad(const bad_case *bc, bool local)
{
    char rel[256], expect[1024];
    snprintf(rel, sizeof rel, "bad/%s", bc->file);
    const char *path = data(rel);
    snprintf(expect, sizeof expect, "%s: %s", path, bc->msg);
    rt_report *rep = rt_report_create();
    int rc;
    if (local) {
        rt_local *l = (rt_local *)1;
        rc = rt_local_load_file(path, 0, rep, &l);
        if (l) rc = 99; /* *out must be NULL on failure */
    } else {
        rt_global *g = (rt_global *)1;
        rc = rt_global_load_file(path, 0, rep, &g);
        if (g) rc = 99;
    }
    int ok = rc == bc->status && strstr(pd_last_error(), expect) != NULL &&
             rt_report_count(rep) >= 1 && strstr(rt_report_message(rep, 0), expect) != NULL;
    if (!ok && rc == 99)
        printf("    %s: loaded without error, want %s \"%s\"\n", bc->file,
               pd_status_name(bc->status), expect);
    else if (!ok)
        printf("    %s: got %s \"%s\", want %s \"%s\"\n", bc->file, pd_status_name(rc),
               pd_last_error(), pd_status_name(bc->status), expect);
    rt_report_free(rep);
    return ok;
}

TEST(rt_bad_global_files_name_file_and_path)
{
    int failed = 0;
    for (size_t i = 0; i < sizeof bad_globals / sizeof bad_globals[0]; i++)
        failed += !check_bad(&bad_globals[i], false);
    ASSERT_EQ_INT(failed, 0);
    ASSERT(sizeof bad_globals / sizeof bad_globals[0] >= 15);
}

TEST(rt_bad_local_files_name_file_and_path)
{
    int failed = 0;
    for (size_t i = 0; i < sizeof bad_locals / sizeof bad_locals[0]; i++)
        failed += !check_bad(&bad_locals[i], true);
    ASSERT_EQ_INT(failed, 0);
}

TEST(rt_every_problem_is_reported)
{
    rt_report *rep = rt_report_create();
    rt_global *g;
    const char *path = data("bad/g_three_problems.json");
    ASSERT_ERR(rt_global_load_file(path, 0, rep, &g), PD_EINVAL, "(and 2 more problems)");
    ASSERT_EQ_INT(rt_report_count(rep), 3);
    ASSERT_CONTAINS(rt_report_message(rep, 0), "status: expected \"completed\"");
    ASSERT_CONTAINS(rt_report_message(rep, 1), "server_group_list[1].server_count: \"3\"");
    ASSERT_CONTAINS(rt_report_message(rep, 2),
                    "server_group_list[2].server_list[0].device[1].rank_id: expected \"1\"");
    ASSERT(rt_report_message(rep, 3) == NULL);
    rt_report_free(rep);
}

TEST(rt_local_must_match_one_instance)
{
    rt_global *g;
    rt_local *l;
    ASSERT_OK(rt_global_load_file(data("good_1p1d.json"), 0, NULL, &g));
    ASSERT_OK(rt_local_load_file(data("bad/l_no_match.json"), 0, NULL, &l));
    int rc = rt_find_instance(g, l, NULL, NULL);
    rt_local_free(l);
    ASSERT_EQ_INT(rc, PD_ENOTFOUND);
    ASSERT_CONTAINS(pd_last_error(), "l_no_match.json: matches no instance of");
    ASSERT_CONTAINS(pd_last_error(), "good_1p1d.json (server_id 10.0.0.1, server_ip 10.0.0.1, "
                                     "devices 4@10.0.0.1,5@10.9.9.9)");

    ASSERT_OK(rt_local_load_file(data("bad/l_host_mismatch.json"), 0, NULL, &l));
    ASSERT(rt_local_is_host(l));
    rc = rt_find_instance(g, l, NULL, NULL);
    rt_local_free(l);
    ASSERT_EQ_INT(rc, PD_ENOTFOUND);
    ASSERT_CONTAINS(pd_last_error(), "l_host_mismatch.json: a host (scheduler) table for "
                                     "server_id 10.0.0.7");

    rt_role role;
    size_t idx = 9;
    ASSERT_OK(rt_local_load_file(data("good_1p1d_local_45.json"), 0, NULL, &l));
    ASSERT_OK(rt_find_instance(g, l, &role, &idx));
    ASSERT_EQ_INT(role, RT_ROLE_PREFILL);
    ASSERT_EQ_INT(idx, 0);
    rt_local_free(l);
    ASSERT_OK(rt_local_load_file(data("good_1p1d_local_host.json"), 0, NULL, &l));
    ASSERT_OK(rt_find_instance(g, l, &role, &idx));
    ASSERT_EQ_INT(role, RT_ROLE_SCHEDULER);
    rt_local_free(l);
    rt_global_free(g);
}

TEST(rt_parse_error_from_string_names_what)
{
    rt_global *g;
    const char *text = "{\"version\": \"1.0\",\n  \"status\": }";
    ASSERT_ERR(rt_global_load_string(text, strlen(text), "env GLOBAL_RANK_TABLE", 0, NULL, &g),
               PD_EPARSE, "env GLOBAL_RANK_TABLE: line 2 column 13:");
    rt_local *l;
    ASSERT_ERR(rt_local_load_string("[1]", 3, "x.json", 0, NULL, &l), PD_EINVAL,
               "x.json: (root): expected object, got array");
    ASSERT_ERR(rt_global_load_file(data("no_such_file.json"), 0, NULL, &g), PD_ENOTFOUND,
               "no_such_file.json");
}

/* ---- the guide's example ------------------------------------------------------------------- */

TEST(rt_guide_example_lookups)
{
    rt_global *g;
    ASSERT_OK(rt_global_load_file(data("guide_global.json"), 0, NULL, &g));
    ASSERT(rt_global_is_complete(g));
    ASSERT_EQ_INT(rt_global_instance_count(g, RT_ROLE_SCHEDULER), 1);
    ASSERT_EQ_INT(rt_global_instance_count(g, RT_ROLE_PREFILL), 1);
    ASSERT_EQ_INT(rt_global_instance_count(g, RT_ROLE_DECODE), 1);
    ASSERT_EQ_INT(rt_global_tp_size(g, RT_ROLE_PREFILL), 2);
    ASSERT_EQ_INT(rt_global_tp_size(g, RT_ROLE_DECODE), 2);
    ASSERT_EQ_INT(rt_global_tp_size(g, RT_ROLE_SCHEDULER), 0);
    ASSERT_STR_EQ(rt_global_scheduler(g)->server_ip, "localhost");
    ASSERT_EQ_INT(rt_global_node_count(g), 2);
    const rt_instance *p = rt_global_node(g, 0), *d = rt_global_node(g, 1);
    ASSERT(p && d && rt_global_node(g, 2) == NULL);
    ASSERT_EQ_INT(p->role, RT_ROLE_PREFILL);
    ASSERT_EQ_INT(d->role, RT_ROLE_DECODE);
    ASSERT(rt_global_instance(g, RT_ROLE_DECODE, 0) == d);
    ASSERT(rt_global_instance(g, RT_ROLE_DECODE, 1) == NULL);
    ASSERT_EQ_INT(d->n_devices, 2);
    ASSERT_EQ_INT(d->devices[0].ordinal, 6);
    ASSERT_EQ_INT(d->devices[1].ordinal, 7);
    ASSERT_EQ_INT(d->devices[1].rank, 1);
    ASSERT_STR_EQ(d->devices[1].device_ip, "29.**.**.72");
    ASSERT_STR_EQ(p->devices[0].device_id, "4");

    rt_local *l;
    rt_role role;
    size_t idx;
    ASSERT_OK(rt_local_load_file(data("guide_local_67.json"), 0, NULL, &l));
    ASSERT(!rt_local_is_host(l));
    ASSERT_OK(rt_find_instance(g, l, &role, &idx));
    ASSERT_EQ_INT(role, RT_ROLE_DECODE);
    ASSERT_EQ_INT(idx, 0);
    char name[128];
    ASSERT_OK(rt_local_file_name(name, sizeof name, "10.1.1.18", rt_local_instance(l)));
    ASSERT_STR_EQ(name, "local_ranktable_10.1.1.18_67.json");
    ASSERT_OK(rt_local_file_name(name, sizeof name, "10.1.1.18", NULL));
    ASSERT_STR_EQ(name, "local_ranktable_10.1.1.18_host.json");
    ASSERT_OK(rt_global_file_name(name, sizeof name, "10.1.1.18"));
    ASSERT_STR_EQ(name, "global_ranktable_10.1.1.18.json");
    ASSERT_ERR(rt_global_file_name(name, 10, "10.1.1.18"), PD_ERANGE, "too long");
    rt_local_free(l);
    rt_global_free(g);
}

TEST(rt_dumps_reproduces_guide_bytes)
{
    char *want = read_all(data("guide_global.json"));
    char *want_l = read_all(data("guide_local_67.json"));
    ASSERT(want && want_l);
    rt_global *g;
    rt_local *l;
    ASSERT_OK(rt_global_load_string(want, strlen(want), "guide", 0, NULL, &g));
    ASSERT_OK(rt_local_load_string(want_l, strlen(want_l), "guide local", 0, NULL, &l));
    char *got = rt_global_dumps(g), *got_l = rt_local_dumps(l);
    ASSERT_STR_EQ(got, want);
    ASSERT_STR_EQ(got_l, want_l);
    free(got);
    free(got_l);
    /* The local table gen derives from the global one is the guide's local table. */
    rt_local *derived;
    ASSERT_OK(rt_local_from_global(g, RT_ROLE_DECODE, 0, &derived));
    got_l = rt_local_dumps(derived);
    ASSERT_STR_EQ(got_l, want_l);
    free(got_l);
    rt_local_free(derived);
    rt_local_free(l);
    rt_global_free(g);
    free(want);
    free(want_l);
}

/* gen with the guide's arguments and --server-ip: the guide's global JSON (same keys, key
 * order, string values). With device IPs given per device id, byte-identical. */
TEST(rt_gen_guide_example)
{
    const char *pre[] = {"4,5"}, *dec[] = {"6,7"};
    rt_gen_params p = rt_gen_default_params();
    p.server_ip = "localhost";
    p.api_server = true;
    p.prefill = pre;
    p.n_prefill = 1;
    p.decode = dec;
    p.n_decode = 1;
    p.device_ip_list = "-,-,-,-,10.**.**.22,10.**.**.23,29.**.**.56,29.**.**.72";
    rt_global *g;
    ASSERT_OK(rt_gen(&p, &g));
    ASSERT_STR_EQ(rt_global_what(g), "global_ranktable_localhost.json");
    char *want = read_all(data("guide_global.json"));
    char *got = rt_global_dumps(g);
    ASSERT(want && got);
    ASSERT_STR_EQ(got, want);
    free(got);
    rt_global_free(g);

    /* Without --device-ip-list every device_ip is the host address. */
    p.device_ip_list = NULL;
    ASSERT_OK(rt_gen(&p, &g));
    ASSERT_STR_EQ(rt_global_instance(g, RT_ROLE_PREFILL, 0)->devices[1].device_ip, "localhost");
    got = rt_global_dumps(g);
    /* Same text once the guide's device addresses are replaced by the host's. */
    const char *from[] = {"10.**.**.22", "10.**.**.23", "29.**.**.56", "29.**.**.72"};
    for (int k = 0; k < 4; k++) {
        char *at = strstr(want, from[k]);
        ASSERT(at);
        memmove(at + 9, at + 11, strlen(at + 11) + 1);
        memcpy(at, "localhost", 9);
    }
    ASSERT_STR_EQ(got, want);
    free(got);
    free(want);

    /* The four files with the guide's names. */
    char dir[512], path[1024];
    snprintf(dir, sizeof dir, "%s/gen_guide", pdt_tmp_dir());
    ASSERT_OK(rt_write_tables(g, "10.1.1.18", dir, NULL, NULL));
    const char *names[] = {"global_ranktable_10.1.1.18.json", "local_ranktable_10.1.1.18_45.json",
                           "local_ranktable_10.1.1.18_67.json",
                           "local_ranktable_10.1.1.18_host.json"};
    for (int k = 0; k < 4; k++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        char *t = read_all(path);
        ASSERT_MSG(t != NULL, "missing %s", path);
        ASSERT(t[strlen(t) - 1] == '}'); /* json.dump writes no trailing newline */
        free(t);
    }
    rt_local *l;
    rt_role role;
    size_t idx;
    snprintf(path, sizeof path, "%s/%s", dir, names[3]);
    ASSERT_OK(rt_local_load_file(path, 0, NULL, &l));
    ASSERT_OK(rt_find_instance(g, l, &role, &idx));
    ASSERT_EQ_INT(role, RT_ROLE_SCHEDULER);
    rt_local_free(l);
    rt_global_free(g);
    /* the guide's Steps 6-8 spell the local tables local_rank_table_*: the refusal names the
       file gen wrote next to it */
    snprintf(path, sizeof path, "%s/local_rank_table_10.1.1.18_45.json", dir);
    char want_near[1200];
    snprintf(want_near, sizeof want_near,
             "local_rank_table_10.1.1.18_45.json: No such file or directory; "
             "%s/local_ranktable_10.1.1.18_45.json exists next to it",
             dir);
    ASSERT_ERR(rt_local_load_file(path, 0, NULL, &l), PD_ENOTFOUND, want_near);
    snprintf(path, sizeof path, "%s/local_ranktable_10.1.1.18_99.json", dir);
    ASSERT_ERR(rt_local_load_file(path, 0, NULL, &l), PD_ENOTFOUND,
               "local_ranktable_10.1.1.18_99.json: No such file or directory");
    ASSERT(!strstr(pd_last_error(), "next to it"));
}

TEST(rt_gen_bad_arguments)
{
    rt_gen_params p = rt_gen_default_params();
    rt_global *g;
    p.server_ip = "10.0.0.1";
    ASSERT_ERR(rt_gen(&p, &g), PD_EINVAL, "nothing to generate");
    const char *pre[] = {"4,5", "4,x"};
    p.prefill = pre;
    p.n_prefill = 2;
    ASSERT_ERR(rt_gen(&p, &g), PD_EINVAL,
               "--prefill-server-list[1]: \"4,x\": \"x\" is not a device id");
    pre[1] = "5,6";
    ASSERT_ERR(rt_gen(&p, &g), PD_EINVAL,
               "global_ranktable_10.0.0.1.json: server_group_list[0].server_list[1].device[0]."
               "device_id: device 5 on host 10.0.0.1 is already used by "
               "server_group_list[0].server_list[0] (prefill 0)");
    p.flags = RT_ALLOW_SHARED_DEVICES;
    ASSERT_OK(rt_gen(&p, &g));
    ASSERT(!rt_global_is_complete(g));
    rt_global_free(g);
    p.flags = 0;
    pre[1] = "6";
    ASSERT_ERR(rt_gen(&p, &g), PD_EINVAL, "prefill instances must share one tensor-parallel size");
    pre[1] = "6,7";
    p.device_ip_list = "a,b,c,d,e,f";
    ASSERT_ERR(rt_gen(&p, &g), PD_EINVAL,
               "--prefill-server-list[1]: device 6 has no address in --device-ip-list");
    p.device_ip_list = "a,,c";
    ASSERT_ERR(rt_gen(&p, &g), PD_EINVAL, "--device-ip-list: entry 1 (device 1) must not be empty");
    p.device_ip_list = NULL;
    p.server_ip = "a b";
    ASSERT_ERR(rt_gen(&p, &g), PD_EINVAL, "--server-ip \"a b\": must not contain spaces");
}

TEST(rt_parse_device_lists)
{
    int ords[4];
    size_t n;
    ASSERT_OK(rt_parse_device_list("0,10,3", "x", ords, 4, &n));
    ASSERT_EQ_INT(n, 3);
    ASSERT_EQ_INT(ords[1], 10);
    ASSERT_ERR(rt_parse_device_list("", "opt", ords, 4, &n), PD_EINVAL, "opt: empty device list");
    ASSERT_ERR(rt_parse_device_list("1,,2", "opt", ords, 4, &n), PD_EINVAL, "empty entry 1");
    ASSERT_ERR(rt_parse_device_list("1,01", "opt", ords, 4, &n), PD_EINVAL,
               "\"01\" is not a device id");
    ASSERT_ERR(rt_parse_device_list("1,1", "opt", ords, 4, &n), PD_EINVAL, "device 1 listed twice");
    ASSERT_ERR(rt_parse_device_list("5000", "opt", ords, 4, &n), PD_EINVAL, "out of range");
    ASSERT_ERR(rt_parse_device_list("0,1,2,3,4", "opt", ords, 4, &n), PD_EINVAL,
               "more than 4 devices");
}

TEST(rt_host_ipv4_is_dotted_or_says_what_to_do)
{
    char ip[64];
    int rc = rt_host_ipv4(ip, sizeof ip);
    if (rc == PD_ENOTFOUND) {
        ASSERT_CONTAINS(pd_last_error(), "--server-ip");
        return;
    }
    ASSERT_OK(rc);
    struct in_addr a;
    ASSERT_EQ_INT(inet_pton(AF_INET, ip, &a), 1);
    ASSERT(strncmp(ip, "127.", 4) != 0);
}

/* ---- building, merge ------------------------------------------------------------------------ */

TEST(rt_build_then_validate)
{
    rt_global *g = rt_global_create();
    ASSERT(g);
    int d01[] = {0, 1}, d2[] = {2}, d23[] = {2, 3};
    size_t idx;
    ASSERT_OK(rt_global_add_instance(g, RT_ROLE_DECODE, "h", "10.0.0.5", 1, d2, NULL, &idx));
    ASSERT_EQ_INT(idx, 0);
    const char *ips[] = {"192.168.0.10", NULL};
    ASSERT_OK(rt_global_add_instance(g, RT_ROLE_PREFILL, "h", "10.0.0.5", 2, d01, ips, &idx));
    /* Built out of order: groups still come out "1" then "2". */
    ASSERT_ERR(rt_global_validate(g, "t", 0, NULL), PD_EINVAL,
               "t: server_group_list: expected exactly 3 groups");
    ASSERT_OK(rt_global_validate(g, "t", RT_LOAD_FRAGMENT, NULL));
    ASSERT_OK(rt_global_set_scheduler(g, "h", "10.0.0.5"));
    ASSERT_OK(rt_global_validate(g, "t", 0, NULL));
    ASSERT(rt_global_is_complete(g));
    const rt_instance *p = rt_global_instance(g, RT_ROLE_PREFILL, 0);
    ASSERT_STR_EQ(p->devices[0].device_ip, "192.168.0.10");
    ASSERT_STR_EQ(p->devices[1].device_ip, "10.0.0.5");
    ASSERT_STR_EQ(p->devices[1].rank_id, "1");
    /* A second decode instance with another TP size: built, then refused by validation. */
    ASSERT_OK(rt_global_add_instance(g, RT_ROLE_DECODE, "h", "10.0.0.5", 2, d23, NULL, NULL));
    ASSERT_ERR(rt_global_validate(g, "t", 0, NULL), PD_EINVAL,
               "t: server_group_list[2].server_list[1].device: decode instances must share one "
               "tensor-parallel size");
    ASSERT_ERR(rt_global_add_instance(g, RT_ROLE_SCHEDULER, "h", "x", 1, d2, NULL, NULL), PD_EINVAL,
               "role must be prefill or decode");
    int bad[] = {-1};
    ASSERT_ERR(rt_global_add_instance(g, RT_ROLE_DECODE, "h", "x", 1, bad, NULL, NULL), PD_EINVAL,
               "device -1 out of range");
    ASSERT_ERR(rt_global_set_scheduler(g, "", "x"), PD_EINVAL, "server_id \"\": must not be empty");
    rt_global_free(g);
}

static rt_global *gen_host(const char *ip, bool api, const char *pre, const char *dec)
{
    rt_gen_params p = rt_gen_default_params();
    p.server_ip = ip;
    p.api_server = api;
    p.prefill = &pre;
    p.n_prefill = pre ? 1 : 0;
    p.decode = &dec;
    p.n_decode = dec ? 1 : 0;
    rt_global *g = NULL;
    if (rt_gen(&p, &g) < 0) printf("    gen_host: %s\n", pd_last_error());
    return g;
}

TEST(rt_merge_two_hosts_then_check)
{
    /* 2P2D across two hosts: host A runs the scheduler, P0 (0,1) and D0 (2,3); host B runs
     * P1 (0,1) and D1 (2,3). Same device ids on different hosts are fine. */
    rt_global *a = gen_host("10.0.0.1", true, "0,1", "2,3");
    rt_global *b = gen_host("10.0.0.2", false, "0,1", "2,3");
    ASSERT(a && b);
    /* Written and re-read as files, like the CLI does. */
    char pa[1024], pb[1024];
    snprintf(pa, sizeof pa, "%s/merge_a.json", pdt_tmp_dir());
    snprintf(pb, sizeof pb, "%s/merge_b.json", pdt_tmp_dir());
    ASSERT_OK(rt_global_save(a, pa));
    ASSERT_OK(rt_global_save(b, pb));
    rt_global *fa, *fb, *m;
    ASSERT_ERR(rt_global_load_file(pb, 0, NULL, &fb), PD_EINVAL, "run --mode merge");
    ASSERT_OK(rt_global_load_file(pa, RT_LOAD_FRAGMENT, NULL, &fa));
    ASSERT_OK(rt_global_load_file(pb, RT_LOAD_FRAGMENT, NULL, &fb));
    const rt_global *in[] = {fb, fa};
    const char *names[] = {pb, pa};
    ASSERT_OK(rt_global_merge(in, names, 2, 0, &m));
    ASSERT_STR_EQ(rt_global_what(m), RT_MERGE_FILE_NAME);
    ASSERT_EQ_INT(rt_global_instance_count(m, RT_ROLE_PREFILL), 2);
    ASSERT_EQ_INT(rt_global_instance_count(m, RT_ROLE_DECODE), 2);
    ASSERT_STR_EQ(rt_global_scheduler(m)->server_ip, "10.0.0.1");
    /* Input order: b's instances first. */
    ASSERT_STR_EQ(rt_global_instance(m, RT_ROLE_PREFILL, 0)->server_ip, "10.0.0.2");
    ASSERT_STR_EQ(rt_global_instance(m, RT_ROLE_DECODE, 1)->server_ip, "10.0.0.1");
    ASSERT_STR_EQ(rt_global_node(m, 2)->server_ip, "10.0.0.2");

    char pm[1024];
    snprintf(pm, sizeof pm, "%s/%s", pdt_tmp_dir(), RT_MERGE_FILE_NAME);
    ASSERT_OK(rt_global_save(m, pm));
    rt_global *chk;
    ASSERT_OK(rt_global_load_file(pm, 0, NULL, &chk));
    char *t = read_all(pm);
    ASSERT(t);
    ASSERT_CONTAINS(t, "\"server_count\": \"2\"");
    free(t);
    /* Each host's local tables find their place in the merged table. */
    rt_local *l;
    rt_role role;
    size_t idx;
    ASSERT_OK(rt_local_from_global(a, RT_ROLE_DECODE, 0, &l));
    ASSERT_OK(rt_find_instance(chk, l, &role, &idx));
    ASSERT_EQ_INT(role, RT_ROLE_DECODE);
    ASSERT_EQ_INT(idx, 1);
    rt_local_free(l);
    ASSERT_OK(rt_local_from_global(b, RT_ROLE_PREFILL, 0, &l));
    ASSERT_OK(rt_find_instance(chk, l, &role, &idx));
    ASSERT_EQ_INT(role, RT_ROLE_PREFILL);
    ASSERT_EQ_INT(idx, 0);
    rt_local_free(l);
    ASSERT_OK(rt_local_from_global(a, RT_ROLE_SCHEDULER, 0, &l));
    ASSERT_OK(rt_find_instance(chk, l, &role, &idx));
    ASSERT_EQ_INT(role, RT_ROLE_SCHEDULER);
    rt_local_free(l);
    rt_global_free(chk);
    rt_global_free(m);
    rt_global_free(fa);
    rt_global_free(fb);
    rt_global_free(a);
    rt_global_free(b);
}

TEST(rt_merge_refuses_two_schedulers_or_none)
{
    rt_global *a = gen_host("10.0.0.1", true, "0,1", NULL);
    rt_global *b = gen_host("10.0.0.2", true, NULL, "0,1");
    rt_global *c = gen_host("10.0.0.3", false, "0,1", "2,3");
    ASSERT(a && b && c);
    rt_global *m = (rt_global *)1;
    const rt_global *in[] = {a, c, b};
    const char *names[] = {"a.json", "c.json", "b.json"};
    ASSERT_ERR(rt_global_merge(in, names, 3, 0, &m), PD_EINVAL,
               "merge: a.json and b.json both carry a scheduler (group \"0\")");
    ASSERT(m == NULL);
    const rt_global *in2[] = {c, c};
    ASSERT_ERR(rt_global_merge(in2, names, 2, 0, &m), PD_EINVAL,
               "merge: no input carries a scheduler");
    /* One scheduler, but the same host twice: its devices collide. */
    const rt_global *in3[] = {a, c, c};
    ASSERT_ERR(rt_global_merge(in3, names, 3, 0, &m), PD_EINVAL,
               "global_ranktable_merge.json: server_group_list[1].server_list[2].device[0]."
               "device_id: device 0 on host 10.0.0.3 is already used by "
               "server_group_list[1].server_list[1]");
    /* A scheduler and prefill only: no decode group in the result. */
    const rt_global *in4[] = {a, a};
    const char *names4[] = {"a.json", "a2.json"};
    ASSERT_ERR(rt_global_merge(in4, names4, 2, 0, &m), PD_EINVAL, "both carry a scheduler");
    rt_global_free(a);
    rt_global_free(b);
    rt_global_free(c);
}

TEST(rt_merge_keeps_unknown_fields)
{
    const char *ta =
        "{\"version\": \"1.0\", \"status\": \"completed\", \"note\": {\"by\": \"ops\"},"
        " \"server_group_list\": [{\"group_id\": \"0\", \"server_count\": \"1\", \"zone\": \"a\","
        " \"server_list\": [{\"server_id\": \"h1\", \"server_ip\": \"10.0.0.1\", \"port\": 9000}]},"
        " {\"group_id\": \"1\", \"server_count\": \"1\", \"server_list\": [{\"server_id\": \"h1\","
        " \"server_ip\": \"10.0.0.1\", \"device\": [{\"device_id\": \"0\", \"device_ip\": \"x\","
        " \"rank_id\": \"0\", \"nic\": \"mlx5_0\"}], \"weight\": 0.5}]}]}";
    const char *tb =
        "{\"version\": \"1.0\", \"status\": \"completed\", \"server_group_list\": ["
        " {\"group_id\": \"2\", \"server_count\": \"1\", \"server_list\": [{\"server_id\": \"h2\","
        " \"server_ip\": \"10.0.0.2\", \"device\": [{\"device_id\": \"0\", \"device_ip\": \"y\","
        " \"rank_id\": \"0\"}]}]}], \"extra\": true}";
    rt_global *a, *b, *m;
    ASSERT_OK(rt_global_load_string(ta, strlen(ta), "a", RT_LOAD_FRAGMENT, NULL, &a));
    ASSERT_OK(rt_global_load_string(tb, strlen(tb), "b", RT_LOAD_FRAGMENT, NULL, &b));
    const rt_global *in[] = {a, b};
    const char *names[] = {"a", "b"};
    ASSERT_OK(rt_global_merge(in, names, 2, 0, &m));
    char *t = rt_global_dumps(m);
    ASSERT(t);
    /* Top level: a's keys in a's order, then b's new key. */
    ASSERT_CONTAINS(t, "{\n    \"version\": \"1.0\",\n    \"status\": \"completed\",\n"
                       "    \"note\": {\n        \"by\": \"ops\"\n    },\n"
                       "    \"server_group_list\": [");
    ASSERT_CONTAINS(t, "\n    ],\n    \"extra\": true\n}");
    ASSERT_CONTAINS(t, "\"zone\": \"a\"");
    ASSERT_CONTAINS(t, "\"port\": 9000");
    ASSERT_CONTAINS(t, "\"nic\": \"mlx5_0\"");
    ASSERT_CONTAINS(t, "\"weight\": 0.5");
    free(t);
    rt_global_free(m);
    rt_global_free(a);
    rt_global_free(b);
}

/* ---- serializer -------------------------------------------------------------------------------
 */

TEST(rt_dumps_matches_python_json_dump)
{
    /* Expected text from /usr/bin/python3: json.dumps(obj, indent=4) of the same object. */
    const char *text =
        "{\"version\": \"1.0\", \"status\": \"completed\", \"server_group_list\": [{\"group_id\":"
        " \"0\", \"server_count\": \"1\", \"server_list\": [{\"server_id\": \"h\", \"server_ip\":"
        " \"h\"}]}], \"f\": [0.1, 1e16, 1e-5, 0.0001, 100.0, -0.0, 123456789.125, 1.5e300,"
        " 2.5e-7, 9999999999999998.0], \"s\": "
        "\"\\u00e9\\u007f\\ud83d\\ude00\\n\\t\\\"\\\\/\\u0001\","
        " \"e\": {}, \"a\": [], \"n\": [null, true, false, -7]}";
    const char *want =
        "{\n    \"version\": \"1.0\",\n    \"status\": \"completed\",\n    \"server_group_list\": "
        "[\n        {\n            \"group_id\": \"0\",\n            \"server_count\": \"1\",\n"
        "            \"server_list\": [\n                {\n                    \"server_id\": "
        "\"h\",\n                    \"server_ip\": \"h\"\n                }\n            ]\n"
        "        }\n    ],\n    \"f\": [\n        0.1,\n        1e+16,\n        1e-05,\n"
        "        0.0001,\n        100.0,\n        -0.0,\n        123456789.125,\n"
        "        1.5e+300,\n        2.5e-07,\n        9999999999999998.0\n    ],\n"
        "    \"s\": \"\\u00e9\\u007f\\ud83d\\ude00\\n\\t\\\"\\\\/\\u0001\",\n    \"e\": {},\n"
        "    \"a\": [],\n    \"n\": [\n        null,\n        true,\n        false,\n        -7\n"
        "    ]\n}";
    rt_global *g;
    ASSERT_OK(rt_global_load_string(text, strlen(text), "py", RT_LOAD_FRAGMENT, NULL, &g));
    char *got = rt_global_dumps(g);
    ASSERT_STR_EQ(got, want);
    free(got);
    rt_global_free(g);
}

TEST(rt_report_limits)
{
    rt_report *r = rt_report_create();
    ASSERT(r);
    ASSERT_EQ_INT(rt_report_count(r), 0);
    ASSERT(rt_report_message(r, 0) == NULL);
    rt_global *g;
    ASSERT(rt_global_load_file(data("bad/g_rank_id.json"), 0, r, &g) < 0);
    ASSERT_EQ_INT(rt_report_count(r), 2);
    rt_report_clear(r);
    ASSERT_EQ_INT(rt_report_count(r), 0);
    rt_report_free(r);
    rt_report_free(NULL);
    ASSERT_STR_EQ(rt_role_name(RT_ROLE_DECODE), "decode");
    ASSERT_STR_EQ(rt_role_name((rt_role)7), "unknown");
}
