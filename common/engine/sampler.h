/* Sampler: turns one row of logits into one token, with vLLM's semantics and the pipeline
 * order of docs/api.md §9.4:
 *   1. allowed_token_ids mask   2. min_tokens mask of EOS and stop ids   3. logit_bias
 *   4. repetition_penalty over prompt + output ids (positive logit / p, negative * p)
 *   5. frequency_penalty * count and presence_penalty over output ids
 *   6. greedy argmax (temperature < PD_SAMPLING_GREEDY_EPS; ties -> lowest id), otherwise
 *      temperature, min_p, top_k, top_p, then one draw.
 * Logprobs are log_softmax of the RAW logits (before 1-6), as the contract says.
 *
 * Design choices:
 * - Randomness is rng.h's Philox keyed by (seed, sequence index, step): a pure function, so
 *   the token never depends on batching, call order or on which process sampled.
 * - Every filter is a threshold in the total order (logit desc, id asc), so the kept set is
 *   exact and independent of how it was found: min_p keeps logit >= max + T log(min_p);
 *   top_k keeps logit >= the k-th largest (every token tied with it too, as vLLM's
 *   threshold does; a min-heap of k values, no sort); top_p keeps the shortest prefix
 *   whose weight reaches top_p of the total (vLLM's rule), found among the 256 largest
 *   logits or else with a histogram of weight over logit buckets; only the candidates or
 *   the boundary bucket are sorted. O(vocab) per step, no full sort.
 * - Weights are w = pd_sampler_exp((logit - max) / T) (a fixed polynomial exp; AVX2, SSE2
 *   and scalar paths give identical bits, so every x86-64 CPU agrees). The draw is an inverse CDF
 * over the kept weights in ascending token-id order (sums of 64-token blocks in double, then inside
 * the block), so the token is a function of the kept set and the uniform alone.
 * - No allocation per token: the per-sequence state (pd_sampler_seq) is sized at creation
 *   (penalty counts only when a penalty is active), and the per-thread scratch
 *   (pd_sampler_ws) is caller-owned.
 */
#ifndef PD_ENGINE_SAMPLER_H
#define PD_ENGINE_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/config.h"
#include "util/arena.h"

#define PD_SAMPLING_GREEDY_EPS 1e-5       /* temperature below this means greedy */
#define PD_LOGIT_BIAS_MAX      100.0      /* logit_bias values are clamped to [-100, 100] */
#define PD_LOGPROB_FLOOR       (-9999.0f) /* -inf logprobs are reported as this (§9.4) */

typedef struct {
    int32_t id; /* token id in [0, vocab) */
    float bias; /* added to the logit; clamped to [-100, 100] when used */
} pd_logit_bias;

/* Every per-request generation field (vLLM's SamplingParams). Arrays and strings are
 * BORROWED: the struct does not own them (pd_sampling_params_clone makes an owning copy in
 * an arena). pd_sampler_seq_create and pd_stop_create copy what they keep. */
