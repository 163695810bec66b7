/* pd-scheduler: response bodies (loop thread): the OpenAI completions and chat chunks and
 * bodies, usage and logprobs (§12), and the legacy /generate texts.
 *
 * Design: bodies are written by hand into growable buffers (sbuf.h), not built as JSON trees:
 * a streamed token costs one formatted event and, once the buffers have grown, no allocation;
 * the keys come in the order vLLM writes them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server_internal.h"

void srv_emit(sreq *r)
{
    pd_sb_add(&r->out, "data: ", 6);
    pd_sb_add(&r->out, r->ev.p, r->ev.len);
    pd_sb_add(&r->out, "\n\n", 2);
    pd_sb_reset(&r->ev);
}

const char *srv_model_name(const pd_apiserver *s)
{
    return s->p.served_names[0];
}

static void chunk_head(sreq *r)
{
    pd_apiserver *s = r->s;
    bool chat = r->req.kind == PD_API_CHAT;
    pd_sb_printf(&r->ev, "{\"id\":\"%s%s\",\"object\":\"%s\",\"created\":%lld,\"model\":",
                 chat ? "chatcmpl-" : "cmpl-", r->id,
                 chat ? "chat.completion.chunk" : "text_completion", (long long)r->created);
    pd_sb_json_str(&r->ev, srv_model_name(s), strlen(srv_model_name(s)));
    pd_sb_str(&r->ev, ",\"choices\":[");
}

/* A usage object. details: with prompt_tokens_details (a response body; stream usage leaves it
 * out); cached > 0 (--enable-prompt-tokens-details): it is {"cached_tokens": cached}, also in a
 * stream's usage, as vLLM writes it. */
static void usage_obj(pd_sb *b, int64_t p, int64_t c, bool details, int64_t cached)
{
    pd_sb_printf(b, "{\"prompt_tokens\":%lld,\"total_tokens\":%lld,\"completion_tokens\":%lld",
                 (long long)p, (long long)(p + c), (long long)c);
    if (cached > 0)
        pd_sb_printf(b, ",\"prompt_tokens_details\":{\"cached_tokens\":%lld}", (long long)cached);
    else if (details)
        pd_sb_str(b, ",\"prompt_tokens_details\":null");
    pd_sb_str(b, "}");
}

/* The request's prompt tokens found in the prefix cache (each prompt's first choice: the
 * others may find what it computed), or 0 without --enable-prompt-tokens-details. */
static int64_t cached_tokens(const sreq *r)
{
    if (!r->s->p.enable_prompt_tokens_details || r->req.n_prompts == 0) return 0;
    int n = r->n_choices / (int)r->req.n_prompts;
    int64_t sum = 0;
    for (int i = 0; i < r->n_choices; i += n) sum += r->choices[i].cached_tokens;
    return sum;
}

static void stop_reason_json(pd_sb *b, const choice *c)
{
    if (c->stop_kind == 1)
        pd_sb_printf(b, "%d", c->stop_token);
    else if (c->stop_kind == 2 && c->stop_string)
        pd_sb_json_str(b, c->stop_string, strlen(c->stop_string));
    else
        pd_sb_str(b, "null");
}

static int64_t choice_prompt_tokens(const sreq *r, const choice *c)
{
    return (int64_t)r->req.prompts[c->prompt_idx].n_ids;
}

/* ---- logprobs (§12) ---- */

/* The text of one token for logprobs: decoded alone (U+FFFD for bytes that are not valid UTF-8
 * on their own) or "token_id:{id}". Into s->tokbuf. */
static void token_text(pd_apiserver *s, bool as_ids, int32_t id)
{
    pd_sb_reset(&s->tokbuf);
    if (as_ids) {
        pd_sb_printf(&s->tokbuf, "token_id:%d", id);
        return;
    }
    char *t = NULL;
    size_t n = 0;
    if (pd_tok_decode(s->tok, &id, 1, false, &t, &n) == 0) pd_sb_add(&s->tokbuf, t, n);
    free(t);
    if (!s->tokbuf.p) pd_sb_add(&s->tokbuf, "", 0);
}

