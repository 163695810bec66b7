/* Unit tests: sampling parameters (defaults, generation_config, validation messages of
 * docs/api.md §8.1) and pd_sample (greedy, temperature frequencies against the softmax,
 * top-k / top-p / min-p kept sets, penalties, logit_bias, allowed_token_ids, min_tokens,
 * determinism, logprobs). Exact processed-logit values are observed through greedy ties:
 * equal logits go to the lower id, so a probe logit one ulp above or at the expected value
 * tells the exact result. */
#include "harness.h"

#include <stdlib.h>

#include "engine/rng.h"
#include "engine/sampler.h"

/* ---- helpers ------------------------------------------------------------------------------- */

/* One greedy/random draw from a fresh sequence with the given history. */
static int draw_once(const pd_sampling_params *p, int32_t V, const int32_t *eos, size_t n_eos,
                     const int32_t *prompt, size_t n_prompt, const int32_t *outs, size_t n_outs,
                     const float *logits, int32_t *token)
{
    pd_sampler_seq *s = NULL;
    pd_sampler_ws *ws = NULL;
    int rc = pd_sampler_seq_create(p, V, eos, n_eos, 0, prompt, n_prompt, &s);
    if (rc == 0) rc = pd_sampler_ws_create(V, 20, &ws);
    for (size_t i = 0; rc == 0 && i < n_outs; i++) rc = pd_sampler_seq_append(s, outs[i]);
    pd_sample_result r;
    if (rc == 0) rc = pd_sample(s, logits, NULL, ws, &r);
    if (rc == 0) *token = r.token;
    pd_sampler_seq_free(s);
    pd_sampler_ws_free(ws);
    return rc;
}

/* Draws n tokens from one sequence (steps 0..n-1) over fixed logits; counts[V] += hits. */
static int draw_many(const pd_sampling_params *p, int32_t V, const float *logits, int n,
                     long *counts)
{
    pd_sampler_seq *s = NULL;
    pd_sampler_ws *ws = NULL;
    int rc = pd_sampler_seq_create(p, V, NULL, 0, 0, NULL, 0, &s);
    if (rc == 0) rc = pd_sampler_ws_create(V, 0, &ws);
    for (int i = 0; rc == 0 && i < n; i++) {
        pd_sample_result r;
        rc = pd_sample(s, logits, NULL, ws, &r);
        if (rc == 0) counts[r.token]++;
    }
    pd_sampler_seq_free(s);
    pd_sampler_ws_free(ws);
    return rc;
}

static void softmax(const float *l, int32_t V, double T, double *p)
{
    double mx = -INFINITY, sum = 0.0;
    for (int32_t i = 0; i < V; i++) mx = l[i] > mx ? l[i] : mx;
    for (int32_t i = 0; i < V; i++) sum += (p[i] = exp((l[i] - mx) / T));
    for (int32_t i = 0; i < V; i++) p[i] /= sum;
}

/* Logits whose softmax (T = 1) is exactly proportional to probs. */
static void logits_from_probs(const double *probs, int32_t V, float *l)
{
    for (int32_t i = 0; i < V; i++) l[i] = (float)log(probs[i]);
}

/* The set of tokens seen in n draws, as a bitmask (V <= 32). */
static int support(const pd_sampling_params *p, int32_t V, const float *l, int n, uint32_t *mask)
{
    long counts[32] = {0};
    int rc = draw_many(p, V, l, n, counts);
    *mask = 0;
    for (int32_t i = 0; i < V; i++)
        if (counts[i]) *mask |= 1u << i;
    return rc;
}

/* ---- parameters ---------------------------------------------------------------------------- */

TEST(sampling_defaults)
{
    pd_sampling_params p = pd_sampling_default_params();
    ASSERT_EQ_INT(p.n, 1);
    ASSERT(p.temperature == 1.0 && p.top_p == 1.0 && p.min_p == 0.0);
    ASSERT_EQ_INT(p.top_k, 0);
    ASSERT(p.presence_penalty == 0.0 && p.frequency_penalty == 0.0);
    ASSERT(p.repetition_penalty == 1.0);
    ASSERT(!p.has_seed && !p.has_allowed_token_ids && !p.ignore_eos);
    ASSERT_EQ_INT(p.logprobs, -1);
    ASSERT_EQ_INT(p.prompt_logprobs, -1);
    ASSERT_EQ_INT(p.max_tokens, -1);
    ASSERT_EQ_INT(p.min_tokens, 0);
    ASSERT(p.skip_special_tokens && !p.include_stop_str_in_output);
    ASSERT(!pd_sampling_is_greedy(&p));
    p.temperature = 0.0;
    ASSERT(pd_sampling_is_greedy(&p));
    p.temperature = 0.99e-5;
    ASSERT(pd_sampling_is_greedy(&p));
    p.temperature = 1e-5;
    ASSERT(!pd_sampling_is_greedy(&p));
    ASSERT_OK(pd_sampling_params_validate(&p, 10));
}

TEST(sampling_generation_config_rules)
{
    pd_generation_config g = pd_generation_config_default();
    pd_sampling_params p = pd_sampling_model_params(&g);
    ASSERT(p.temperature == 1.0 && p.top_p == 1.0 && p.top_k == 0);
    /* HF defaults are not overrides: top_k 50, temperature/top_p/repetition 1.0 */
    g.has_top_k = true;
    g.top_k = 50;
    g.has_temperature = true;
    g.temperature = 1.0;
    g.has_top_p = true;
    g.top_p = 1.0;
    g.has_repetition_penalty = true;
    g.repetition_penalty = 1.0;
    g.has_min_p = true;
    g.min_p = 0.0;
    p = pd_sampling_model_params(&g);
    ASSERT(p.temperature == 1.0 && p.top_p == 1.0 && p.top_k == 0 && p.repetition_penalty == 1.0 &&
           p.min_p == 0.0);
    g.top_k = 20;
    g.temperature = 0.6;
    g.top_p = 0.9;
    g.repetition_penalty = 1.1;
    g.min_p = 0.05;
    p = pd_sampling_model_params(&g);
    ASSERT(p.temperature == 0.6 && p.top_p == 0.9 && p.top_k == 20 && p.repetition_penalty == 1.1 &&
           p.min_p == 0.05);
    p = pd_sampling_model_params(NULL);
    ASSERT(p.temperature == 1.0);
}

