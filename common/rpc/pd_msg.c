/* pd.proto <-> engine struct conversions (see pd_msg.h). */
#include "rpc/pd_msg.h"

#include <stdlib.h>
#include <string.h>

#include "util/status.h"

uint8_t *pd_msg_pack(const ProtobufCMessage *m, size_t *len)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return NULL;
    *len = protobuf_c_message_pack(m, buf);
    return buf;
}

int pd_msg_sampling_from_proto(const Pd__SamplingParams *m, pd_arena *a, pd_sampling_params *out)
{
    pd_sampling_params p = pd_sampling_default_params();
    if (!m) {
        *out = p;
        return PD_OK;
    }
    p.n = m->n;
    p.temperature = m->temperature;
    p.top_p = m->top_p;
    p.top_k = m->top_k;
    p.min_p = m->min_p;
    p.presence_penalty = m->presence_penalty;
    p.frequency_penalty = m->frequency_penalty;
    p.repetition_penalty = m->repetition_penalty;
    p.has_seed = m->has_seed;
    p.seed = m->seed;
    if (m->n_logit_bias) {
        pd_logit_bias *lb = pd_arena_calloc(a, m->n_logit_bias, sizeof *lb);
        if (!lb) return pd_error(PD_ENOMEM, "sampling params: out of memory");
        for (size_t i = 0; i < m->n_logit_bias; i++) {
            lb[i].id = m->logit_bias[i]->id;
            lb[i].bias = m->logit_bias[i]->bias;
        }
        p.logit_bias = lb;
        p.n_logit_bias = (int32_t)m->n_logit_bias;
    }
    p.has_allowed_token_ids = m->has_allowed_token_ids;
    p.allowed_token_ids = m->allowed_token_ids;
    p.n_allowed_token_ids = (int32_t)m->n_allowed_token_ids;
    p.min_tokens = m->min_tokens;
    p.ignore_eos = m->ignore_eos;
    p.stop_token_ids = m->stop_token_ids;
    p.n_stop_token_ids = (int32_t)m->n_stop_token_ids;
    p.logprobs = m->logprobs;
    p.prompt_logprobs = m->has_prompt_logprobs ? m->prompt_logprobs : -1;
    p.stop = (const char *const *)m->stop;
    p.n_stop = (int32_t)m->n_stop;
    p.include_stop_str_in_output = m->include_stop_str_in_output;
    p.max_tokens = m->max_tokens;
    p.skip_special_tokens = m->skip_special_tokens;
    p.guided_kind = m->guided_kind;
    p.guided = (const char *)m->guided.data;
    p.guided_len = m->guided.len;
    p.guided_ws = m->guided_ws && m->guided_ws[0] ? m->guided_ws : NULL;
    p.use_beam_search = m->use_beam_search;
    if (p.use_beam_search) {
        p.best_of = m->best_of;
        p.length_penalty = m->length_penalty;
        p.early_stopping = m->early_stopping;
    }
    /* the message is freed before the request ends: own every array */
    return pd_sampling_params_clone(&p, a, out);
}

int pd_msg_sampling_to_proto(const pd_sampling_params *p, pd_arena *a, Pd__SamplingParams *m)
{
    pd__sampling_params__init(m);
    m->n = p->n;
    m->temperature = p->temperature;
    m->top_p = p->top_p;
    m->top_k = p->top_k;
    m->min_p = p->min_p;
    m->presence_penalty = p->presence_penalty;
    m->frequency_penalty = p->frequency_penalty;
    m->repetition_penalty = p->repetition_penalty;
    m->has_seed = p->has_seed;
    m->seed = p->seed;
    if (p->n_logit_bias > 0) {
        Pd__LogitBias *lb = pd_arena_calloc(a, (size_t)p->n_logit_bias, sizeof *lb);
        Pd__LogitBias **pp = pd_arena_calloc(a, (size_t)p->n_logit_bias, sizeof *pp);
        if (!lb || !pp) return pd_error(PD_ENOMEM, "sampling params: out of memory");
        for (int32_t i = 0; i < p->n_logit_bias; i++) {
            pd__logit_bias__init(&lb[i]);
            lb[i].id = p->logit_bias[i].id;
            lb[i].bias = p->logit_bias[i].bias;
            pp[i] = &lb[i];
        }
        m->logit_bias = pp;
        m->n_logit_bias = (size_t)p->n_logit_bias;
    }
    m->has_allowed_token_ids = p->has_allowed_token_ids;
    m->allowed_token_ids = (int32_t *)p->allowed_token_ids;
    m->n_allowed_token_ids = (size_t)(p->n_allowed_token_ids > 0 ? p->n_allowed_token_ids : 0);
    m->min_tokens = p->min_tokens;
    m->ignore_eos = p->ignore_eos;
    m->stop_token_ids = (int32_t *)p->stop_token_ids;
    m->n_stop_token_ids = (size_t)(p->n_stop_token_ids > 0 ? p->n_stop_token_ids : 0);
    m->logprobs = p->logprobs;
    m->has_prompt_logprobs = p->prompt_logprobs >= 0;
    m->prompt_logprobs = m->has_prompt_logprobs ? p->prompt_logprobs : 0;
    m->stop = (char **)p->stop;
    m->n_stop = (size_t)(p->n_stop > 0 ? p->n_stop : 0);
    m->include_stop_str_in_output = p->include_stop_str_in_output;
    m->max_tokens = p->max_tokens;
    m->skip_special_tokens = p->skip_special_tokens;
    m->guided_kind = p->guided_kind;
    m->guided.data = (uint8_t *)p->guided;
    m->guided.len = p->guided ? p->guided_len : 0;
    if (p->guided_ws) m->guided_ws = (char *)p->guided_ws;
    m->use_beam_search = p->use_beam_search;
    if (p->use_beam_search) {
        m->best_of = p->best_of;
        m->length_penalty = p->length_penalty;
        m->early_stopping = p->early_stopping;
    }
    return PD_OK;
}