static void sep(pd_sb *b)
{
    if (b->len) pd_sb_add(b, ",", 1);
}

static void utf8_bytes(pd_sb *b, const char *t, size_t n)
{
    pd_sb_add(b, "[", 1);
    for (size_t i = 0; i < n; i++) pd_sb_printf(b, "%s%u", i ? "," : "", (unsigned char)t[i]);
    pd_sb_add(b, "]", 1);
}

static size_t code_points(const char *t, size_t n)
{
    size_t cp = 0;
    for (size_t i = 0; i < n; i++) cp += ((unsigned char)t[i] & 0xC0) != 0x80;
    return cp;
}

static void lp_value(pd_sb *b, float lp)
{
    double v = isfinite(lp) ? (double)lp : -9999.0;
    if (v < -9999.0) v = -9999.0;
    pd_sb_double(b, v);
}

/* Appends token t's logprob items to out[0..3] (completions: text_offset, token_logprobs,
 * tokens, top_logprobs; chat: out[0] gets one content item). */
void srv_lp_items(sreq *r, choice *c, const rec_buf *w, const tok_rec *t, pd_sb out[4])
{
    pd_apiserver *s = r->s;
    bool ids = r->req.tokens_as_ids;
    const int32_t *top = w->top_ids ? w->top_ids + t->top_off : NULL;
    const float *tlp = w->top_lps ? w->top_lps + t->top_off : NULL;
    if (r->req.kind == PD_API_CHAT) {
        sep(&out[0]);
        token_text(s, ids, t->token);
        pd_sb_str(&out[0], "{\"token\":");
        pd_sb_json_str(&out[0], s->tokbuf.p, s->tokbuf.len);
        pd_sb_str(&out[0], ",\"logprob\":");
        lp_value(&out[0], t->logprob);
        pd_sb_str(&out[0], ",\"bytes\":");
        utf8_bytes(&out[0], s->tokbuf.p, s->tokbuf.len);
        pd_sb_str(&out[0], ",\"top_logprobs\":[");
        for (size_t i = 0; i < t->n_top; i++) {
            token_text(s, ids, top[i]);
            pd_sb_str(&out[0], i ? ",{\"token\":" : "{\"token\":");
            pd_sb_json_str(&out[0], s->tokbuf.p, s->tokbuf.len);
            pd_sb_str(&out[0], ",\"logprob\":");
            lp_value(&out[0], tlp[i]);
            pd_sb_str(&out[0], ",\"bytes\":");
            utf8_bytes(&out[0], s->tokbuf.p, s->tokbuf.len);
            pd_sb_str(&out[0], "}");
        }
        pd_sb_str(&out[0], "]}");
        return;
    }
    for (int k = 0; k < 4; k++) sep(&out[k]);
    pd_sb_printf(&out[0], "%lld", (long long)c->text_cps);
    lp_value(&out[1], t->logprob);
    token_text(s, ids, t->token);
    c->text_cps += (int64_t)code_points(s->tokbuf.p, s->tokbuf.len);
    pd_sb_json_str(&out[2], s->tokbuf.p, s->tokbuf.len);
    /* {sampled: lp, then the top ones; a text that repeats appears once} */
    pd_sb_str(&out[3], "{");
    pd_sb_json_str(&out[3], s->tokbuf.p, s->tokbuf.len);
    pd_sb_add(&out[3], ":", 1);
    lp_value(&out[3], t->logprob);
    char seen[32][64];
    size_t n_seen = 0;
    snprintf(seen[n_seen++], sizeof seen[0], "%s", s->tokbuf.p);
    for (size_t i = 0; i < t->n_top; i++) {
        token_text(s, ids, top[i]);
        bool dup = false;
        for (size_t j = 0; j < n_seen && !dup; j++) dup = strcmp(seen[j], s->tokbuf.p) == 0;
        if (dup) continue;
        if (n_seen < 32) snprintf(seen[n_seen++], sizeof seen[0], "%s", s->tokbuf.p);
        pd_sb_add(&out[3], ",", 1);
        pd_sb_json_str(&out[3], s->tokbuf.p, s->tokbuf.len);
        pd_sb_add(&out[3], ":", 1);
        lp_value(&out[3], tlp[i]);
    }
    pd_sb_str(&out[3], "}");
}