#define EXPECT_INVALID(p, vocab, msg)                                                              \
    do {                                                                                           \
        ASSERT_EQ_INT(pd_sampling_params_validate(&(p), (vocab)), PD_EINVAL);                      \
        ASSERT_STR_EQ(pd_last_error(), (msg));                                                     \
    } while (0)

TEST(sampling_validation_messages)
{
    pd_sampling_params p;
    p = pd_sampling_default_params();
    p.n = 0;
    EXPECT_INVALID(p, 100, "n must be at least 1, got 0.");
    p = pd_sampling_default_params();
    p.presence_penalty = 2.5;
    EXPECT_INVALID(p, 100, "presence_penalty must be in [-2, 2], got 2.5.");
    p = pd_sampling_default_params();
    p.frequency_penalty = -3.0;
    EXPECT_INVALID(p, 100, "frequency_penalty must be in [-2, 2], got -3.0.");
    p = pd_sampling_default_params();
    p.repetition_penalty = 0.0;
    EXPECT_INVALID(p, 100, "repetition_penalty must be greater than zero, got 0.0.");
    p = pd_sampling_default_params();
    p.temperature = -0.1;
    EXPECT_INVALID(p, 100, "temperature must be non-negative, got -0.1.");
    p = pd_sampling_default_params();
    p.temperature = NAN;
    EXPECT_INVALID(p, 100, "temperature must be non-negative, got nan.");
    p = pd_sampling_default_params();
    p.top_p = 0.0;
    EXPECT_INVALID(p, 100, "top_p must be in (0, 1], got 0.0.");
    p.top_p = 1.5;
    EXPECT_INVALID(p, 100, "top_p must be in (0, 1], got 1.5.");
    p.top_p = 1.0000001;
    EXPECT_INVALID(p, 100, "top_p must be in (0, 1], got 1.0000001.");
    p = pd_sampling_default_params();
    p.top_k = -2;
    EXPECT_INVALID(p, 100, "top_k must be 0 (disable), or at least 1, got -2.");
    p = pd_sampling_default_params();
    p.min_p = -1e-05;
    EXPECT_INVALID(p, 100, "min_p must be in [0, 1], got -1e-05.");
    p.min_p = 1e20;
    EXPECT_INVALID(p, 100, "min_p must be in [0, 1], got 1e+20.");
    p.min_p = 123456.5;
    EXPECT_INVALID(p, 100, "min_p must be in [0, 1], got 123456.5.");
    p = pd_sampling_default_params();
    p.max_tokens = 0;
    EXPECT_INVALID(p, 100, "max_tokens must be at least 1, got 0.");
    p = pd_sampling_default_params();
    p.min_tokens = -1;
    EXPECT_INVALID(p, 100, "min_tokens must be greater than or equal to 0, got -1.");
    p = pd_sampling_default_params();
    const char *stops[] = {"ok", ""};
    p.stop = stops;
    p.n_stop = 2;
    EXPECT_INVALID(p, 100, "stop cannot contain an empty string.");
    p = pd_sampling_default_params();
    int32_t sids[] = {3, 100};
    p.stop_token_ids = sids;
    p.n_stop_token_ids = 2;
    EXPECT_INVALID(p, 100, "Token id 100 in stop_token_ids is out of vocabulary.");
    p = pd_sampling_default_params();
    pd_logit_bias lb[] = {{128300, 1.0f}, {5, 2.0f}, {999999, -1.0f}};
    p.logit_bias = lb;
    p.n_logit_bias = 3;
    EXPECT_INVALID(p, 128256,
                   "token_id(s) [128300, 999999] in logit_bias contain out-of-vocab token ids. "
                   "Vocabulary size: 128256");
    p = pd_sampling_default_params();
    p.has_allowed_token_ids = true;
    p.n_allowed_token_ids = 0;
    EXPECT_INVALID(p, 100, "allowed_token_ids is not allowed to be empty.");
    int32_t al[] = {1, -1};
    p.allowed_token_ids = al;
    p.n_allowed_token_ids = 2;
    EXPECT_INVALID(p, 100, "allowed_token_ids contains out-of-vocab token id!");
    /* edges that are valid */
    p = pd_sampling_default_params();
    p.top_k = -1;
    p.presence_penalty = -2.0;
    p.frequency_penalty = 2.0;
    p.min_p = 1.0;
    p.top_p = 1.0;
    p.temperature = 0.0;
    ASSERT_OK(pd_sampling_params_validate(&p, 100));
    /* create validates too */
    p.top_k = -5;
    pd_sampler_seq *s = NULL;
    ASSERT_ERR(pd_sampler_seq_create(&p, 100, NULL, 0, 0, NULL, 0, &s), PD_EINVAL, "top_k must");
    ASSERT(s == NULL);
}

TEST(sampling_params_clone)
{
    pd_arena *a = pd_arena_create(0);
    ASSERT(a);
    pd_sampling_params p = pd_sampling_default_params(), c;
    char stop0[] = "END";
    const char *stops[] = {stop0};
    int32_t ids[] = {4, 5};
    pd_logit_bias lb[] = {{1, 2.0f}};
    p.stop = stops;
    p.n_stop = 1;
    p.stop_token_ids = ids;
    p.n_stop_token_ids = 2;
    p.allowed_token_ids = ids;
    p.n_allowed_token_ids = 2;
    p.has_allowed_token_ids = true;
    p.logit_bias = lb;
    p.n_logit_bias = 1;
    ASSERT_OK(pd_sampling_params_clone(&p, a, &c));
    stop0[0] = 'X';
    ids[0] = 9;
    lb[0].id = 7;
    ASSERT_STR_EQ(c.stop[0], "END");
    ASSERT_EQ_INT(c.stop_token_ids[0], 4);
    ASSERT_EQ_INT(c.allowed_token_ids[0], 4);
    ASSERT_EQ_INT(c.logit_bias[0].id, 1);
    ASSERT(c.has_allowed_token_ids);
    pd_arena_free(a);
}

/* ---- greedy and penalties ------------------------------------------------------------------ */