typedef struct {
    int32_t n;                 /* choices per prompt, >= 1 */
    double temperature;        /* >= 0; < PD_SAMPLING_GREEDY_EPS: greedy */
    double top_p;              /* (0, 1]; 1: off */
    int32_t top_k;             /* 0 or -1: off; else >= 1 */
    double min_p;              /* [0, 1]; 0: off */
    double presence_penalty;   /* [-2, 2]; over output ids, once per distinct id */
    double frequency_penalty;  /* [-2, 2]; over output ids, times the count */
    double repetition_penalty; /* > 0; 1: off; over prompt + output ids */
    bool has_seed; /* false: the request gave none; its creator stores pd_rng_random_seed() */
    int64_t seed;  /* Philox key (as uint64), always used: one value per request, every process */
    const pd_logit_bias *logit_bias; /* (n_logit_bias,), NULL when none */
    int32_t n_logit_bias;
    bool has_allowed_token_ids;       /* true: sample only from allowed_token_ids */
    const int32_t *allowed_token_ids; /* (n_allowed_token_ids,) */
    int32_t n_allowed_token_ids;
    int32_t min_tokens; /* >= 0: EOS/stop ids masked and stop strings unchecked before */
    bool ignore_eos;    /* model EOS ids do not stop (client stop ids/strings still do) */
    const int32_t *stop_token_ids; /* (n_stop_token_ids,) client stop ids */
    int32_t n_stop_token_ids;
    int32_t logprobs;        /* -1: none; N >= 0: chosen token's logprob + top-N */
    int32_t prompt_logprobs; /* -1: none; k >= 0: each prompt token's logprob and rank + top-k
                                (engine.h's pd_prompt_logprobs) */
    /* stop conditions (used by stop.h) */
    const char *const *stop; /* (n_stop,) NUL-terminated UTF-8 stop strings */
    int32_t n_stop;
    bool include_stop_str_in_output;
    int64_t max_tokens;       /* -1: no request cap (the context length still caps) */
    bool skip_special_tokens; /* for the detokenizer; default true */
    /* structured output (docs/structured_output.md): guided_kind 0 = none, else a
     * grammar/grammar.h pd_gspec_kind; guided (guided_len bytes) is its text, guided_ws the
     * guided_whitespace_pattern or NULL. The engine compiles it and masks every draw. */
    int32_t guided_kind;
    const char *guided;
    size_t guided_len;
    const char *guided_ws;
    /* beam search (vLLM 0.5's, docs/api.md): best_of beams (the width) are searched and the n
     * of the best score answered; the other sampling fields keep their defaults (checked) */
    bool use_beam_search;
    int32_t best_of;        /* beams with use_beam_search (>= n, > 1); 0 = n */
    double length_penalty;  /* score = cumulative logprob / len ** length_penalty (1) */
    int32_t early_stopping; /* pd_early_stopping */
} pd_sampling_params;

/* vLLM 0.5's early_stopping: true, false or "never" (when a beam search stops). */
typedef enum {
    PD_EARLY_STOPPING_FALSE = 0, /* when the best running beam cannot beat the worst kept */
    PD_EARLY_STOPPING_TRUE = 1,  /* as soon as best_of beams finished */
    PD_EARLY_STOPPING_NEVER = 2, /* as false, the running beam scored at its longest length */
} pd_early_stopping;

/* Built-in defaults (§7.1): n 1, temperature 1, top_p 1, top_k 0, min_p 0, penalties off,
 * no seed, no bias, no allowed list, min_tokens 0, logprobs -1, prompt_logprobs -1, no stop,
 * max_tokens -1, skip_special_tokens true. */
pd_sampling_params pd_sampling_default_params(void);

/* Defaults with the model's generation_config.json applied by §7.1's rules (temperature /
 * top_p / repetition_penalty when != 1.0, top_k when != 50, min_p when present;
 * max_new_tokens is a cap the stop checker takes, not a field here). g may be NULL. Request
 * parsing starts from this and overwrites what the request sets. */
pd_sampling_params pd_sampling_model_params(const pd_generation_config *g);

/* A request's sampling fields as written, before they are clamped into pd_sampling_params, for
 * the one validator of §8.1 (pd_sampling_check): the api-server fills it from a request body,
 * pd_sampling_params_validate from params. has_x: x was given (absent fields are not checked).
 * Arrays are borrowed. */