/* True when the Prefill reply's prompt logprobs p hold prompt position i (>= 1): a well-formed
 * reply holds every one. */
static bool plp_has(const Pd__PromptLogprobs *p, size_t i)
{
    size_t nt = p && p->n_top > 0 ? (size_t)p->n_top : 0;
    return p && i >= 1 && i - 1 < p->n_logprob && i - 1 < p->n_rank && i * nt <= p->n_top_ids &&
           i * nt <= p->n_top_logprobs;
}

/* The prompt logprobs of c's prompt: its own, or a beam search's choice's its leader's. */
static const Pd__PromptLogprobs *choice_plp(const sreq *r, const choice *c)
{
    return c->rides ? srv_leader(r, c)->plp : c->plp;
}

void srv_lp_prompt_items(sreq *r, choice *c, pd_sb out[4])
{
    if (r->req.kind != PD_API_COMPLETIONS || !r->req.echo || c->echo_lp_done) return;
    c->echo_lp_done = true;
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    const Pd__PromptLogprobs *p = choice_plp(r, c);
    size_t nt = p && p->n_top > 0 ? (size_t)p->n_top : 0;
    rec_buf w = {.top_ids = p ? p->top_ids : NULL, .top_lps = p ? p->top_logprobs : NULL};
    for (size_t i = 0; i < pr->n_ids; i++) {
        if (!plp_has(p, i)) {
            /* the first token has no logits before it: null, as vLLM */
            for (int k = 0; k < 4; k++) sep(&out[k]);
            token_text(r->s, r->req.tokens_as_ids, pr->ids[i]);
            pd_sb_printf(&out[0], "%lld", (long long)c->text_cps);
            pd_sb_str(&out[1], "null");
            c->text_cps += (int64_t)code_points(r->s->tokbuf.p, r->s->tokbuf.len);
            pd_sb_json_str(&out[2], r->s->tokbuf.p, r->s->tokbuf.len);
            pd_sb_str(&out[3], "null");
            continue;
        }
        tok_rec t = {.n_tokens = 1,
                     .token = pr->ids[i],
                     .has_logprob = true,
                     .logprob = p->logprob[i - 1],
                     .top_off = (i - 1) * nt,
                     .n_top = nt};
        srv_lp_items(r, c, &w, &t, out);
    }
}

/* The "prompt_logprobs" value of a body: null, or [null, {"<id>": {"logprob", "rank",
 * "decoded_token"}, ...}, ...] with the prompt token first, then the top ones (vLLM's dict). */
static void prompt_logprobs_json(sreq *r, pd_sb *b, const choice *c)
{
    const Pd__PromptLogprobs *p = c ? choice_plp(r, c) : NULL;
    if (r->req.sp.prompt_logprobs < 0 || !c) {
        pd_sb_str(b, "null");
        return;
    }
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    size_t nt = p && p->n_top > 0 ? (size_t)p->n_top : 0;
    pd_sb_str(b, "[null");
    for (size_t i = 1; i < pr->n_ids; i++) {
        if (!plp_has(p, i)) {
            pd_sb_str(b, ",null"); /* not computed (cannot happen with a well-formed reply) */
            continue;
        }
        for (size_t j = 0; j <= nt; j++) {
            int32_t id = j == 0 ? pr->ids[i] : p->top_ids[(i - 1) * nt + j - 1];
            if (j > 0 && id == pr->ids[i]) continue; /* listed first already */
            float lp = j == 0 ? p->logprob[i - 1] : p->top_logprobs[(i - 1) * nt + j - 1];
            int32_t rank = j == 0 ? p->rank[i - 1] : (int32_t)j;
            pd_sb_printf(b, "%s\"%d\":{\"logprob\":", j ? "," : ",{", id);
            lp_value(b, lp);
            pd_sb_printf(b, ",\"rank\":%d,\"decoded_token\":", rank);
            token_text(r->s, false, id);
            pd_sb_json_str(b, r->s->tokbuf.p, r->s->tokbuf.len);
            pd_sb_str(b, "}");
        }
        pd_sb_str(b, "}");
    }
    pd_sb_str(b, "]");
}