TEST(greedy_argmax_and_ties)
{
    pd_sampling_params p = pd_sampling_default_params();
    p.temperature = 0.0;
    p.top_k = 1; /* ignored under greedy, as are top_p and min_p */
    p.top_p = 0.1;
    p.min_p = 0.9;
    float l[6] = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f, NAN};
    int32_t t = -1;
    ASSERT_OK(draw_once(&p, 6, NULL, 0, NULL, 0, NULL, 0, l, &t));
    ASSERT_EQ_INT(t, 1); /* tie between 1 and 3 -> lowest id */
    l[3] = nextafterf(3.0f, 4.0f);
    ASSERT_OK(draw_once(&p, 6, NULL, 0, NULL, 0, NULL, 0, l, &t));
    ASSERT_EQ_INT(t, 3);
    float all_masked[3] = {-INFINITY, NAN, -INFINITY};
    ASSERT_ERR(draw_once(&p, 3, NULL, 0, NULL, 0, NULL, 0, all_masked, &t), PD_EINVAL,
               "every logit is masked");
    p.temperature = 1.0;
    ASSERT_ERR(draw_once(&p, 3, NULL, 0, NULL, 0, NULL, 0, all_masked, &t), PD_EINVAL,
               "every logit is masked");
}

/* Greedy pick between token 0 (the probed logit after processing) and token 1 (= probe):
 * returns 0 when processed(l0) >= probe. */
static int probe(pd_sampling_params *p, float l0, float probe_value, const int32_t *prompt,
                 size_t n_prompt, const int32_t *outs, size_t n_outs, int32_t *t)
{
    float l[4] = {l0, probe_value, -50.0f, -50.0f};
    p->temperature = 0.0;
    return draw_once(p, 4, NULL, 0, prompt, n_prompt, outs, n_outs, l, t);
}

TEST(repetition_penalty_exact)
{
    pd_sampling_params p = pd_sampling_default_params();
    p.repetition_penalty = 2.0;
    int32_t prompt[] = {0, 2};
    int32_t t;
    /* positive logit divided: 3.0 -> 1.5 (in the prompt) */
    ASSERT_OK(probe(&p, 3.0f, 1.5f, prompt, 2, NULL, 0, &t));
    ASSERT_EQ_INT(t, 0);
    ASSERT_OK(probe(&p, 3.0f, nextafterf(1.5f, 2.0f), prompt, 2, NULL, 0, &t));
    ASSERT_EQ_INT(t, 1);
    /* negative logit multiplied: -1.0 -> -2.0 */
    ASSERT_OK(probe(&p, -1.0f, -2.0f, prompt, 2, NULL, 0, &t));
    ASSERT_EQ_INT(t, 0);
    ASSERT_OK(probe(&p, -1.0f, nextafterf(-2.0f, 0.0f), prompt, 2, NULL, 0, &t));
    ASSERT_EQ_INT(t, 1);
    /* from the output too, once, whatever the count: 3.0 -> 1.5 */
    int32_t outs[] = {0, 0, 0};
    ASSERT_OK(probe(&p, 3.0f, nextafterf(1.5f, 2.0f), NULL, 0, outs, 3, &t));
    ASSERT_EQ_INT(t, 1);
    ASSERT_OK(probe(&p, 3.0f, 1.5f, NULL, 0, outs, 3, &t));
    ASSERT_EQ_INT(t, 0);
    /* not seen: unchanged */
    int32_t other[] = {3};
    ASSERT_OK(probe(&p, 3.0f, nextafterf(3.0f, 0.0f), other, 1, other, 1, &t));
    ASSERT_EQ_INT(t, 0);
}

TEST(frequency_presence_penalties_exact)
{
    pd_sampling_params p = pd_sampling_default_params();
    p.frequency_penalty = 0.5;
    p.presence_penalty = 0.25;
    int32_t t;
    int32_t outs[] = {0, 2, 0, 0};
    /* 3.0 - 0.5 * 3 - 0.25 = 1.25 */
    ASSERT_OK(probe(&p, 3.0f, 1.25f, NULL, 0, outs, 4, &t));
    ASSERT_EQ_INT(t, 0);
    ASSERT_OK(probe(&p, 3.0f, nextafterf(1.25f, 2.0f), NULL, 0, outs, 4, &t));
    ASSERT_EQ_INT(t, 1);
    /* prompt occurrences do not count for frequency/presence */
    int32_t prompt[] = {0, 0, 0};
    ASSERT_OK(probe(&p, 3.0f, 3.0f, prompt, 3, NULL, 0, &t));
    ASSERT_EQ_INT(t, 0);
    /* negative penalties raise the logit: 1 - (-1 * 2) - (-0.5) = 3.5 */
    p.frequency_penalty = -1.0;
    p.presence_penalty = -0.5;
    int32_t two[] = {0, 0};
    ASSERT_OK(probe(&p, 1.0f, 3.5f, NULL, 0, two, 2, &t));
    ASSERT_EQ_INT(t, 0);
    ASSERT_OK(probe(&p, 1.0f, nextafterf(3.5f, 4.0f), NULL, 0, two, 2, &t));
    ASSERT_EQ_INT(t, 1);
}

TEST(pipeline_order_bias_then_penalties)
{
    /* logit_bias first, then repetition, then frequency/presence:
     * (1.0 + 3.0) / 2 - 0.5 * 1 - 0.25 = 1.25 (any other order gives another value) */
    pd_sampling_params p = pd_sampling_default_params();
    pd_logit_bias lb[] = {{0, 3.0f}};
    p.logit_bias = lb;
    p.n_logit_bias = 1;
    p.repetition_penalty = 2.0;
    p.frequency_penalty = 0.5;
    p.presence_penalty = 0.25;
    int32_t outs[] = {0};
    int32_t t;
    ASSERT_OK(probe(&p, 1.0f, 1.25f, NULL, 0, outs, 1, &t));
    ASSERT_EQ_INT(t, 0);
    ASSERT_OK(probe(&p, 1.0f, nextafterf(1.25f, 2.0f), NULL, 0, outs, 1, &t));
    ASSERT_EQ_INT(t, 1);
}

