/* Sampling time per token (not a test): pd_sample over fixed random logits for vocabularies
 * of 32000 (Llama-2) and 151936 (Qwen2), with the settings named on each line. Logits are
 * Gaussian with standard deviation sigma (sigma 2: a flat distribution where top-p keeps a
 * large share of the vocabulary; sigma 6: a peaked one, closer to a trained model's).
 * Times are thread CPU time per call (wall time in parentheses).
 * Usage: bench_sampler [iterations [vocab [sigma [setting substring]]]] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/rng.h"
#include "engine/sampler.h"
#include "util/clock.h"
#include "util/status.h"

static void fill(float *l, int32_t V, float sigma)
{
    for (int32_t i = 0; i < V; i++) {
        float f[4];
        pd_rng_uniform4f(12345, 0, (uint64_t)i, 9, f);
        /* Box-Muller from two uniforms */
        double r = sqrt(-2.0 * log(1.0 - (double)f[0])), th = 2.0 * M_PI * (double)f[1];
        l[i] = (float)(r * cos(th)) * sigma;
    }
}

/* CPU time of this thread: the machine is shared, so wall time would count other work. */
static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *only_name; /* run only settings whose name contains this */

static int run(int32_t V, float sigma, const char *name, pd_sampling_params p, int iters)
{
    if (only_name && !strstr(name, only_name)) return 0;
    float *l = malloc((size_t)V * sizeof *l);
    if (!l) return pd_error(PD_ENOMEM, "bench: out of memory");
    fill(l, V, sigma);
    pd_sampler_ws *ws = NULL;
    pd_sampler_seq *s = NULL;
    int rc = pd_sampler_ws_create(V, 20, &ws);
    if (rc == 0) rc = pd_sampler_seq_create(&p, V, NULL, 0, 0, NULL, 0, &s);
    pd_sample_result r;
    for (int i = 0; rc == 0 && i < iters / 10; i++) /* warm-up */
        rc = pd_sample(s, l, NULL, ws, &r);
    double t0 = pd_now_s(), c0 = cpu_s();
    for (int i = 0; rc == 0 && i < iters; i++) rc = pd_sample(s, l, NULL, ws, &r);
    double dt = pd_now_s() - t0, dc = cpu_s() - c0;
    if (rc == 0)
        printf("vocab %6d  sigma %.0f  %-36s %8.1f us/token cpu  (%8.1f wall)\n", V, (double)sigma,
               name, dc / iters * 1e6, dt / iters * 1e6);
    pd_sampler_seq_free(s);
    pd_sampler_ws_free(ws);
    free(l);
    return rc;
}

int main(int argc, char **argv)
{
    int iters = argc > 1 ? atoi(argv[1]) : 300;
    int32_t only_vocab = argc > 2 ? atoi(argv[2]) : 0;
    float only_sigma = argc > 3 ? (float)atof(argv[3]) : 0.0f;
    only_name = argc > 4 ? argv[4] : NULL;
    const int32_t vocabs[] = {32000, 151936};
    const float sigmas[] = {2.0f, 6.0f};
    for (int vi = 0; vi < 2; vi++) {
        for (int si = 0; si < 2; si++) {
            int32_t V = vocabs[vi];
            float sg = sigmas[si];
            if ((only_vocab && V != only_vocab) || (only_sigma > 0.0f && sg != only_sigma))
                continue;
            pd_sampling_params p = pd_sampling_default_params();
            p.temperature = 0.0;
            if (run(V, sg, "greedy", p, iters) < 0) goto fail;
            p.temperature = 1.0;
            if (run(V, sg, "temperature 1", p, iters) < 0) goto fail;
            p.top_p = 0.9;
            if (run(V, sg, "top_p 0.9", p, iters) < 0) goto fail;
            p.temperature = 0.7;
            if (run(V, sg, "temperature 0.7 top_p 0.9", p, iters) < 0) goto fail;
            p.temperature = 1.0;
            p.top_k = 50;
            if (run(V, sg, "top_k 50 top_p 0.9", p, iters) < 0) goto fail;
            p.top_k = 0;
            p.logprobs = 5;
            p.repetition_penalty = 1.1;
            p.frequency_penalty = 0.2;
            if (run(V, sg, "top_p 0.9 + penalties + logprobs 5", p, iters) < 0) goto fail;
        }
    }
    return 0;
fail:
    fprintf(stderr, "bench_sampler: %s\n", pd_last_error());
    return 1;
}