/* The logprobs object from items (see srv_lp_items). */
void srv_lp_object(pd_sb *b, bool chat, pd_sb items[4])
{
    if (chat) {
        pd_sb_str(b, "{\"content\":[");
        pd_sb_add(b, items[0].p ? items[0].p : "", items[0].len);
        pd_sb_str(b, "]}");
        return;
    }
    static const char *const keys[4] = {"text_offset", "token_logprobs", "tokens", "top_logprobs"};
    for (int k = 0; k < 4; k++) {
        pd_sb_printf(b, "%s\"%s\":[", k ? "," : "{", keys[k]);
        pd_sb_add(b, items[k].p ? items[k].p : "", items[k].len);
        pd_sb_str(b, "]");
    }
    pd_sb_str(b, "}");
}

/* The finish reason of a finished choice: "tool_calls" once its tool parser streamed a call
 * (vLLM's, whatever stopped the generation; tool_choice auto and "required", not a named
 * function). */
static const char *finish_reason(const choice *c)
{
    return c->tools && pd_tool_stream_called(c->tools) ? "tool_calls" : c->finish;
}

/* A delta's "tool_calls" array, in the key order of vLLM's DeltaToolCall (id, type, index,
 * function {name, arguments}; what a delta does not set left out). */
static void tool_deltas(pd_sb *b, const pd_tool_delta *d)
{
    pd_sb_str(b, "\"tool_calls\":[");
    for (size_t i = 0; i < d->n_calls; i++) {
        const pd_tool_delta_call *t = &d->calls[i];
        pd_sb_str(b, i ? ",{" : "{");
        if (t->first) {
            pd_sb_str(b, "\"id\":");
            pd_sb_json_str(b, t->id, strlen(t->id));
            pd_sb_str(b, ",\"type\":\"function\",");
        }
        pd_sb_printf(b, "\"index\":%d,\"function\":{", t->index);
        if (t->first) {
            pd_sb_str(b, "\"name\":");
            pd_sb_json_str(b, t->name, strlen(t->name));
        }
        if (t->args) {
            pd_sb_str(b, t->first ? ",\"arguments\":" : "\"arguments\":");
            pd_sb_json_str(b, t->args, t->args_len);
        }
        pd_sb_str(b, "}}");
    }
    pd_sb_str(b, "]");
}

/* ,"logprobs":...,"finish_reason":... of a chunk's choice. A non-final chat chunk has no
 * stop_reason key; a non-final completions chunk has "stop_reason":null (§11.2, §11.3). */
static void choice_tail(pd_sb *sb, const choice *c, const pd_sb *lp, bool final,
                        bool null_stop_reason)
{
    pd_sb_str(sb, ",\"logprobs\":");
    if (lp)
        pd_sb_add(sb, lp->p, lp->len);
    else
        pd_sb_str(sb, "null");
    pd_sb_str(sb, ",\"finish_reason\":");
    if (final) {
        pd_sb_printf(sb, "\"%s\",\"stop_reason\":", finish_reason(c));
        stop_reason_json(sb, c);
    } else {
        pd_sb_str(sb, null_stop_reason ? "null,\"stop_reason\":null" : "null");
    }
}