TEST(logit_bias_clamp_and_duplicates)
{
    pd_sampling_params p = pd_sampling_default_params();
    int32_t t;
    /* 1000 is clamped to 100: 0 + 100 < 100.5 */
    pd_logit_bias big[] = {{0, 1000.0f}};
    p.logit_bias = big;
    p.n_logit_bias = 1;
    ASSERT_OK(probe(&p, 0.0f, 100.5f, NULL, 0, NULL, 0, &t));
    ASSERT_EQ_INT(t, 1);
    ASSERT_OK(probe(&p, 0.0f, 100.0f, NULL, 0, NULL, 0, &t));
    ASSERT_EQ_INT(t, 0);
    /* -1000 -> -100 */
    pd_logit_bias neg[] = {{0, -1000.0f}};
    p.logit_bias = neg;
    ASSERT_OK(probe(&p, 50.0f, nextafterf(-50.0f, 0.0f), NULL, 0, NULL, 0, &t));
    ASSERT_EQ_INT(t, 1);
    ASSERT_OK(probe(&p, 50.0f, -50.0f, NULL, 0, NULL, 0, &t));
    ASSERT_EQ_INT(t, 0);
    /* the same id twice: the last value wins (not the sum) */
    pd_logit_bias dup[] = {{0, 5.0f}, {1, 0.0f}, {0, 2.0f}};
    p.logit_bias = dup;
    p.n_logit_bias = 3;
    ASSERT_OK(probe(&p, 1.0f, 3.0f, NULL, 0, NULL, 0, &t));
    ASSERT_EQ_INT(t, 0);
    ASSERT_OK(probe(&p, 1.0f, nextafterf(3.0f, 4.0f), NULL, 0, NULL, 0, &t));
    ASSERT_EQ_INT(t, 1);
}

TEST(allowed_token_ids_mask)
{
    pd_sampling_params p = pd_sampling_default_params();
    int32_t allowed[] = {4, 2, 4};
    p.has_allowed_token_ids = true;
    p.allowed_token_ids = allowed;
    p.n_allowed_token_ids = 3;
    float l[6] = {9.0f, 8.0f, 1.0f, 7.0f, 0.5f, 6.0f};
    p.temperature = 0.0;
    int32_t t;
    ASSERT_OK(draw_once(&p, 6, NULL, 0, NULL, 0, NULL, 0, l, &t));
    ASSERT_EQ_INT(t, 2);
    p.temperature = 1.0;
    uint32_t mask;
    ASSERT_OK(support(&p, 6, l, 4000, &mask));
    ASSERT_EQ_INT(mask, (1u << 2) | (1u << 4));
}

TEST(min_tokens_masks_eos_and_stop_ids)
{
    pd_sampling_params p = pd_sampling_default_params();
    p.temperature = 0.0;
    p.min_tokens = 2;
    int32_t stop_ids[] = {3};
    p.stop_token_ids = stop_ids;
    p.n_stop_token_ids = 1;
    p.ignore_eos = true; /* EOS is masked by min_tokens even with ignore_eos (vLLM) */
    int32_t eos[] = {1, 4};
    float l[6] = {0.0f, 9.0f, 1.0f, 8.0f, 7.0f, 2.0f};
    pd_sampler_seq *s = NULL;
    pd_sampler_ws *ws = NULL;
    ASSERT_OK(pd_sampler_seq_create(&p, 6, eos, 2, 0, NULL, 0, &s));
    ASSERT_OK(pd_sampler_ws_create(6, 0, &ws));
    pd_sample_result r;
    ASSERT_OK(pd_sample(s, l, NULL, ws, &r));
    ASSERT_EQ_INT(r.token, 5); /* 1, 3, 4 masked at step 0 */
    ASSERT_OK(pd_sample(s, l, NULL, ws, &r));
    ASSERT_EQ_INT(r.token, 5); /* and at step 1 */
    ASSERT_EQ_INT(pd_sampler_seq_num_output(s), 2);
    ASSERT_OK(pd_sample(s, l, NULL, ws, &r));
    ASSERT_EQ_INT(r.token, 1); /* 2 tokens exist: EOS allowed again */
    pd_sampler_seq_free(s);
    /* min_tokens with everything else masked: a clear error, not a crash */
    int32_t only[] = {1};
    p.has_allowed_token_ids = true;
    p.allowed_token_ids = only;
    p.n_allowed_token_ids = 1;
    ASSERT_OK(pd_sampler_seq_create(&p, 6, eos, 2, 0, NULL, 0, &s));
    ASSERT_ERR(pd_sample(s, l, NULL, ws, &r), PD_EINVAL, "every logit is masked");
    pd_sampler_seq_free(s);
    pd_sampler_ws_free(ws);
}

/* ---- random sampling ----------------------------------------------------------------------- */

TEST(temperature_frequencies_match_softmax)
{
    const float l[6] = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, -1.0f};
    const double temps[] = {1.0, 0.7, 1.6};
    for (size_t ti = 0; ti < 3; ti++) {
        pd_sampling_params p = pd_sampling_default_params();
        p.temperature = temps[ti];
        p.seed = 1234 + (int64_t)ti;
        p.has_seed = true;
        const int n = 200000;
        long counts[6] = {0};
        ASSERT_OK(draw_many(&p, 6, l, n, counts));
        double prob[6];
        softmax(l, 6, temps[ti], prob);
        for (int i = 0; i < 6; i++) {
            double f = (double)counts[i] / n;
            double sd = sqrt(prob[i] * (1 - prob[i]) / n);
            ASSERT_MSG(fabs(f - prob[i]) <= 5 * sd, "T=%g token %d: freq %.5f vs p %.5f", temps[ti],
                       i, f, prob[i]);
        }
    }
}

