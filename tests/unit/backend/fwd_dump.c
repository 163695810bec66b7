/* fwd_dump: runs the forward pass on a model directory and prints what tests compare against
 * tests/reference/llama_ref.py, plus a determinism self-check.
 *
 *   fwd_dump --model DIR --prompt-ids 1,2,3 [--steps N] [--chunk C] [--threads T]
 *            [--isa auto|scalar|avx512|avx512bf16] [--weight-dtype float32|bfloat16|float16]
 *            [--compute-dtype float32|bfloat16] [--all-logits]
 *   -> {"prompt_logits_last": [...], "greedy_tokens": [...], "all_logits": [[...], ...]}
 *   fwd_dump --model DIR --prompt-ids 1,2,3 --check-determinism [--steps N]
 *   -> exit 0 when the prompt's logits and greedy tokens are bit-identical run alone in one
 *      chunk, in chunks of 1, 3 and 7 rows, batched with two other sequences (prefill
 *      chunks and decode rows mixed), and batched through the plain ops instead of the
 *      backend's fused ones (pd_forward_params.no_fused); exit 1 naming the first difference.
 *
 * Design: the simplest block management there is (sequence s owns blocks
 * [s * per_seq, (s + 1) * per_seq)), kept out of the library on purpose: the engine's block
 * manager replaces it.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/forward.h"
#include "model/model.h"
#include "util/status.h"

#define BLOCK  16
#define MAXSEQ 3

typedef struct {
    pd_backend *b;
    pd_forward *f;
    pd_kv *kv;
    size_t V, per_seq;  /* blocks per sequence */
    int32_t *block_ids; /* (MAXSEQ * per_seq) */
} rt;

static int parse_ids(const char *s, int32_t **ids, size_t *n)
{
    size_t cap = 16, k = 0;
    int32_t *a = malloc(cap * sizeof *a);
    if (!a) return pd_error(PD_ENOMEM, "out of memory");
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v > INT32_MAX) {
            free(a);
            return pd_error(PD_EINVAL, "--prompt-ids: bad id at \"%s\"", s);
        }
        if (k == cap) {
            int32_t *na = realloc(a, (cap *= 2) * sizeof *a);
            if (!na) {
                free(a);
                return pd_error(PD_ENOMEM, "out of memory");
            }
            a = na;
        }
        a[k++] = (int32_t)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') {
            free(a);
            return pd_error(PD_EINVAL, "--prompt-ids: expected a comma at \"%s\"", end);
        }
    }
    if (k == 0) {
        free(a);
        return pd_error(PD_EINVAL, "--prompt-ids: empty");
    }
    *ids = a;
    *n = k;
    return PD_OK;
}

static int32_t argmax(const float *x, size_t n)
{
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return (int32_t)best;
}

/* One step for a set of sequences: seq s feeds rows toks[s][0..n[s]) at context len[s] (after
 * the step); logits of each sequence's last row (when n[s] > 0 and want[s]) go to out[s]. */
static int step(rt *r, size_t n_seqs, const int32_t *const *toks, const size_t *n,
                const int32_t *len, const int *want, float **out)
{
    int32_t ids[4096], qi[MAXSEQ + 1], kvl[MAXSEQ], bi[MAXSEQ + 1], orow[MAXSEQ];
    int32_t bl[MAXSEQ * 512];
    size_t rows = 0, n_out = 0, nb = 0;
    qi[0] = 0;
    bi[0] = 0;
    for (size_t s = 0; s < n_seqs; s++) {
        if (rows + n[s] > sizeof ids / sizeof ids[0] || nb + r->per_seq > sizeof bl / sizeof bl[0])
            return pd_error(PD_ERANGE, "fwd_dump: step too large");
        if (n[s]) memcpy(ids + rows, toks[s], n[s] * sizeof(int32_t));
        rows += n[s];
        if (n[s] && want[s]) orow[n_out++] = (int32_t)rows - 1;
        qi[s + 1] = (int32_t)rows;
        kvl[s] = len[s];
        memcpy(bl + nb, r->block_ids + s * r->per_seq, r->per_seq * sizeof(int32_t));
        nb += r->per_seq;
        bi[s + 1] = (int32_t)nb;
    }
    float *logits = malloc(n_out * r->V * sizeof(float) + 1);
    if (!logits) return pd_error(PD_ENOMEM, "out of memory");
    pd_step st = {.n_seqs = n_seqs,
                  .token_ids = ids,
                  .q_indptr = qi,
                  .kv_len = kvl,
                  .block_indptr = bi,
                  .block_ids = bl,
                  .n_out = n_out,
                  .out_rows = orow};
    int rc = pd_forward_run(r->f, r->kv, &st, logits);
    size_t k = 0;
    for (size_t s = 0; s < n_seqs && rc == 0; s++)
        if (n[s] && want[s]) memcpy(out[s], logits + (k++) * r->V, r->V * sizeof(float));
    free(logits);
    return rc;
}

