/* Regression tests for tokenizer.json inputs found by tests/fuzz/fuzz_tokenizer (docs/fuzzing.md).
 *
 * Each case is the crashing input (minimised where it stayed a crash) written to a file and
 * loaded with pd_tok_load_files, then checked for the defined outcome. The crashes read an
 * uninitialised pointer, so the stack is filled with a non-zero pattern first: without the fix
 * the stale value is then garbage rather than whatever an earlier call happened to leave.
 */
#include "harness.h"

#include <stdlib.h>

#include "tokenizer/tokenizer.h"
#include "util/status.h"

__attribute__((noinline)) static void dirty_stack(void)
{
    volatile unsigned char buf[256 * 1024];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = 0x5a;
}

/* Writes text to a file in the test's temporary directory; the path stays valid until the
 * next call. */
static const char *write_tmp(const char *name, const char *text)
{
    static char path[1024];
    snprintf(path, sizeof path, "%s/%s", pdt_tmp_dir(), name);
    FILE *f = fopen(path, "wb");
    if (!f) return NULL;
    fputs(text, f);
    fclose(f);
    return path;
}

static int load(const char *text, pd_tok **out)
{
    const char *path = write_tmp("tokenizer.json", text);
    if (!path) return PD_EIO;
    dirty_stack();
    return pd_tok_load_files(path, NULL, out);
}

/* Fuzzer finding 1: a BPE model without "merges" read json_t *merges uninitialised
 * (SEGV in json_array_size from load_merges). Absent merges now mean no merges. */
TEST(bpe_without_merges_loads)
{
    pd_tok *t = NULL;
    ASSERT_OK(load("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
                   "\"merges))))\":[\"a c\"]}}",
                   &t));
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(pd_tok_encode(t, "ab", 2, false, &ids, &n));
    ASSERT_EQ_INT(n, 2);
    ASSERT_EQ_INT(ids[0], 0);
    ASSERT_EQ_INT(ids[1], 1);
    free(ids);
    pd_tok_free(t);
}

/* Fuzzer finding 2: a TemplateProcessing post-processor without "special_tokens" read
 * json_t *specials uninitialised. The special token's own id is used then. */
TEST(template_processing_without_special_tokens)
{
    pd_tok *t = NULL;
    ASSERT_OK(load("{\"added_tokens\":[{\"id\":2,\"content\":\"<s>\",\"special\":true}],"
                   "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"<s>\":2},"
                   "\"merges\":[]},"
                   "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":["
                   "{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
                   "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}]}}",
                   &t));
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(pd_tok_encode(t, "ab", 2, true, &ids, &n));
    ASSERT_EQ_INT(n, 3);
    ASSERT_EQ_INT(ids[0], 2);
    ASSERT_EQ_INT(ids[1], 0);
    ASSERT_EQ_INT(ids[2], 1);
    free(ids);
    pd_tok_free(t);
}