TEST(top_k_sets)
{
    const double pr[6] = {0.30, 0.25, 0.20, 0.15, 0.06, 0.04};
    float l[6];
    logits_from_probs(pr, 6, l);
    pd_sampling_params p = pd_sampling_default_params();
    uint32_t m;
    p.top_k = 3;
    ASSERT_OK(support(&p, 6, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x7);
    p.top_k = 1;
    ASSERT_OK(support(&p, 6, l, 500, &m));
    ASSERT_EQ_INT(m, 0x1);
    const int32_t off[] = {0, -1, 6, 100};
    for (int i = 0; i < 4; i++) {
        p.top_k = off[i];
        ASSERT_OK(support(&p, 6, l, 20000, &m));
        ASSERT_MSG(m == 0x3f, "top_k %d: support %x", off[i], m);
    }
    /* ties at the k-th value are all kept (vLLM's threshold) */
    float tied[5] = {3.0f, 2.0f, 2.0f, 2.0f, 1.0f};
    p.top_k = 2;
    ASSERT_OK(support(&p, 5, tied, 5000, &m));
    ASSERT_EQ_INT(m, 0xf);
    /* top_k frequencies are the renormalized softmax of the kept tokens */
    p.top_k = 2;
    long counts[6] = {0};
    const int n = 100000;
    ASSERT_OK(draw_many(&p, 6, l, n, counts));
    double p0 = 0.30 / 0.55;
    ASSERT_NEAR((double)counts[0] / n, p0, 5 * sqrt(p0 * (1 - p0) / n));
    ASSERT_EQ_INT(counts[0] + counts[1], n);
}

TEST(top_p_sets)
{
    const double pr[4] = {0.5, 0.3, 0.15, 0.05};
    float l[4];
    logits_from_probs(pr, 4, l);
    pd_sampling_params p = pd_sampling_default_params();
    uint32_t m;
    p.top_p = 0.4;
    ASSERT_OK(support(&p, 4, l, 1000, &m));
    ASSERT_EQ_INT(m, 0x1);
    p.top_p = 0.79;
    ASSERT_OK(support(&p, 4, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x3);
    p.top_p = 0.81;
    ASSERT_OK(support(&p, 4, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x7);
    p.top_p = 1.0;
    ASSERT_OK(support(&p, 4, l, 20000, &m));
    ASSERT_EQ_INT(m, 0xf);
    /* ties split by id: the lower id ranks first */
    const double tp[4] = {0.4, 0.2, 0.2, 0.2};
    logits_from_probs(tp, 4, l);
    p.top_p = 0.5;
    ASSERT_OK(support(&p, 4, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x3);
    /* top_p after top_k renormalizes over the top_k survivors: with top_k 2 the kept
     * probabilities are 0.5/0.8 = 0.625 and 0.375; top_p 0.6 keeps only the first */
    logits_from_probs(pr, 4, l);
    p.top_k = 2;
    p.top_p = 0.6;
    ASSERT_OK(support(&p, 4, l, 2000, &m));
    ASSERT_EQ_INT(m, 0x1);
    p.top_p = 0.65;
    ASSERT_OK(support(&p, 4, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x3);
}

TEST(min_p_sets)
{
    const double pr[4] = {0.5, 0.3, 0.15, 0.05};
    float l[4];
    logits_from_probs(pr, 4, l);
    pd_sampling_params p = pd_sampling_default_params();
    uint32_t m;
    p.min_p = 0.31; /* threshold 0.155 */
    ASSERT_OK(support(&p, 4, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x3);
    p.min_p = 0.29; /* 0.145 */
    ASSERT_OK(support(&p, 4, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x7);
    p.min_p = 1.0; /* only the max (and its ties) */
    ASSERT_OK(support(&p, 4, l, 500, &m));
    ASSERT_EQ_INT(m, 0x1);
    /* min_p is relative to the tempered distribution: at T = 0.5 the probabilities are
     * proportional to p^2 = .25, .09, .0225, .0025; min_p 0.3 keeps >= 0.075 -> {0, 1} */
    p.temperature = 0.5;
    p.min_p = 0.3;
    ASSERT_OK(support(&p, 4, l, 5000, &m));
    ASSERT_EQ_INT(m, 0x3);
}

TEST(tiny_vocab)
{
    pd_sampling_params p = pd_sampling_default_params();
    float one[1] = {-3.0f};
    uint32_t m;
    p.top_p = 0.1;
    p.top_k = 5;
    p.min_p = 0.5;
    ASSERT_OK(support(&p, 1, one, 100, &m));
    ASSERT_EQ_INT(m, 0x1);
    float two[2] = {0.0f, 0.0f};
    p = pd_sampling_default_params();
    long counts[2] = {0};
    ASSERT_OK(draw_many(&p, 2, two, 40000, counts));
    ASSERT_NEAR((double)counts[0] / 40000, 0.5, 0.0125);
}

/* Brute-force reference of the selection: full sort, then the kept set by the definitions
 * (min_p cut, top_k value threshold with ties, top_p shortest prefix of the sorted order),
 * then the documented draw (sampler.h): weights pd_sampler_exp((l - max) / T), inverse CDF
 * in id order over 64-token block sums (four lanes, (s0 + s1) + (s2 + s3)). */
typedef struct {
    float l;
    int32_t id;
} ref_c;
static int ref_cmp(const void *a, const void *b)
{
    const ref_c *x = a, *y = b;
    if (x->l != y->l) return x->l > y->l ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}
static int32_t ref_sample(const float *l, int32_t V, float T, int32_t top_k, float top_p,
                          float min_p, double u, int32_t *n_kept)
{
    ref_c *c = malloc((size_t)V * sizeof *c);
    float *wk = calloc((size_t)V, sizeof *wk);
    float mx = -INFINITY;
    for (int32_t i = 0; i < V; i++) mx = l[i] > mx ? l[i] : mx;
    float cut = -INFINITY;
    if (min_p > 0.0f) {
        cut = mx + T * logf(min_p);
        cut = cut > mx ? mx : cut;
    }
    int32_t n = 0;
    for (int32_t i = 0; i < V; i++)
        if (l[i] > -INFINITY && l[i] >= cut) c[n++] = (ref_c){l[i], i};
    qsort(c, (size_t)n, sizeof *c, ref_cmp);
    if (top_k > 0 && top_k < n) {
        float kth = c[top_k - 1].l;
        int32_t m = top_k;
        while (m < n && c[m].l == kth) m++;
        n = m;
    }
    const float inv_t = 1.0f / T;
    if (top_p < 1.0f) {
        double total = 0.0;
        for (int32_t i = 0; i < n; i++) total += pd_sampler_exp((c[i].l - mx) * inv_t);
        double need = (double)top_p * total;
        for (int32_t i = 0; i < n; i++) {
            need -= pd_sampler_exp((c[i].l - mx) * inv_t);
            if (need <= 0.0) {
                n = i + 1;
                break;
            }
        }
    }
    for (int32_t i = 0; i < n; i++) wk[c[i].id] = pd_sampler_exp((c[i].l - mx) * inv_t);
    *n_kept = n;
    int32_t nb = (V + 63) / 64;
    double *bs = calloc((size_t)nb, sizeof *bs);
    double total = 0.0;
    for (int32_t b = 0; b < nb; b++) {
        float lane[4] = {0, 0, 0, 0};
        for (int32_t i = b * 64; i < V && i < b * 64 + 64; i++) lane[(i - b * 64) % 4] += wk[i];
        bs[b] = (double)((lane[0] + lane[1]) + (lane[2] + lane[3]));
        total += bs[b];
    }
    double target = u * total, acc = 0.0;
    int32_t tok = -1;
    for (int32_t b = 0; b < nb && tok < 0; b++) {
        if (acc + bs[b] > target && bs[b] > 0.0) {
            for (int32_t i = b * 64; i < V && i < b * 64 + 64; i++) {
                if (wk[i] <= 0.0f) continue;
                tok = i;
                acc += wk[i];
                if (acc > target) break;
            }
            break;
        }
        acc += bs[b];
    }
    for (int32_t i = V - 1; tok < 0 && i >= 0; i--)
        if (wk[i] > 0.0f) tok = i;
    free(bs);
    free(wk);
    free(c);
    return tok;
}

TEST(sampler_exp_accuracy)
{
    double worst = 0.0;
    for (int i = 0; i <= 870000; i++) {
        float x = -(float)i * 1e-4f;
        double rel = fabs((double)pd_sampler_exp(x) / exp((double)x) - 1.0);
        worst = rel > worst ? rel : worst;
    }
    ASSERT_MSG(worst < 3e-7, "worst relative error %g", worst);
    ASSERT(pd_sampler_exp(0.0f) == 1.0f);
    ASSERT(pd_sampler_exp(-87.5f) == 0.0f);
    ASSERT(pd_sampler_exp(-INFINITY) == 0.0f);
    /* monotone non-increasing as x decreases, over a fine grid near 0 */
    float prev = 1.0f;
    for (int i = 1; i < 200000; i++) {
        float y = pd_sampler_exp(-(float)i * 1e-5f);
        ASSERT(y <= prev);
        prev = y;
    }
}

TEST(selection_matches_bruteforce_reference)
{
    /* Random logits over vocabularies large enough for both draw paths (sparse sort by id,
     * dense scan) and the quickselects; every token must equal the full-sort reference. */
    const int32_t vocabs[] = {50, 3000, 20000};
    const struct {
        float T;
        int32_t k;
        float p, minp;
    } cfg[] = {{1.0f, 0, 0.9f, 0.0f},    {0.7f, 40, 1.0f, 0.0f},  {1.3f, 0, 1.0f, 0.02f},
               {0.8f, 100, 0.95f, 0.0f}, {1.0f, 0, 0.5f, 0.001f}, {2.0f, 5000, 0.99f, 0.0f},
               {1.0f, 0, 1.0f, 0.0f}};
    uint32_t seed = 99;
    int checked = 0, big_sets = 0;
    for (size_t vi = 0; vi < 3; vi++) {
        int32_t V = vocabs[vi];
        float *l = malloc((size_t)V * sizeof *l);
        pd_sampler_ws *ws = NULL;
        ASSERT_OK(pd_sampler_ws_create(V, 0, &ws));
        for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
            for (int rep = 0; rep < 6; rep++) {
                /* gaussian-ish logits, scale 1 (flat) to 13.5 (peaked), a few exact ties */
                for (int32_t i = 0; i < V; i++) {
                    float f[4];
                    pd_rng_uniform4f(seed, (uint32_t)rep, (uint64_t)i, 7, f);
                    l[i] = (f[0] + f[1] + f[2] + f[3] - 2.0f) * (1.0f + (float)(rep * rep) * 0.5f);
                    if (i % 17 == 5) l[i] = l[i - 1];
                }
                pd_sampling_params p = pd_sampling_default_params();
                p.temperature = cfg[ci].T;
                p.top_k = cfg[ci].k;
                p.top_p = cfg[ci].p;
                p.min_p = cfg[ci].minp;
                p.seed = (int64_t)seed;
                p.has_seed = true;
                pd_sampler_seq *s = NULL;
                ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, (uint32_t)ci, NULL, 0, &s));
                for (int step = 0; step < 4; step++) {
                    double u = pd_rng_uniform(seed, (uint32_t)ci, (uint64_t)step, 0);
                    int32_t n_kept = 0;
                    int32_t want = ref_sample(l, V, (float)p.temperature, p.top_k > 0 ? p.top_k : 0,
                                              (float)p.top_p, (float)p.min_p, u, &n_kept);
                    pd_sample_result r;
                    ASSERT_OK(pd_sample(s, l, NULL, ws, &r));
                    ASSERT_MSG(r.token == want,
                               "V=%d cfg %zu rep %d step %d: token %d, reference %d (kept %d)", V,
                               ci, rep, step, r.token, want, n_kept);
                    checked++;
                    big_sets += n_kept > 2048;
                }
                pd_sampler_seq_free(s);
                seed++;
            }
        }
        pd_sampler_ws_free(ws);
        free(l);
    }
    ASSERT(checked == 3 * 7 * 6 * 4);
    ASSERT(big_sets > 0); /* large kept sets (the histogram over many buckets) were exercised */
}

TEST(determinism_independent_of_call_order_and_process)
{
    const int32_t V = 1000;
    float *l = malloc(V * sizeof *l);
    for (int32_t i = 0; i < V; i++) l[i] = (float)((i * 7919) % 1000) / 250.0f;
    pd_sampling_params p = pd_sampling_default_params();
    p.temperature = 1.0;
    p.top_p = 0.95;
    p.seed = -17; /* any int64 */
    p.has_seed = true;
    pd_sampler_ws *ws = NULL;
    ASSERT_OK(pd_sampler_ws_create(V, 5, &ws));
    /* run A: sequences 0 and 1 alone, 40 steps each */
    int32_t a0[40], a1[40], b0[40], b1[40];
    pd_sampler_seq *s0, *s1;
    pd_sample_result r;
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 0, NULL, 0, &s0));
    for (int i = 0; i < 40; i++) {
        ASSERT_OK(pd_sample(s0, l, NULL, ws, &r));
        a0[i] = r.token;
    }
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 1, NULL, 0, &s1));
    for (int i = 0; i < 40; i++) {
        ASSERT_OK(pd_sample(s1, l, NULL, ws, &r));
        a1[i] = r.token;
    }
    pd_sampler_seq_free(s0);
    pd_sampler_seq_free(s1);
    /* run B: interleaved in reverse order, with another request in between */
    pd_sampling_params q = p;
    q.seed = 5;
    pd_sampler_seq *o;
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 1, NULL, 0, &s1));
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 0, NULL, 0, &s0));
    ASSERT_OK(pd_sampler_seq_create(&q, V, NULL, 0, 0, NULL, 0, &o));
    for (int i = 0; i < 40; i++) {
        ASSERT_OK(pd_sample(s1, l, NULL, ws, &r));
        b1[i] = r.token;
        ASSERT_OK(pd_sample(o, l, NULL, ws, &r));
        ASSERT_OK(pd_sample(s0, l, NULL, ws, &r));
        b0[i] = r.token;
    }
    ASSERT(memcmp(a0, b0, sizeof a0) == 0);
    ASSERT(memcmp(a1, b1, sizeof a1) == 0);
    ASSERT(memcmp(a0, a1, sizeof a0) != 0); /* the choice index matters */
    pd_sampler_seq_free(s0);
    pd_sampler_seq_free(s1);
    pd_sampler_seq_free(o);
    /* split: the first token recorded from elsewhere, the rest sampled here */
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 0, NULL, 0, &s0));
    ASSERT_OK(pd_sampler_seq_append(s0, a0[0]));
    for (int i = 1; i < 40; i++) {
        ASSERT_OK(pd_sample(s0, l, NULL, ws, &r));
        ASSERT_EQ_INT(r.token, a0[i]);
    }
    ASSERT_EQ_INT(pd_sampler_seq_seed(s0), (uint64_t)(int64_t)-17);
    ASSERT_ERR(pd_sampler_seq_append(s0, V), PD_EINVAL, "out of vocabulary");
    pd_sampler_seq_free(s0);
    pd_sampler_ws_free(ws);
    free(l);
}