void srv_token_chunk(sreq *r, choice *c, const char *text, size_t len, bool final, const pd_sb *lp)
{
    bool chat = r->req.kind == PD_API_CHAT;
    pd_tool_delta td = {0};
    if (c->tools) {
        if (pd_tool_stream_feed(c->tools, text, len, final, &td) < 0) {
            srv_request_fail(r, 500, "out of memory parsing tool calls");
            return;
        }
        if (!final && !td.content && !td.n_calls) return; /* vLLM sends no chunk for it */
    }
    chunk_head(r);
    pd_sb_printf(&r->ev, "{\"index\":%d,", c->index);
    if (chat && c->tools) {
        pd_sb_str(&r->ev, "\"delta\":{");
        if (td.content) {
            pd_sb_str(&r->ev, "\"content\":");
            pd_sb_json_str(&r->ev, td.content, td.content_len);
        }
        if (td.n_calls) {
            if (td.content) pd_sb_str(&r->ev, ",");
            tool_deltas(&r->ev, &td);
        }
        pd_sb_str(&r->ev, "}");
    } else if (chat) {
        pd_sb_str(&r->ev, "\"delta\":{\"content\":");
        pd_sb_json_str(&r->ev, text, len);
        pd_sb_str(&r->ev, "}");
    }
    if (chat) {
        choice_tail(&r->ev, c, lp, final, false);
        pd_sb_str(&r->ev, "}]");
        if (r->req.continuous_usage) {
            pd_sb_str(&r->ev, ",\"usage\":");
            usage_obj(&r->ev, choice_prompt_tokens(r, c), c->completion_tokens, false, 0);
        }
        pd_sb_str(&r->ev, "}");
    } else {
        pd_sb_str(&r->ev, "\"text\":");
        if (!c->first_sent && r->req.echo) {
            /* echo: the prompt text, then the first token's text, in one string */
            pd_sb tmp = {0};
            const char *pt = r->req.prompts[c->prompt_idx].text;
            pd_sb_str(&tmp, pt ? pt : "");
            pd_sb_add(&tmp, text, len);
            pd_sb_json_str(&r->ev, tmp.p ? tmp.p : "", tmp.len);
            pd_sb_free(&tmp);
        } else {
            pd_sb_json_str(&r->ev, text, len);
        }
        choice_tail(&r->ev, c, lp, final, true);
        pd_sb_str(&r->ev, "}],\"usage\":");
        if (r->req.continuous_usage)
            usage_obj(&r->ev, choice_prompt_tokens(r, c), c->completion_tokens, true, 0);
        else
            pd_sb_str(&r->ev, "null");
        pd_sb_str(&r->ev, "}");
    }
    c->first_sent = true;
    srv_emit(r);
}

void srv_stream_start(sreq *r)
{
    if (r->streaming_started || !r->ex) return;
    r->streaming_started = true;
    if (r->req.kind == PD_API_GENERATE) {
        pd_http_stream_begin(r->ex, 200, "application/x-ndjson", r->hdr);
        return;
    }
    pd_http_stream_begin(r->ex, 200, "text/event-stream; charset=utf-8", r->hdr);
    if (r->req.kind != PD_API_CHAT) return;
    for (int i = 0; i < r->n_choices; i++) {
        chunk_head(r);
        pd_sb_printf(&r->ev, "{\"index\":%d,\"delta\":{\"role\":", i);
        pd_sb_json_str(&r->ev, r->req.role, strlen(r->req.role));
        pd_sb_str(&r->ev, ",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]");
        if (r->req.continuous_usage) {
            pd_sb_str(&r->ev, ",\"usage\":");
            usage_obj(&r->ev, choice_prompt_tokens(r, &r->choices[i]), 0, false, 0);
        }
        pd_sb_str(&r->ev, "}");
        srv_emit(r);
    }
    if (r->req.echo_text) {
        for (int i = 0; i < r->n_choices; i++) {
            chunk_head(r);
            pd_sb_printf(&r->ev, "{\"index\":%d,\"delta\":{\"content\":", i);
            pd_sb_json_str(&r->ev, r->req.echo_text, strlen(r->req.echo_text));
            pd_sb_str(&r->ev, "},\"logprobs\":null,\"finish_reason\":null}]}");
            srv_emit(r);
        }
    }
}

