/* Stop checker: decides when a sequence ends and which text of each token the client sees
 * (docs/api.md §9.1-9.2, vLLM v1 semantics).
 *
 * Per generated token, in this order:
 *   1. "length" when prompt + output tokens reach max_model_len, or output tokens reach the
 *      effective max_tokens (min of the request's max_tokens and generation_config's
 *      max_new_tokens).
 *   2. While output tokens < min_tokens nothing else is checked.
 *   3. The primary EOS id (unless ignore_eos): "stop", stop_reason null.
 *   4. An id in stop_token_ids, or one of generation_config's other EOS ids (unless
 *      ignore_eos): "stop", stop_reason = the id. In 3 and 4 the token's own text is dropped
 *      unless include_stop_str_in_output.
 *   5. Stop strings (only once output tokens > min_tokens): the new text together with the
 *      longest-stop-minus-one code points before it is searched for each string in list
 *      order; the first string found wins ("stop", stop_reason = the string), overriding any
 *      finish_reason from 1. Text after the match (after its end with
 *      include_stop_str_in_output) is dropped.
 * Hold-back: with stop strings and without include_stop_str_in_output, the text released so
 * far never exceeds len(text) - (longest stop - 1) code points until the sequence finishes,
 * so no released text can be part of a match; at the finish everything left is released.
 *
 * Design choice: the checker takes text deltas (from the incremental detokenizer) and token
 * ids, so it does not depend on the tokenizer. It keeps only the held-back text plus the
 * look-behind context in one buffer that grows geometrically and then stays put.
 */
#ifndef PD_ENGINE_STOP_H
#define PD_ENGINE_STOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/sampler.h"

typedef enum {
    PD_FINISH_NONE = 0,   /* still running */
    PD_FINISH_STOP = 1,   /* "stop" */
    PD_FINISH_LENGTH = 2, /* "length" */
} pd_finish_reason;

typedef enum {
    PD_STOP_REASON_NULL = 0,   /* stop_reason: null (EOS, length, or not finished) */
    PD_STOP_REASON_TOKEN = 1,  /* stop_reason: an integer token id */
    PD_STOP_REASON_STRING = 2, /* stop_reason: a stop string */
} pd_stop_reason_kind;

/* "stop", "length", or NULL for PD_FINISH_NONE. */
const char *pd_finish_reason_name(pd_finish_reason r);

/* What the model contributes to stopping. */
typedef struct {
    int32_t eos_id;               /* primary EOS: tokenizer_config eos_token; -1 when none */
    const int32_t *extra_eos_ids; /* (n_extra_eos_ids,) generation_config eos_token_id values
                                   * (the primary may appear; it is skipped) */
    size_t n_extra_eos_ids;
    int64_t max_model_len;  /* L: prompt + output may not exceed it; > 0 */
    int64_t max_new_tokens; /* generation_config max_new_tokens; -1 when absent */
} pd_stop_model;

typedef struct {
    pd_finish_reason finish; /* NONE while running */
    pd_stop_reason_kind stop_kind;
    int32_t stop_token;      /* PD_STOP_REASON_TOKEN: the id */
    int32_t stop_index;      /* PD_STOP_REASON_STRING: index into params.stop */
    const char *stop_string; /* PD_STOP_REASON_STRING: the string (owned by the checker) */
    const char *text;        /* UTF-8 to emit for this call (not NUL-terminated) */
    size_t text_len;         /* bytes; text stays valid until the next call on the checker */
} pd_stop_result;

typedef struct pd_stop pd_stop;

/* Effective max_tokens for a prompt of prompt_len tokens (§7.2): the minimum of those that
 * exist among L - P, p->max_tokens and m->max_new_tokens. */
int64_t pd_stop_effective_max_tokens(const pd_sampling_params *p, const pd_stop_model *m,
                                     int64_t prompt_len);

/* Creates the checker for one sequence. p: validated params (stop strings, stop ids and the
 * flags are copied). prompt_len: P, the prompt tokens already in the context. */
int pd_stop_create(const pd_sampling_params *p, const pd_stop_model *m, int64_t prompt_len,
                   pd_stop **out);
void pd_stop_free(pd_stop *s);

/* Feeds one generated token and the text its detokenization added (delta, delta_len bytes,
 * valid UTF-8, may be empty). Fills r with the finish state and the text to emit now.
 * PD_EINVAL after the sequence has finished. Allocates only while the held text outgrows its
 * buffer (geometric growth). */
int pd_stop_push(pd_stop *s, int32_t token, const char *delta, size_t delta_len, pd_stop_result *r);

/* The answer is complete after the next token (a structured-output grammar that allows
 * nothing more): that push finishes with "stop" and a null stop_reason, as an EOS would, unless
 * a length limit or a stop id or string decides first. */
void pd_stop_complete(pd_stop *s);

/* After a push that finished the sequence: the detokenizer's final flush (pd_detok_flush:
 * an incomplete UTF-8 tail written as U+FFFD; may be empty). r->text is what to add to the
 * final chunk: the tail, or nothing when a stop string ended the sequence. PD_EINVAL when
 * the sequence has not finished or was already flushed. */
int pd_stop_flush(pd_stop *s, const char *tail, size_t tail_len, pd_stop_result *r);

/* Steps 3 and 4 for one token, from the checker's configuration only (neither its state nor
 * min_tokens): PD_FINISH_STOP with a null stop_reason for the primary EOS, with stop_kind TOKEN
 * and stop_token for a stop id or another EOS id (none of them with ignore_eos but the client's
 * stop ids), else PD_FINISH_NONE. Only r's finish, stop_kind and stop_token are set; the caller
 * cleared r. Beam search checks its candidates with it (vLLM 0.5: these before the length). */
pd_finish_reason pd_stop_check_token(const pd_stop *s, int32_t token, pd_stop_result *r);

/* Makes dst's state (text held and released, tokens pushed) src's, so that dst goes on as src
 * would: both made with the same parameters, src not finished (a beam search checks each
 * candidate on a copy of its beam's checker). Allocates only while dst's buffer grows. */
int pd_stop_copy_state(pd_stop *dst, const pd_stop *src);

/* The effective max_tokens (pd_stop_effective_max_tokens) the checker applies. */
int64_t pd_stop_max_tokens(const pd_stop *s);

/* Output tokens pushed so far. */
int64_t pd_stop_num_output(const pd_stop *s);

/* True once a push has finished the sequence. */
bool pd_stop_finished(const pd_stop *s);

#endif