TEST(logprobs_are_raw_log_softmax)
{
    const int32_t V = 300;
    float *l = malloc(V * sizeof *l);
    for (int32_t i = 0; i < V; i++) l[i] = sinf((float)i * 0.37f) * 5.0f;
    l[10] = l[20] = 7.0f; /* a tie at the top: lower id first */
    l[299] = -INFINITY;
    pd_sampling_params p = pd_sampling_default_params();
    p.logprobs = 5;
    p.temperature = 0.3;        /* logprobs ignore temperature ... */
    p.repetition_penalty = 1.7; /* ... and penalties */
    p.has_allowed_token_ids = false;
    pd_logit_bias lb[] = {{299, 100.0f}};
    p.logit_bias = lb;
    p.n_logit_bias = 1;
    pd_sampler_seq *s = NULL;
    pd_sampler_ws *ws = NULL;
    int32_t prompt[] = {10, 20};
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 0, prompt, 2, &s));
    ASSERT_OK(pd_sampler_ws_create(V, 20, &ws));
    double mx = 7.0, sum = 0.0;
    for (int32_t i = 0; i < V; i++) sum += exp((double)l[i] - mx);
    double lse = mx + log(sum);
    for (int step = 0; step < 10; step++) {
        pd_sample_result r;
        ASSERT_OK(pd_sample(s, l, NULL, ws, &r));
        ASSERT(r.token != 299);
        ASSERT_NEAR(r.logprob, (double)l[r.token] - lse, 1e-5);
        ASSERT_EQ_INT(r.n_top, 5);
        ASSERT_EQ_INT(r.top_ids[0], 10);
        ASSERT_EQ_INT(r.top_ids[1], 20);
        for (int j = 0; j < 5; j++) {
            ASSERT_NEAR(r.top_logprobs[j], (double)l[r.top_ids[j]] - lse, 1e-5);
            if (j > 0) ASSERT(r.top_logprobs[j] <= r.top_logprobs[j - 1]);
        }
        /* the top 5 are really the 5 largest */
        for (int32_t i = 0; i < V; i++) {
            bool in = false;
            for (int j = 0; j < 5; j++) in |= r.top_ids[j] == i;
            if (!in) ASSERT(l[i] <= l[r.top_ids[4]]);
        }
    }
    pd_sampler_seq_free(s);
    /* -inf raw logit -> -9999; logprobs 0 -> only the sampled token */
    p = pd_sampling_default_params();
    p.logprobs = 0;
    p.temperature = 0.0;
    p.has_allowed_token_ids = true;
    int32_t only[] = {299};
    p.allowed_token_ids = only;
    p.n_allowed_token_ids = 1;
    float l2[3] = {0.0f, -INFINITY, 1.0f};
    ASSERT_ERR(pd_sampler_seq_create(&p, 3, NULL, 0, 0, NULL, 0, &s), PD_EINVAL,
               "allowed_token_ids contains out-of-vocab token id!");
    only[0] = 1;
    pd_logit_bias up[] = {{1, 5.0f}};
    p.logit_bias = up;
    p.n_logit_bias = 1;
    ASSERT_OK(pd_sampler_seq_create(&p, 3, NULL, 0, 0, NULL, 0, &s));
    pd_sample_result r;
    /* token 1 is the only allowed one but -inf: nothing can be sampled */
    ASSERT_ERR(pd_sample(s, l2, NULL, ws, &r), PD_EINVAL, "every logit is masked");
    pd_sampler_seq_free(s);
    p.has_allowed_token_ids = false;
    p.n_logit_bias = 0;
    p.logprobs = 3;
    ASSERT_OK(pd_sampler_seq_create(&p, 3, NULL, 0, 0, NULL, 0, &s));
    ASSERT_OK(pd_sample(s, l2, NULL, ws, &r));
    ASSERT_EQ_INT(r.token, 2);
    ASSERT_EQ_INT(r.n_top, 3);
    ASSERT_EQ_INT(r.top_ids[2], 1);
    ASSERT(r.top_logprobs[2] == PD_LOGPROB_FLOOR);
    pd_sampler_seq_free(s);
    /* more logprobs than the workspace holds */
    p.logprobs = 21;
    ASSERT_OK(pd_sampler_seq_create(&p, 3, NULL, 0, 0, NULL, 0, &s));
    ASSERT_ERR(pd_sample(s, l2, NULL, ws, &r), PD_EINVAL, "logprobs requested");
    pd_sampler_seq_free(s);
    pd_sampler_ws_free(ws);
    /* workspace smaller than the vocabulary */
    ASSERT_OK(pd_sampler_ws_create(2, 0, &ws));
    p.logprobs = -1;
    ASSERT_OK(pd_sampler_seq_create(&p, 3, NULL, 0, 0, NULL, 0, &s));
    ASSERT_ERR(pd_sample(s, l2, NULL, ws, &r), PD_EINVAL, "workspace holds 2");
    pd_sampler_seq_free(s);
    pd_sampler_ws_free(ws);
    free(l);
}