typedef struct {
    bool has_n, has_best_of, has_presence_penalty, has_frequency_penalty, has_repetition_penalty,
        has_temperature, has_top_p, has_top_k, has_min_p, has_max_tokens, has_min_tokens,
        has_logprobs;
    int64_t n, best_of, top_k, max_tokens, min_tokens, logprobs;
    double presence_penalty, frequency_penalty, repetition_penalty, temperature, top_p, min_p;
    const char *const *stop; /* (n_stop) */
    int32_t n_stop;
    const int32_t *stop_token_ids;         /* (n_stop_token_ids) clamped to int32 */
    const int64_t *stop_token_ids_written; /* (n_stop_token_ids) as written; NULL: the above */
    int32_t n_stop_token_ids;
    const pd_logit_bias *logit_bias;    /* (n_logit_bias) ids clamped to int32 */
    const char *const *logit_bias_keys; /* (n_logit_bias) the keys as written, which must be
                                           integers; NULL: the ids are printed */
    int32_t n_logit_bias;
    bool has_allowed_token_ids;
    const int32_t *allowed_token_ids; /* (n_allowed_token_ids) */
    int32_t n_allowed_token_ids;
    int64_t max_n;           /* > 0: n above it is refused (the api-server's --max-n-style cap) */
    bool max_tokens_zero_ok; /* max_tokens 0 is allowed (completions with echo) */
    /* beam search's own fields: without use_beam_search they must keep their defaults */
    bool use_beam_search, has_length_penalty;
    int32_t early_stopping; /* pd_early_stopping */
    double length_penalty;
} pd_sampling_fields;

/* Checks f against a vocabulary of `vocab` tokens in §8.1's table order: n (and max_n),
 * best_of (>= n), presence / frequency penalty, repetition_penalty,
 * temperature, top_p, top_k, min_p, max_tokens, min_tokens, logprobs, stop strings non-empty,
 * stop_token_ids in vocabulary, logit_bias keys and ids (every out-of-vocabulary one named),
 * allowed_token_ids, then with use_beam_search best_of > 1, temperature 0, top_p 1, top_k off
 * (vLLM 0.5's _verify_beam_search; top_k 0 and -1 are both "off" here), without it
 * early_stopping false and length_penalty 1 (vLLM's _verify_non_beam_search). On failure PD_EINVAL
 * with exactly the contract's (vLLM's) message, e.g. "top_p must be in (0, 1], got 1.5.". */
int pd_sampling_check(const pd_sampling_fields *f, int32_t vocab);

/* pd_sampling_check of every field of p (max_tokens when not -1), after p's own consistency
 * (arrays present where counts say so). */
int pd_sampling_params_validate(const pd_sampling_params *p, int32_t vocab);

/* With use_beam_search: the first field of p a beam search does not support (the engine's
 * search applies no logits processor: docs/beam_search.md), as the field's name ("min_tokens",
 * "presence_penalty", ...), or NULL. */
const char *pd_sampling_beam_unsupported(const pd_sampling_params *p);

/* True when p selects greedy decoding (temperature < PD_SAMPLING_GREEDY_EPS). */
bool pd_sampling_is_greedy(const pd_sampling_params *p);

/* Deep copy of src into out, every array and string allocated in arena a (freed with it). */
int pd_sampling_params_clone(const pd_sampling_params *src, pd_arena *a, pd_sampling_params *out);

/* ---- per-sequence state ----------------------------------------------------------------- */

typedef struct pd_sampler_seq pd_sampler_seq;

/* Creates the sampling state of one sequence (one choice of a request).
 * p: validated params (copied; p's arrays need not outlive the call).
 * vocab: logits row length. eos_ids (n_eos): every model EOS id (tokenizer eos_token and
 * generation_config eos_token_id), masked together with p->stop_token_ids while fewer than
 * min_tokens tokens were generated. seq_index: the choice index (Philox counter word).
 * prompt (n_prompt): prompt ids, for repetition_penalty. Out-of-range ids are PD_EINVAL. */
int pd_sampler_seq_create(const pd_sampling_params *p, int32_t vocab, const int32_t *eos_ids,
                          size_t n_eos, uint32_t seq_index, const int32_t *prompt, size_t n_prompt,
                          pd_sampler_seq **out);
void pd_sampler_seq_free(pd_sampler_seq *s);