static int rt_open(rt *r, const char *dir, int threads, pd_cpu_isa isa, int wdt, int cdt,
                   size_t max_len, int no_fused)
{
    memset(r, 0, sizeof *r);
    pd_model *m = NULL;
    PD_CHECK(pd_model_load(dir, &m));
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = threads;
    bp.cpu_isa = isa;
    bp.weight_dtype = wdt;
    bp.compute_dtype = cdt;
    int rc = pd_backend_cpu_create(&bp, &r->b);
    pd_forward_params fp = pd_forward_default_params();
    fp.max_tokens = 4096;
    fp.max_out = MAXSEQ;
    fp.no_fused = no_fused;
    if (rc == 0) rc = pd_forward_create(r->b, m, &fp, &r->f);
    pd_model_free(m);
    if (rc < 0) return rc;
    r->V = pd_forward_vocab(r->f);
    r->per_seq = (max_len + BLOCK - 1) / BLOCK;
    if (r->per_seq > 512) return pd_error(PD_ERANGE, "fwd_dump: sequence too long");
    pd_kv_params kp = pd_forward_kv_params(r->f, MAXSEQ * r->per_seq, BLOCK);
    PD_CHECK(pd_backend_get_ops(r->b)->kv_create(r->b, &kp, &r->kv));
    r->block_ids = malloc(MAXSEQ * r->per_seq * sizeof(int32_t));
    if (!r->block_ids) return pd_error(PD_ENOMEM, "out of memory");
    /* reversed ids, so block order differs from memory order */
    for (size_t i = 0; i < MAXSEQ * r->per_seq; i++)
        r->block_ids[i] = (int32_t)(MAXSEQ * r->per_seq - 1 - i);
    return PD_OK;
}

static void rt_close(rt *r)
{
    if (r->kv) pd_backend_get_ops(r->b)->kv_free(r->b, r->kv);
    pd_forward_free(r->f);
    pd_backend_free(r->b);
    free(r->block_ids);
}

/* Prefill ids[0..n) of sequence 0 in chunks of `chunk` rows (0: one chunk), then `steps`
 * greedy decode steps. last: logits after the prompt; all: every prompt row when non-NULL. */
static int run_single(rt *r, const int32_t *ids, size_t n, size_t chunk, size_t steps, float *last,
                      float *all, int32_t *greedy)
{
    if (chunk == 0) chunk = n;
    if (all) {
        /* every prompt position: one row at a time gives each row's logits */
        chunk = 1;
    }
    for (size_t p = 0; p < n; p += chunk) {
        size_t c = n - p < chunk ? n - p : chunk;
        const int32_t *t = ids + p;
        int32_t len = (int32_t)(p + c);
        int want = 1;
        float *out = all ? all + p * r->V : last;
        PD_CHECK(step(r, 1, &t, &c, &len, &want, &out));
    }
    if (all) memcpy(last, all + (n - 1) * r->V, r->V * sizeof(float));
    float *buf = malloc(r->V * sizeof(float));
    if (!buf) return pd_error(PD_ENOMEM, "out of memory");
    memcpy(buf, last, r->V * sizeof(float));
    int rc = 0;
    for (size_t s = 0; s < steps && rc == 0; s++) {
        greedy[s] = argmax(buf, r->V);
        if (s + 1 == steps) break;
        const int32_t *t = &greedy[s];
        size_t one = 1;
        int32_t len = (int32_t)(n + s + 1);
        int want = 1;
        rc = step(r, 1, &t, &one, &len, &want, &buf);
    }
    free(buf);
    return rc;
}

/* The prompt as sequence 1 of 3: sequence 0 prefills 11 other tokens in chunks of 5 and then
 * decodes; sequence 2 decodes after a 3-token prompt; the prompt itself goes in chunks of 4.
 * Returns the prompt's last logits and greedy tokens. */
