/* pd-scheduler: the api-server executable. Argument parsing and wiring only; the logic is in
 * the pdsched library (apiserver.h). */
#include <malloc.h>
#include <stdio.h>

#include "apiserver.h"
#include "util/flags.h"
#include "util/log.h"
#include "util/status.h"

int main(int argc, char **argv)
{
    pd_log_init("scheduler");
    /* Blocks of 1 MiB or more (request bodies, their parsed strings, rendered prompts) come from
     * mmap and go back to the system when freed; glibc's default threshold rises with the
     * largest block freed (to 32 MiB), after which such blocks stay in the heap. */
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    pd_flags_early_log_level(argc, argv);
    pd_apiserver_params p = pd_apiserver_default_params();
    bool help = false;
    if (pd_apiserver_parse_args(argc, argv, &p, &help) < 0) {
        fprintf(stderr, "pd-scheduler: %s\n", pd_last_error());
        return 2;
    }
    if (help) {
        pd_apiserver_usage(stdout);
        return 0;
    }
    if (p.log_level) {
        pd_log_level lv;
        if (pd_log_parse_level(p.log_level, &lv) < 0) {
            fprintf(stderr, "pd-scheduler: --log-level: '%s' is not debug, info, warn or error\n",
                    p.log_level);
            return 2;
        }
        pd_log_set_level(lv);
    }
    pd_apiserver *s = NULL;
    if (pd_apiserver_create(&p, &s) < 0) {
        PD_ERROR(NULL, "start-up failed: %s", pd_last_error());
        return 1;
    }
    int rc = pd_apiserver_run(s, true);
    pd_apiserver_free(s);
    PD_INFO(NULL, "stopped");
    return rc < 0 ? 1 : 0;
}
