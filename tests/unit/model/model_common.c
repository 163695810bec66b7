/* Helpers of the common/model unit tests (declared in model_common.h): paths in the test's
 * temporary directory, whole-file writes and reads. */
#include "model_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *tmp_path(const char *name)
{
    static char buf[8][4096];
    static int k;
    char *b = buf[k++ % 8];
    snprintf(b, sizeof buf[0], "%s/%s", pdt_tmp_dir(), name);
    return b;
}

int write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    fclose(f);
    return w == n ? 0 : -1;
}

int write_text(const char *path, const char *text)
{
    return write_file(path, text, strlen(text));
}

char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[sz] = '\0';
        *n = (size_t)sz;
    }
    return b;
}
