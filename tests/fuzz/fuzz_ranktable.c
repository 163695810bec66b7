/* libFuzzer target: the ranktable parser and everything built on a parsed table.
 *
 * The input is read as a global table (complete and fragment) and as a local table. Beyond
 * "no crash, no leak, no UB", it checks invariants and aborts (a finding) when one breaks:
 * a table that loads serializes to text that loads again and serializes to the same bytes;
 * the local table derived from every instance finds exactly that instance; merging a table
 * that has a scheduler with itself is refused (two schedulers).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ranktable/ranktable.h"
#include "util/status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_ranktable invariant broken: %s: %s\n", what, detail);
    abort();
}

static void roundtrip(const rt_global *g, unsigned flags)
{
    char *text = rt_global_dumps(g);
    if (!text) return; /* out of memory */
    rt_global *again = NULL;
    if (rt_global_load_string(text, strlen(text), "dumped", flags, NULL, &again) < 0)
        fail("dumped table does not load", pd_last_error());
    char *text2 = rt_global_dumps(again);
    if (text2 && strcmp(text, text2) != 0) fail("dump is not stable", text);
    free(text2);
    rt_global_free(again);
    free(text);
}

static void locals_find_themselves(const rt_global *g)
{
    for (int r = 0; r < RT_ROLE_COUNT; r++)
        for (size_t i = 0; i < rt_global_instance_count(g, (rt_role)r); i++) {
            rt_local *l = NULL;
            if (rt_local_from_global(g, (rt_role)r, i, &l) < 0)
                fail("local_from_global", pd_last_error());
            char *text = rt_local_dumps(l);
            rt_local *l2 = NULL;
            if (text && rt_local_load_string(text, strlen(text), "local", 0, NULL, &l2) < 0)
                fail("derived local table does not load", pd_last_error());
            rt_role role;
            size_t idx;
            if (rt_find_instance(g, l, &role, &idx) < 0) fail("find_instance", pd_last_error());
            if ((int)role != r || idx != i) fail("find_instance", "found another instance");
            free(text);
            rt_local_free(l2);
            rt_local_free(l);
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    rt_report *rep = rt_report_create();
    rt_global *g = NULL, *frag = NULL;
    rt_local *l = NULL;

    if (rt_global_load_string(text, size, "fuzz", 0, rep, &g) == 0) {
        if (!rt_global_is_complete(g)) fail("complete table", "a group is missing");
        roundtrip(g, 0);
        locals_find_themselves(g);
        const rt_global *in[] = {g, g};
        const char *names[] = {"a", "b"};
        rt_global *m = NULL;
        if (rt_global_merge(in, names, 2, 0, &m) == 0) fail("merge", "two schedulers accepted");
    }
    rt_report_clear(rep);
    if (rt_global_load_string(text, size, "fuzz", RT_LOAD_FRAGMENT | RT_ALLOW_SHARED_DEVICES, rep,
                              &frag) == 0) {
        roundtrip(frag, RT_LOAD_FRAGMENT | RT_ALLOW_SHARED_DEVICES);
        for (size_t k = 0; k < rt_global_node_count(frag); k++)
            if (!rt_global_node(frag, k)) fail("node", "NULL inside the count");
    }
    if (rt_local_load_string(text, size, "fuzz", 0, rep, &l) == 0) {
        if (g) (void)rt_find_instance(g, l, NULL, NULL);
        if (frag) (void)rt_find_instance(frag, l, NULL, NULL);
        char name[512];
        (void)rt_local_file_name(name, sizeof name, "10.0.0.1", rt_local_instance(l));
    }
    rt_local_free(l);
    rt_global_free(frag);
    rt_global_free(g);
    rt_report_free(rep);
    return 0;
}