static int run_batched(rt *r, const int32_t *ids, size_t n, size_t steps, float *last,
                       int32_t *greedy)
{
    int32_t other0[11], other2[3];
    for (int i = 0; i < 11; i++) other0[i] = (int32_t)((i * 37 + 5) % r->V);
    for (int i = 0; i < 3; i++) other2[i] = (int32_t)((i * 101 + 7) % r->V);
    float *o0 = malloc(r->V * 4), *o2 = malloc(r->V * 4), *o1 = malloc(r->V * 4);
    if (!o0 || !o1 || !o2) return pd_error(PD_ENOMEM, "out of memory");
    int32_t tok0 = 0, tok2 = 0;
    size_t p0 = 0, p1 = 0, p2 = 0, s1 = 0;
    int rc = 0;
    /* seq 2's prompt first, alone */
    {
        const int32_t *t[3] = {NULL, NULL, other2};
        size_t nn[3] = {0, 0, 3};
        int32_t len[3] = {0, 0, 3};
        int want[3] = {0, 0, 1};
        float *out[3] = {o0, o1, o2};
        rc = step(r, 3, t, nn, len, want, out);
        p2 = 3;
        tok2 = argmax(o2, r->V);
    }
    while (rc == 0 && s1 < steps) {
        const int32_t *t[3];
        size_t nn[3];
        int32_t len[3];
        int want[3] = {1, 1, 1};
        float *out[3] = {o0, o1, o2};
        /* seq 0: chunks of 5 of its prompt, then decode */
        if (p0 < 11) {
            nn[0] = 11 - p0 < 5 ? 11 - p0 : 5;
            t[0] = other0 + p0;
        } else {
            nn[0] = 1;
            t[0] = &tok0;
        }
        /* seq 1 (the prompt): chunks of 4, then decode its greedy tokens */
        int32_t g1 = s1 ? greedy[s1 - 1] : 0;
        if (p1 < n) {
            nn[1] = n - p1 < 4 ? n - p1 : 4;
            t[1] = ids + p1;
        } else {
            nn[1] = 1;
            t[1] = &g1;
        }
        nn[2] = 1;
        t[2] = &tok2;
        len[0] = (int32_t)(p0 + nn[0]);
        len[1] = (int32_t)(p1 + nn[1]);
        len[2] = (int32_t)(p2 + 1);
        if ((size_t)len[0] > r->per_seq * BLOCK) nn[0] = 0, len[0] = (int32_t)p0;
        if ((size_t)len[2] > r->per_seq * BLOCK) nn[2] = 0, len[2] = (int32_t)p2;
        rc = step(r, 3, t, nn, len, want, out);
        if (rc) break;
        p0 = (size_t)len[0];
        p2 = (size_t)len[2];
        if (nn[0] && p0 >= 11) tok0 = argmax(o0, r->V);
        if (nn[2]) tok2 = argmax(o2, r->V);
        p1 += nn[1];
        if (p1 >= n) {
            if (s1 == 0) memcpy(last, o1, r->V * 4);
            greedy[s1++] = argmax(o1, r->V);
        }
    }
    free(o0), free(o1), free(o2);
    return rc;
}

static void print_floats(FILE *o, const float *x, size_t n)
{
    fputc('[', o);
    for (size_t i = 0; i < n; i++) fprintf(o, i ? ",%.9g" : "%.9g", (double)x[i]);
    fputc(']', o);
}

