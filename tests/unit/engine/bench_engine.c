/* bench_engine: aggregate decode throughput of the engine at several concurrency levels.
 *
 *   bench_engine --model DIR [--concurrency 1,8,32,64] [--prompt-len 32] [--gen 64]
 *                [--threads N] [--repeat 3]
 *
 * For each concurrency C, C requests (random prompts of --prompt-len tokens, greedy, ignore_eos,
 * max_tokens --gen) are added at once and the engine is stepped until they finish. Only steps
 * that computed no prompt rows count as decode steps: decode tokens/s = tokens sampled in those
 * steps / their wall time. Prints one line per (C, repeat) and the best per C with its ratio to
 * the best C = 1 rate. Not a test: figures go to docs/benchmarks.md with the command line.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

static int drain(pd_engine *e)
{
    const pd_engine_event *ev;
    int finals = 0;
    while (pd_engine_next_event(e, &ev)) {
        if (ev->final) {
            if (ev->status < 0) {
                int st = ev->status;
                pd_engine_event_done(e);
                return pd_error(st, "request failed");
            }
            finals++;
        }
        pd_engine_event_done(e);
    }
    return finals;
}

/* One run at concurrency c: *tps receives decode tokens/s, *step_ms the mean decode step. */
static int run_once(pd_engine *e, int c, int prompt_len, int gen, int rep, double *tps,
                    double *step_ms, double *fwd_share)
{
    size_t vocab = pd_engine_vocab(e);
    int32_t *prompt = malloc((size_t)prompt_len * sizeof *prompt);
    if (!prompt) return pd_error(PD_ENOMEM, "out of memory");
    uint32_t s = 12345u + (uint32_t)rep;
    pd_sampling_params sp = pd_sampling_default_params();
    sp.temperature = 0.0;
    sp.ignore_eos = true;
    sp.max_tokens = gen;
    for (int i = 0; i < c; i++) {
        for (int k = 0; k < prompt_len; k++) {
            s = s * 1664525u + 1013904223u;
            prompt[k] = (int32_t)(3 + (s >> 8) % (vocab - 3));
        }
        char id[64];
        snprintf(id, sizeof id, "bench-%d-%d-%d", c, rep, i);
        pd_engine_request rq = {.request_id = id,
                                .prompt_ids = prompt,
                                .n_prompt = (size_t)prompt_len,
                                .sampling = &sp};
        int rc = pd_engine_add(e, &rq);
        if (rc < 0) {
            free(prompt);
            return rc;
        }
    }
    free(prompt);
    double t_dec = 0.0;
    uint64_t tok_dec = 0, steps_dec = 0, step_ns = 0, fwd_ns = 0;
    int finals = 0;
    while (finals < c) {
        pd_engine_stats a, b;
        pd_engine_get_stats(e, &a);
        double t0 = pd_now_s();
        PD_CHECK(pd_engine_step(e, NULL));
        double t1 = pd_now_s();
        pd_engine_get_stats(e, &b);
        if (b.prompt_tokens == a.prompt_tokens) {
            t_dec += t1 - t0;
            tok_dec += b.generation_tokens - a.generation_tokens;
            steps_dec++;
            step_ns += b.step_ns - a.step_ns;
            fwd_ns += b.forward_ns - a.forward_ns;
        }
        int f = drain(e);
        if (f < 0) return f;
        finals += f;
    }
    *tps = t_dec > 0 ? (double)tok_dec / t_dec : 0.0;
    *step_ms = steps_dec ? 1e3 * t_dec / (double)steps_dec : 0.0;
    *fwd_share = step_ns ? (double)fwd_ns / (double)step_ns : 0.0;
    return PD_OK;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *conc = "1,8,32,64";
    int prompt_len = 32, gen = 64, threads = 0, repeat = 3;
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"concurrency", required_argument, 0, 'c'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"gen", required_argument, 0, 'g'},
                                         {"threads", required_argument, 0, 't'},
                                         {"repeat", required_argument, 0, 'r'},
                                         {0, 0, 0, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (ch) {
        case 'm': model = optarg; break;
        case 'c': conc = optarg; break;
        case 'p': prompt_len = atoi(optarg); break;
        case 'g': gen = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'r': repeat = atoi(optarg); break;
        default: return 2;
        }
    }
    if (!model || prompt_len < 1 || gen < 2 || repeat < 1) {
        fprintf(stderr, "usage: bench_engine --model DIR [--concurrency 1,8,32,64] "
                        "[--prompt-len 32] [--gen 64] [--threads N] [--repeat 3]\n");
        return 2;
    }
    pd_log_init("bench");
    int cs[16], nc = 0, max_c = 1;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", conc);
    for (char *tok = strtok(buf, ","); tok && nc < 16; tok = strtok(NULL, ",")) {
        cs[nc] = atoi(tok);
        if (cs[nc] < 1) {
            fprintf(stderr, "bench_engine: bad concurrency '%s'\n", tok);
            return 2;
        }
        if (cs[nc] > max_c) max_c = cs[nc];
        nc++;
    }
    pd_engine_params p = pd_engine_default_params();
    p.model_dir = model;
    p.n_threads = threads;
    p.max_num_seqs = (size_t)max_c;
    p.max_model_len = (size_t)(prompt_len + gen + 16);
    p.max_num_batched_tokens = 2048;
    if (p.max_num_batched_tokens < p.max_model_len) p.max_num_batched_tokens = p.max_model_len;
    p.kv_cache_bytes = 0;
    p.num_kv_blocks = (size_t)max_c * ((p.max_model_len + 15) / 16) + 16;
    pd_engine *e;
    if (pd_engine_create(&p, &e) < 0) {
        fprintf(stderr, "bench_engine: %s\n", pd_last_error());
        return 1;
    }
    pd_log_set_level(PD_LOG_WARN);
    double base = 0.0;
    printf("model=%s prompt_len=%d gen=%d threads=%d\n", model, prompt_len, gen, threads);
    for (int i = 0; i < nc; i++) {
        double best = 0.0, worst = 1e300, best_ms = 0.0, best_fwd = 0.0;
        for (int r = 0; r < repeat; r++) {
            double tps = 0.0, ms = 0.0, fwd = 0.0;
            if (run_once(e, cs[i], prompt_len, gen, r, &tps, &ms, &fwd) < 0) {
                fprintf(stderr, "bench_engine: %s\n", pd_last_error());
                pd_engine_free(e);
                return 1;
            }
            printf(
                "  C=%-3d run %d: %9.1f decode tok/s, %7.2f ms/step, forward %.1f%% of the step\n",
                cs[i], r, tps, ms, 100.0 * fwd);
            if (tps > best) {
                best = tps;
                best_ms = ms;
                best_fwd = fwd;
            }
            if (tps < worst) worst = tps;
        }
        if (cs[i] == 1) base = best;
        printf("C=%-3d best %9.1f decode tok/s (spread %.1f%%), %7.2f ms/step, forward %.1f%%, "
               "%.2fx C=1\n",
               cs[i], best, best > 0 ? 100.0 * (best - worst) / best : 0.0, best_ms,
               100.0 * best_fwd, base > 0 ? best / base : 0.0);
    }
    pd_engine_free(e);
    return 0;
}