/* Records an output token that was sampled elsewhere (e.g. the first token, sampled on the
 * prefill node): updates penalty counts and advances the step. pd_sample does this itself. */
int pd_sampler_seq_append(pd_sampler_seq *s, int32_t token);

/* Output tokens recorded so far = the step of the next draw. */
int64_t pd_sampler_seq_num_output(const pd_sampler_seq *s);

/* The seed in use (the params' seed). */
uint64_t pd_sampler_seq_seed(const pd_sampler_seq *s);

/* ---- per-thread workspace ------------------------------------------------------------------ */

typedef struct pd_sampler_ws pd_sampler_ws;

/* Scratch for one sampling thread (about 24 bytes per vocabulary entry: 3.6 MB for 151936),
 * plus top-N result arrays for up to max_logprobs entries (--max-logprobs, default 20). */
int pd_sampler_ws_create(int32_t vocab, int32_t max_logprobs, pd_sampler_ws **out);
void pd_sampler_ws_free(pd_sampler_ws *w);

typedef struct {
    int32_t token; /* the sampled id */
    float logprob; /* log_softmax(raw logits)[token] (floored at -9999); when logprobs >= 0 */
    int32_t n_top; /* min(logprobs, vocab) when logprobs >= 0, else 0 */
    const int32_t *top_ids;    /* (n_top,) most likely ids by raw logit, desc (ties: lower id) */
    const float *top_logprobs; /* (n_top,) their logprobs; both arrays live in the ws and
                                * stay valid until the next pd_sample with that ws */
} pd_sample_result;

/* The logprob of token under the raw logits ((vocab,) f32) and the n_top most likely tokens
 * (out->token = token; arrays in ws as pd_sample's), as pd_sample reports them for a sampled
 * token; *rank (may be NULL) receives the number of tokens whose logit is >= token's (NaN
 * logits count as -inf). For prompt logprobs. PD_EINVAL when ws is too small. */
int pd_sampler_logprobs(const float *logits, int32_t vocab, int32_t n_top, int32_t token,
                        pd_sampler_ws *ws, pd_sample_result *out, int32_t *rank);

/* The exponential the sampler uses for weights: exp(x) within 3e-7 relative for x in
 * [-87, 0], 0 below -87, exp(0) = 1 exactly, x clamped to 88 above. Exposed so that a
 * reference can reproduce draws bit for bit. */
float pd_sampler_exp(float x);

/* Instruction sets of the sampler's vector passes (for tests and benchmarks). */
enum { PD_SAMPLER_ISA_SCALAR = 0, PD_SAMPLER_ISA_SSE2 = 1, PD_SAMPLER_ISA_AVX2 = 2 };

/* The weight pass of pd_sample on its own, restricted to isa (so tests can check that
 * every path gives identical bits): w[i] = l[i] >= cut ? pd_sampler_exp((l[i] - mx) *
 * inv_t) : 0, for i in [0, n). PD_EUNSUPPORTED when this build or CPU lacks isa. */
int pd_sampler_weights(const float *l, float *w, int32_t n, float mx, float cut, float inv_t,
                       int isa);

/* Samples the next token of s from logits ((vocab,) f32, raw model output, not modified)
 * at step pd_sampler_seq_num_output(s), then appends it to s. mask (may be NULL): a bitmask
 * of the ids that may be drawn (bit id % 32 of word id / 32, (vocab + 31) / 32 words; a
 * structured-output grammar's), applied with allowed_token_ids in step 1. The draw uses
 * pd_rng_uniform(seed, seq_index, step, PD_RNG_STREAM_SAMPLE). Fails with PD_EINVAL when no
 * token has non-zero probability (everything masked or NaN), when a logit is +inf outside
 * greedy, or when ws is smaller than the vocabulary or than the requested logprobs.
 * Allocates nothing. */
int pd_sample(pd_sampler_seq *s, const float *logits, const uint32_t *mask, pd_sampler_ws *ws,
              pd_sample_result *out);

#endif