TEST(seq_create_rejects_bad_ids)
{
    pd_sampling_params p = pd_sampling_default_params();
    pd_sampler_seq *s = NULL;
    int32_t bad[] = {1, 10};
    ASSERT_ERR(pd_sampler_seq_create(&p, 10, bad, 2, 0, NULL, 0, &s), PD_EINVAL, "EOS id 10");
    p.repetition_penalty = 1.2;
    ASSERT_ERR(pd_sampler_seq_create(&p, 10, NULL, 0, 0, bad, 2, &s), PD_EINVAL,
               "prompt token 1 (id 10)");
    ASSERT_ERR(pd_sampler_seq_create(&p, 0, NULL, 0, 0, NULL, 0, &s), PD_EINVAL, "vocabulary");
    ASSERT(s == NULL);
    pd_sampler_ws *ws = NULL;
    ASSERT_ERR(pd_sampler_ws_create(0, 0, &ws), PD_EINVAL, "bad sizes");
}

TEST(weight_pass_identical_on_every_instruction_set)
{
    /* pd_sample's weights must not depend on the CPU: scalar, SSE2 and AVX2 give the same
     * bits, including NaN, -inf, huge negative logits, the cut boundary and ragged tails. */
    const int32_t n = 1003;
    float *l = malloc(n * sizeof *l), *w0 = malloc(n * sizeof *w0);
    float *w1 = malloc(n * sizeof *w1);
    for (int32_t i = 0; i < n; i++) {
        float f[4];
        pd_rng_uniform4f(5, 0, (uint64_t)i, 3, f);
        l[i] = (f[0] - 0.5f) * 60.0f;
    }
    l[3] = NAN;
    l[10] = -INFINITY;
    l[11] = -1e30f;
    l[12] = 25.0f; /* the max */
    l[13] = 25.0f - 87.0f * 0.5f;
    l[14] = 2.0f; /* equals the cut */
    const float cuts[] = {-INFINITY, 2.0f, 24.0f};
    const float inv_ts[] = {1.0f, 2.0f, 0.37f, 1e5f};
    int tested = 0;
    for (int isa = PD_SAMPLER_ISA_SSE2; isa <= PD_SAMPLER_ISA_AVX2; isa++) {
        for (int ci = 0; ci < 3; ci++)
            for (int ti = 0; ti < 4; ti++)
                for (int32_t len = n - 8; len <= n; len++) {
                    ASSERT_OK(pd_sampler_weights(l, w0, len, 25.0f, cuts[ci], inv_ts[ti],
                                                 PD_SAMPLER_ISA_SCALAR));
                    int rc = pd_sampler_weights(l, w1, len, 25.0f, cuts[ci], inv_ts[ti], isa);
                    if (rc == PD_EUNSUPPORTED) goto next_isa;
                    ASSERT_OK(rc);
                    ASSERT_MSG(memcmp(w0, w1, (size_t)len * sizeof *w0) == 0,
                               "isa %d cut %g inv_t %g len %d: weights differ", isa,
                               (double)cuts[ci], (double)inv_ts[ti], len);
                    ASSERT(w1[3] == 0.0f && w1[10] == 0.0f && w1[11] == 0.0f);
                    ASSERT(w1[12] == 1.0f);
                }
        tested++;
    next_isa:;
    }
#if defined(__SSE2__)
    ASSERT(tested >= 1); /* SSE2 exists on every x86-64 */
#endif
    ASSERT_ERR(pd_sampler_weights(l, w0, n, 0, 0, 1, 99), PD_EUNSUPPORTED, "not available");
    free(l);
    free(w0);
    free(w1);
}