/* An optional dtype flag: -1 when absent (the backend's choice), else its pd_dtype. */
static int dtype_opt(const char *s, int *out)
{
    pd_dtype d;
    *out = -1;
    if (s) PD_CHECK(pd_dtype_parse(s, &d));
    if (s) *out = (int)d;
    return PD_OK;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *ids_s = NULL, *isa_s = "auto", *wdt_s = NULL, *cdt_s = NULL;
    size_t steps = 0, chunk = 0;
    int threads = 0, all_logits = 0, check = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--all-logits"))
            all_logits = 1;
        else if (!strcmp(a, "--check-determinism"))
            check = 1;
        else if (!v) {
            fprintf(stderr, "fwd_dump: %s needs a value (or is unknown)\n", a);
            return 2;
        } else {
            i++;
            if (!strcmp(a, "--model"))
                model = v;
            else if (!strcmp(a, "--prompt-ids"))
                ids_s = v;
            else if (!strcmp(a, "--steps"))
                steps = (size_t)atol(v);
            else if (!strcmp(a, "--chunk"))
                chunk = (size_t)atol(v);
            else if (!strcmp(a, "--threads"))
                threads = atoi(v);
            else if (!strcmp(a, "--isa"))
                isa_s = v;
            else if (!strcmp(a, "--weight-dtype"))
                wdt_s = v;
            else if (!strcmp(a, "--compute-dtype"))
                cdt_s = v;
            else {
                fprintf(stderr, "fwd_dump: unknown option %s\n", a);
                return 2;
            }
        }
    }
    if (!model || !ids_s) {
        fprintf(stderr, "usage: fwd_dump --model DIR --prompt-ids 1,2,3 [--steps N] ...\n");
        return 2;
    }
    pd_cpu_isa isa;
    int wdt, cdt;
    if (pd_cpu_isa_parse(isa_s, &isa) < 0 || dtype_opt(wdt_s, &wdt) < 0 ||
        dtype_opt(cdt_s, &cdt) < 0) {
        fprintf(stderr, "fwd_dump: %s\n", pd_last_error());
        return 2;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    rt r;
    int rc = parse_ids(ids_s, &ids, &n);
    if (rc == 0) rc = rt_open(&r, model, threads, isa, wdt, cdt, n + steps + 16, 0);
    if (rc < 0) {
        fprintf(stderr, "fwd_dump: %s\n", pd_last_error());
        free(ids);
        return 1;
    }
    size_t V = r.V;
    float *last = malloc(V * 4), *all = all_logits ? malloc(n * V * 4) : NULL;
    int32_t *greedy = calloc(steps + 1, sizeof(int32_t));
    int status = 0;
    if (check) {
        float *ref_last = malloc(V * 4);
        int32_t *ref_g = calloc(steps + 1, sizeof(int32_t));
        rc = run_single(&r, ids, n, 0, steps, ref_last, NULL, ref_g);
        static const size_t chunks[] = {1, 3, 7};
        for (size_t c = 0; c < 3 && rc == 0 && !status; c++) {
            rt_close(&r);
            rc = rt_open(&r, model, threads, isa, wdt, cdt, n + steps + 16, 0);
            if (rc == 0) rc = run_single(&r, ids, n, chunks[c], steps, last, NULL, greedy);
            if (rc == 0 && (memcmp(last, ref_last, V * 4) || memcmp(greedy, ref_g, steps * 4))) {
                fprintf(stderr, "fwd_dump: chunks of %zu differ from one chunk\n", chunks[c]);
                status = 1;
            }
        }
        if (rc == 0 && !status) {
            rt_close(&r);
            rc = rt_open(&r, model, threads, isa, wdt, cdt, n + steps + 16, 0);
            if (rc == 0) rc = run_batched(&r, ids, n, steps, last, greedy);
            if (rc == 0 && memcmp(last, ref_last, V * 4)) {
                fprintf(stderr, "fwd_dump: prompt logits differ when batched with others\n");
                status = 1;
            }
            if (rc == 0 && memcmp(greedy, ref_g, steps * 4)) {
                fprintf(stderr, "fwd_dump: greedy tokens differ when batched with others\n");
                status = 1;
            }
        }
        if (rc == 0 && !status) { /* the plain ops instead of the backend's fused ones */
            rt_close(&r);
            rc = rt_open(&r, model, threads, isa, wdt, cdt, n + steps + 16, 1);
            if (rc == 0) rc = run_batched(&r, ids, n, steps, last, greedy);
            if (rc == 0 && (memcmp(last, ref_last, V * 4) || memcmp(greedy, ref_g, steps * 4))) {
                fprintf(stderr, "fwd_dump: the plain ops differ from the fused ones\n");
                status = 1;
            }
        }
        if (rc == 0 && !status)
            printf("determinism ok: %zu prompt tokens, %zu steps, chunks 1/3/7, batched, plain "
                   "ops\n",
                   n, steps);
        free(ref_last);
        free(ref_g);
    } else {
        rc = run_single(&r, ids, n, chunk, steps, last, all, greedy);
        if (rc == 0) {
            printf("{\"prompt_logits_last\":");
            print_floats(stdout, last, V);
            printf(",\"greedy_tokens\":[");
            for (size_t s = 0; s < steps; s++) printf(s ? ",%d" : "%d", greedy[s]);
            printf("]");
            if (all) {
                printf(",\"all_logits\":[");
                for (size_t p = 0; p < n; p++) {
                    if (p) putchar(',');
                    print_floats(stdout, all + p * V, V);
                }
                printf("]");
            }
            printf("}\n");
        }
    }
    if (rc < 0) {
        fprintf(stderr, "fwd_dump: %s\n", pd_last_error());
        status = 1;
    }
    rt_close(&r);
    free(ids), free(last), free(all), free(greedy);
    return status;
}