void srv_finish_stream(sreq *r)
{
    if (r->req.include_usage) {
        int64_t comp = 0;
        for (int i = 0; i < r->n_choices; i++) comp += r->choices[i].completion_tokens;
        chunk_head(r);
        pd_sb_str(&r->ev, "],\"usage\":");
        usage_obj(&r->ev, r->prompt_tokens, comp, false, cached_tokens(r));
        pd_sb_str(&r->ev, "}");
        srv_emit(r);
    }
    pd_sb_str(&r->out, "data: [DONE]\n\n");
}

/* Legacy /generate: the prompt + text of every choice, {"text": [...]} in Python's default
 * json.dumps style (stream lines, ending in \n) or compact (the non-streaming body). */
void srv_legacy_texts(sreq *r, pd_sb *b, bool python_style)
{
    pd_sb_str(b, python_style ? "{\"text\": [" : "{\"text\":[");
    for (int i = 0; i < srv_n_answer(r); i++) {
        choice *c = srv_answer(r, i);
        pd_sb_reset(&r->s->tokbuf);
        pd_sb_str(&r->s->tokbuf, r->req.prompts[c->prompt_idx].text);
        pd_sb_add(&r->s->tokbuf, c->text.p ? c->text.p : "", c->text.len);
        if (i) pd_sb_str(b, python_style ? ", " : ",");
        if (python_style)
            pd_sb_json_str_ascii(b, r->s->tokbuf.p, r->s->tokbuf.len);
        else
            pd_sb_json_str(b, r->s->tokbuf.p, r->s->tokbuf.len);
    }
    pd_sb_str(b, python_style ? "]}\n" : "]}");
}

int srv_n_answer(const sreq *r)
{
    return r->answer ? r->n_answer : r->n_choices;
}

choice *srv_answer(sreq *r, int i)
{
    return &r->choices[r->answer ? r->answer[i] : i];
}