/* A structured-output mask (bit id % 32 of word id / 32) applies first: greedy takes the best
 * allowed id, sampling draws only allowed ids, logit_bias cannot revive a masked id, logprobs
 * stay those of the raw logits, and an all-zero mask is the "every logit is masked" error. */
TEST(grammar_mask_applies_first)
{
    enum { V = 70 }; /* three words, the last one partial */
    float l[V];
    for (int i = 0; i < V; i++) l[i] = (float)i / 10.0f;
    uint32_t mask[3] = {0};
    const int32_t allowed[] = {3, 40, 65};
    for (size_t k = 0; k < 3; k++) mask[allowed[k] / 32] |= 1u << (allowed[k] % 32);
    pd_sampling_params p = pd_sampling_default_params();
    p.temperature = 0.0;
    p.logprobs = 1;
    pd_logit_bias lb = {.id = 69, .bias = 100.0f};
    p.logit_bias = &lb;
    p.n_logit_bias = 1;
    pd_sampler_seq *s = NULL;
    pd_sampler_ws *ws = NULL;
    ASSERT_OK(pd_sampler_ws_create(V, 4, &ws));
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 0, NULL, 0, &s));
    pd_sample_result r;
    ASSERT_OK(pd_sample(s, l, mask, ws, &r));
    ASSERT_EQ_INT(r.token, 65);
    ASSERT_EQ_INT(r.top_ids[0], 69); /* raw logits: the masked best id still leads */
    ASSERT_OK(pd_sample(s, l, NULL, ws, &r));
    ASSERT_EQ_INT(r.token, 69); /* without the mask the bias wins */
    pd_sampler_seq_free(s);
    p.temperature = 1.0;
    p.n_logit_bias = 0;
    p.logit_bias = NULL;
    int seen[V] = {0};
    for (int seed = 0; seed < 300; seed++) {
        p.seed = seed;
        ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 0, NULL, 0, &s));
        ASSERT_OK(pd_sample(s, l, mask, ws, &r));
        seen[r.token]++;
        pd_sampler_seq_free(s);
    }
    ASSERT_EQ_INT(seen[3] + seen[40] + seen[65], 300);
    ASSERT(seen[3] > 0 && seen[40] > 0 && seen[65] > 0);
    uint32_t none[3] = {0};
    ASSERT_OK(pd_sampler_seq_create(&p, V, NULL, 0, 0, NULL, 0, &s));
    ASSERT_ERR(pd_sample(s, l, none, ws, &r), PD_EINVAL, "every logit is masked");
    pd_sampler_seq_free(s);
    pd_sampler_ws_free(ws);
}