void srv_respond_full(sreq *r)
{
    pd_apiserver *s = r->s;
    bool chat = r->req.kind == PD_API_CHAT;
    pd_sb *b = &r->ev;
    pd_sb_reset(b);
    if (r->req.kind == PD_API_GENERATE) {
        srv_legacy_texts(r, b, false);
        if (r->ex) pd_http_respond(r->ex, 200, "application/json", b->p, b->len, r->hdr);
        srv_end_exchange_ref(r);
        return;
    }
    pd_sb_printf(b, "{\"id\":\"%s%s\",\"object\":\"%s\",\"created\":%lld,\"model\":",
                 chat ? "chatcmpl-" : "cmpl-", r->id, chat ? "chat.completion" : "text_completion",
                 (long long)r->created);
    pd_sb_json_str(b, srv_model_name(s), strlen(srv_model_name(s)));
    pd_sb_str(b, ",\"choices\":[");
    int64_t comp = 0;
    for (int i = 0; i < srv_n_answer(r); i++) {
        choice *c = srv_answer(r, i);
        comp += c->completion_tokens;
        pd_sb_printf(b, "%s{\"index\":%d,", i ? "," : "", i);
        if (chat) {
            pd_tool_calls tc = {0};
            bool forced = r->req.tools_required || r->req.tool_named;
            const char *gen = c->text.p ? c->text.p : "";
            int rc = r->req.parse_tools ? pd_tool_extract(r->lim.tool_parser, gen, c->text.len,
                                                          srv_next_rand(s), &tc)
                     : forced ? pd_tool_extract_forced(r->req.tool_named, gen, c->text.len,
                                                       srv_next_rand(s), &tc)
                              : PD_OK;
            if (rc < 0) { /* vLLM: the answer fails validation as a list of calls: a 400 */
                char msg[320];
                snprintf(msg, sizeof msg, "tool_choice \"required\": %s (finish_reason \"%s\"%s)",
                         pd_last_error(), c->finish,
                         strcmp(c->finish, "length") == 0 ? ": max_tokens ended the answer first"
                                                          : "");
                srv_respond_error(r, rc == PD_ENOMEM ? 500 : 400,
                                  rc == PD_ENOMEM ? "out of memory parsing tool calls" : msg, NULL);
                return;
            }
            bool parsed = r->req.parse_tools || forced;
            const char *text = parsed ? tc.content : gen;
            size_t text_len = parsed ? tc.content_len : c->text.len;
            pd_sb_str(b, "\"message\":{\"role\":");
            pd_sb_json_str(b, r->req.role, strlen(r->req.role));
            pd_sb_str(b, ",\"content\":");
            pd_sb tmp = {0};
            if (r->req.echo_text) pd_sb_str(&tmp, r->req.echo_text);
            if (text) pd_sb_add(&tmp, text, text_len);
            if (text || r->req.echo_text)
                pd_sb_json_str(b, tmp.p ? tmp.p : "", tmp.len);
            else
                pd_sb_str(b, "null"); /* all of it was tool calls */
            pd_sb_free(&tmp);
            pd_sb_str(b, ",\"refusal\":null,\"annotations\":null,\"audio\":null,"
                         "\"function_call\":null,\"tool_calls\":[");
            for (size_t k = 0; k < tc.n; k++) {
                pd_sb_str(b, k ? ",{\"id\":" : "{\"id\":");
                pd_sb_json_str(b, tc.calls[k].id, strlen(tc.calls[k].id));
                pd_sb_str(b, ",\"type\":\"function\",\"function\":{\"name\":");
                pd_sb_json_str(b, tc.calls[k].name, strlen(tc.calls[k].name));
                pd_sb_str(b, ",\"arguments\":");
                pd_sb_json_str(b, tc.calls[k].arguments, strlen(tc.calls[k].arguments));
                pd_sb_str(b, "}}");
            }
            /* vLLM (as OpenAI): "tool_calls" when auto found calls, or when "required" stopped
             * after its calls; a named function keeps the generation's */
            const char *finish = tc.n && (r->req.parse_tools ||
                                          (r->req.tools_required && strcmp(c->finish, "stop") == 0))
                                     ? "tool_calls"
                                     : c->finish;
            pd_tool_calls_free(&tc);
            pd_sb_str(b, "],\"reasoning_content\":null},\"logprobs\":");
            if (r->req.sp.logprobs >= 0)
                srv_lp_object(b, true, c->lp);
            else
                pd_sb_str(b, "null");
            pd_sb_str(b, ",");
            pd_sb_printf(b, "\"finish_reason\":\"%s\",\"stop_reason\":", finish);
            stop_reason_json(b, c);
            pd_sb_str(b, "}");
        } else {
            pd_sb_str(b, "\"text\":");
            pd_sb tmp = {0};
            if (r->req.echo) pd_sb_str(&tmp, r->req.prompts[c->prompt_idx].text);
            pd_sb_add(&tmp, c->text.p ? c->text.p : "", c->text.len);
            pd_sb_json_str(b, tmp.p ? tmp.p : "", tmp.len);
            pd_sb_free(&tmp);
            pd_sb_str(b, ",\"logprobs\":");
            if (r->req.sp.logprobs >= 0)
                srv_lp_object(b, false, c->lp);
            else
                pd_sb_str(b, "null");
            pd_sb_printf(b, ",\"finish_reason\":\"%s\",\"stop_reason\":", c->finish);
            stop_reason_json(b, c);
            pd_sb_str(b, ",\"prompt_logprobs\":");
            prompt_logprobs_json(r, b, c);
            pd_sb_str(b, "}");
        }
    }
    pd_sb_str(b, "],\"service_tier\":null,\"system_fingerprint\":null,\"usage\":");
    usage_obj(b, r->prompt_tokens, comp, true, cached_tokens(r));
    if (chat) { /* one prompt: its first choice's */
        pd_sb_str(b, ",\"prompt_logprobs\":");
        prompt_logprobs_json(r, b, r->n_choices ? &r->choices[0] : NULL);
    }
    pd_sb_str(b, ",\"kv_transfer_params\":null}");
    if (pd_sb_failed(b)) {
        srv_respond_error(r, 500, "out of memory building the response", NULL);
        return;
    }
    if (r->ex) pd_http_respond(r->ex, 200, "application/json", b->p, b->len, r->hdr);
    srv_end_exchange_ref(r);
}
