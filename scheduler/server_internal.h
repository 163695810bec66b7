/* pd-scheduler internals shared by apiserver.c and the server_*.c files: the state of a request
 * (sreq, and one choice per sequence it generates), the api-server itself, and what one part
 * calls in another (prefix srv_). Not a public header: apiserver.h is.
 *
 * Threads and ownership:
 * - The libuv loop thread owns sockets, every sreq's client-facing state and its arena.
 * - The gRPC client thread runs each choice's chain Reserve(D) -> Prefill(P) -> Decode(D). It
 *   only reads what the loop built before the chain started (prompt ids, packed sampling
 *   parameters, decode targets) and appends results to the choice's pending records under the
 *   request's mutex, then puts the request on the ready list and wakes the loop (uv_async; the
 *   callback drains the whole list).
 * - Reference counts are touched on the loop thread only: one for the HTTP exchange, one per
 *   running chain (dropped when the loop sees the chain's last record). The request and its
 *   arena are freed in one place, when the count reaches zero.
 * Pending records are double-buffered (swap under the mutex), so the relay allocates nothing per
 * token once the buffers have grown to their working size.
 *
 * Design: one file per concern, as a server splits into http / queue / task / context:
 * server_routes.c (HTTP routes, parsing on the threadpool), server_request.c (a request's life
 * on the loop), server_admission.c (the wait for decode KV capacity), server_chain.c (the calls
 * to the instances), server_relay.c (token events in, backpressure out), server_response.c
 * (response bodies), server_metrics.c (/metrics), apiserver.c (start-up and shutdown).
 */
#ifndef PD_SCHEDULER_SERVER_INTERNAL_H
#define PD_SCHEDULER_SERVER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "api.h"
#include "apiserver.h"
#include "http/http_server.h"
#include "metrics/metrics.h"
#include "registry.h"
#include "sbuf.h"
#include "util/idmap.h"

/* ---- per-request state -------------------------------------------------------------------- */

typedef struct {
    size_t text_off, text_len; /* into the pending text buffer */
    int n_tokens;              /* 0 or 1 */
    bool final;
    char finish[8]; /* "stop", "length" or "" */
    int stop_kind;  /* 0 null, 1 token, 2 string */
    int32_t stop_token;
    size_t stop_off, stop_len; /* stop string, into the pending text buffer */
    int64_t prompt_tokens;
    int32_t token; /* the sampled id (when n_tokens > 0) */
    bool has_logprob;
    float logprob;
    size_t top_off, n_top; /* into the pending top arrays */
} tok_rec;

typedef struct {
    tok_rec *recs;
    size_t n, cap;
    pd_sb text;       /* token texts and stop strings of recs */
    int32_t *top_ids; /* (cap_top,) top logprob ids of recs */
    float *top_lps;   /* (cap_top,) their logprobs */
    size_t n_top, cap_top;
} rec_buf;

typedef struct sreq sreq;

/* A request body parsed on the libuv threadpool (srv_parse_submit); work first, so the pointer
 * libuv passes back is the job's. */
typedef struct srv_parse_job {
    uv_work_t work; /* work.data: the caller's */
    size_t bytes;   /* the body's size, counted in pd_apiserver.parse_bytes until done */
    uv_work_cb fn;
    uv_after_work_cb done;
    struct srv_parse_job *next; /* in the large-body queue */
} srv_parse_job;

enum { PH_RESERVE = 0, PH_PREFILL = 1, PH_DECODE = 2 };

typedef struct choice {
    sreq *r;
    int index; /* choice index = prompt_idx * n + i */
    int prompt_idx;
    char sub_id[48]; /* request id the nodes see */
    /* set by the loop before the chain starts; read-only afterwards */
    int d_node;
    /* the decode instance this choice failed on last (-1: none): the retry goes elsewhere
       when another one is up */
    int d_avoid;
    int64_t d_tokens; /* charged to d_node in the registry (srv_pick_for) */
    Pd__DecodeTarget **targets;
    size_t n_targets;
    Pd__SamplingParams sampling; /* arrays in the request arena */
    /* chain state: rpc thread (and the loop under r->mu for cancellation) */
    int p_node;       /* under r->mu */
    int64_t p_tokens; /* charged to p_node (srv_pick_for), 0 once given back */
    int attempts;
    uint64_t call_id[3]; /* per phase, under r->mu */
    bool in_phase[3];
    int32_t *block_ids; /* malloc'd copy of the reservation (rpc thread) */
    size_t n_block_ids;
    int64_t decode_cached; /* leading prompt tokens whose KV the reservation holds already */
    /* results: under r->mu */
    rec_buf pending;
    bool chain_done; /* the chain posted its last record */
    int err_http;    /* 0, or the status of a failure */
    char err[256];
    int64_t kv_bytes;
    char kv_transport[16]; /* what carried them (the Prefill reply's), "" when not said */
    double kv_seconds, prefill_seconds;
    int64_t cached_tokens;   /* of its prompt, found in the prefill instance's prefix cache */
    Pd__PromptLogprobs *plp; /* its prompt's logprobs from the Prefill reply (sampling
                                prompt_logprobs >= 0), unpacked; read by the loop once the first
                                record is taken; freed with the request */
    bool kv_reported;
    bool admit_wait;    /* Reserve was refused for lack of KV: the loop queues the choice */
    bool reserve_retry; /* Reserve found its decode instance gone: the loop picks another */
    bool decode_lost;   /* its decode instance left the routing set while it prefilled */
    bool rx_paused;     /* its Decode stream waits until the loop has taken the pending records */
    bool relayed;       /* its events come over the decode instance's relay (under r->mu) */
    bool final_rx;      /* its (a leader's: every) final event arrived (under r->mu) */
    uint64_t rx_bytes;  /* relayed: packed event bytes received (under r->mu) */
    uint64_t credit;    /* relayed: packed event bytes the node may send in all (under r->mu) */
    uint64_t pause_seq; /* relayed: Pause calls sent (under r->mu) */
    pd_idmap_link map_link; /* in the rpc thread's request-id map (cmap), keyed by sub_id */
    bool mapped;
    int reserve_tries; /* decode instances tried after the first (rpc thread) */
    bool local;        /* its decode instance prefills it (--max-local-prefill-length); set by
                          the loop before its Reserve */
    bool admitted;     /* a retried Reserve succeeded */
    /* admission queue (loop thread) */
    bool in_queue, retrying;
    struct choice *q_prev, *q_next;
    bool deferred; /* an n > 1 follower waiting for its leader (see server_request.c) */
    /* beam search: one chain per prompt, its leader's, answers the prompt's n choices; the
     * others ride on it (no chain of their own), their events routed by TokenEvent.index */
    bool rides;
    int n_riders;  /* the leader's: the choices after it that its events reach (n - 1) */
    int finals_rx; /* final events its chain delivered (under r->mu) */
    /* loop side */
    rec_buf work;
    bool chain_running; /* holds a reference */
    bool finished;
    char finish[8];
    int stop_kind;
    int32_t stop_token;
    char *stop_string; /* malloc'd */
    int64_t completion_tokens;
    double cum_logprob; /* of its sampled tokens, when their logprobs came (best_of > n) */
    pd_sb text;         /* non-streaming: the whole text */
    int64_t text_cps;   /* code points of the token strings listed so far: a completions
                           logprob's text_offset (the previous one + its token's length, as
                           vLLM counts; a byte token held back still counts its "\ufffd") */
    pd_sb lp[4];        /* non-streaming logprobs: completions text_offset, token_logprobs,
                         * tokens, top_logprobs items; chat: lp[0] holds the content items */
    bool first_sent;    /* streaming: this choice's first chunk went out */
    bool echo_lp_done;  /* completions echo + logprobs: the prompt's items were listed */
    /* streaming with tool parsing (pd_api_request.parse_tools): its parser, or NULL */
    pd_tool_stream *tools;
    int64_t last_tok_ns;
    int32_t *gen; /* the generated ids (malloc'd; NULL after a failed growth), for note_decode */
    size_t n_gen, cap_gen;
} choice;

struct sreq {
    pd_apiserver *s;
    pd_http_exchange *ex; /* NULL once the exchange has ended */
    pd_arena *a;
    pthread_mutex_t mu;
    int refs;    /* loop thread only */
    bool queued; /* on the ready list (under s->qmu) */
    sreq *next_ready;
    sreq *prev, *next; /* live list (loop thread) */
    bool aborted;      /* under mu: the chain must not start new calls */
    char id[33];
    char hdr[80]; /* "X-Request-Id: ...\r\n" */
    int64_t created;
    int64_t t_accept, t_prefill, t_first, t_last;
    pd_api_request req;
    int n_choices;
    choice *choices;
    int *answer; /* best_of > n: the choices answered, in order (n per prompt), from the
                    request's arena; NULL: every choice */
    int n_answer;
    int64_t prompt_tokens; /* summed over prompts, each once */
    bool streaming_started;
    bool done;    /* the response was completed or failed */
    bool counted; /* counts against --max-concurrent-requests */
    bool waiting; /* counted in num_requests_waiting */
    bool running; /* counted in num_requests_running */
    int n_queued; /* choices waiting in the admission queue */
    pd_sb out;    /* unsent stream bytes (backpressure) */
    bool paused;  /* the decode streams are paused until out drains */
    pd_sb ev;     /* scratch for one event */
    bool drain_registered;
    /* parsing on the libuv threadpool (tokenization and templates never block the loop) */
    srv_parse_job work;
    pd_api_kind kind;
    pd_api_limits lim; /* a copy for the worker */
    char *body;        /* (body_len,) the request body, taken from the exchange; malloc'd, freed
                          once parsed */
    size_t body_len;
    int parse_rc, parse_http;
    char parse_err[1024];
};

/* The Relay stream on one decode instance (see server_relay.c); under pd_apiserver.rl_mu. */
typedef struct {
    bool open; /* started and not ended: DecodeRequests name it */
    int gen;   /* bumped per stream: a closed stream's callback leaves a newer one alone */
    char id[48];
    uint64_t call_id;
} relay_st;

enum { CMAP_BUCKETS = 4096 };

struct pd_apiserver {
    pd_apiserver_params p;
    uv_loop_t loop;
    uv_async_t async;
    uv_signal_t sig_int, sig_term;
    bool signals;
    pd_http_server *http;
    int port;
    pd_rpc_client *rpc;
    pd_reg *reg;
    pd_tok *tok;
    pd_gvocab *gvocab; /* the tokenizer's bytes, for lim.grammars */
    pd_chat_template *tmpl;
    pd_chat_template *tmpl_tools; /* the model's 'tool_use' template, or NULL (§13.1) */
    json_t *chat_vars;
    json_t *default_kwargs; /* --default-chat-template-kwargs, or NULL */
    pd_generation_config gen;
    pd_api_limits lim;
    int64_t L;
    int32_t vocab;
    /* ready list (rpc thread -> loop) */
    pthread_mutex_t qmu;
    sreq *ready_head, *ready_tail;
    bool closing;       /* under qmu: the loop is gone; posts are dropped */
    bool wake_pending;  /* under qmu: posted from the rpc thread, the loop not yet woken */
    uint8_t *went_down; /* (n instances,) under qmu: left the routing set, not yet handled */
    pthread_mutex_t rl_mu;
    relay_st *relays;   /* (n instances,) under rl_mu */
    char relay_tag[17]; /* this process's part of relay ids */
    pd_idmap cmap;      /* rpc thread: relayed choices by sub_id */
    bool any_down;      /* under qmu */
    atomic_bool shutdown_requested;
    bool stopping;          /* loop: shutdown in progress (new requests get 503, /health 503) */
    bool halted;            /* loop: past the drain: everything is being closed */
    int64_t drain_deadline; /* loop: when the drain ends (pd_now_ns) */
    uv_timer_t drain_timer;
    sreq *live;       /* loop thread */
    int64_t inflight; /* requests counted against the limit (loop thread) */
    /* admission queue (loop thread): choices waiting for decode KV capacity, oldest first; only
     * the head is retried, one Reserve at a time */
    choice *admit_head, *admit_tail;
    bool admit_busy; /* the head's retry is in flight */
    bool admit_kick; /* capacity may have been freed: retry the head after this round */
    uv_timer_t admit_timer;
    bool admit_timer_on;
    /* request bodies being parsed (srv_parse_submit): their bytes, and the large ones waiting for
     * the one large-body worker */
    size_t parse_bytes;
    bool big_running;
    srv_parse_job *big_head, *big_tail;
    uint64_t rng;
    /* metrics */
    pd_metrics *m;
    pd_metric *m_cache_q, *m_cache_h;
    int64_t cache_q_seen, cache_h_seen;
    pd_metric *m_spec_drafts, *m_spec_draft_tokens, *m_spec_accepted, *m_spec_pos;
    pd_reg_spec spec_seen; /* what the vllm:spec_decode_* counters hold */
    pd_metric *m_running, *m_waiting, *m_kv, *m_gpu_kv, *m_preempt, *m_prompt, *m_gen, *m_success,
        *m_h_prompt, *m_h_gen, *m_h_n, *m_h_max, *m_ttft, *m_tpot, *m_e2e, *m_queue, *m_prefill,
        *m_decode, *m_infer, *m_kv_bytes, *m_kv_secs, *m_up, *m_unsent, *m_iter, *m_h_best_of,
        *m_h_max_gen, *m_itl, *m_req_tpot, *m_cache_info, *m_stage;
    int64_t preempt_seen;
    int64_t steps_seen[PD_ENGINE_STEP_BINS], steps_sum_seen; /* what m_iter holds */
    pd_sb tokbuf, lpbuf[4]; /* loop-thread scratch for logprob token texts and fragments */
    const char *labels[2];  /* model_name, engine */
};

/* What stopping or resuming a choice's events takes, decided under r->mu (srv_flow_plan) and done
 * after it is released (srv_flow_apply): a Decode stream that carries the events is paused where it
 * is read, so HTTP/2 flow control holds the node's sends back; a relayed choice's node stops by
 * itself when its credit runs out, and a Pause call grants more while the client keeps up. */
typedef struct {
    uint64_t call_id;
    bool relayed, paused, send;
    uint64_t seq, credit;
} flow_op;

/* The first choice of c's prompt: a beam search's leader, whose chain carries c's events. */
static inline choice *srv_leader(const sreq *r, const choice *c)
{
    return &r->choices[c->index - c->index % r->req.best_of];
}

/* ---- server_chain.c (rpc thread) ------------------------------------------------------------ */

/* Puts r on the ready list for the loop (any thread; from the rpc thread the wake-up waits for
 * the end of the burst, srv_on_rpc_idle). */
void srv_post_ready(sreq *r);
/* The rpc client's idle hook: wakes the loop once for a burst of callbacks. */
void srv_on_rpc_idle(void *arg);
/* pd_reg_pick_cached for c's prompt on role (not exclude): the tokens the request brings there
 * (prefill: the prompt; decode: the prompt and max_tokens) less those the instance's cache likely
 * holds are charged to it, *charged: that, for pd_reg_release. */
int srv_pick_for(pd_apiserver *s, const choice *c, rt_role role, int exclude, int64_t *charged);
/* c's chain posted its last record. */
void srv_chain_end(choice *c);
/* A done callback that ignores the result. */
void srv_noop_done(void *arg, int st, const char *d, const uint8_t *resp, size_t len);
/* Fire-and-forget Abort of sub_id on node k. */
void srv_send_abort(pd_apiserver *s, int k, const char *sub_id);
/* Asks c's decode instance to reserve the prompt's KV (the first step of the chain). */
void srv_send_reserve(choice *c);
/* The request id the nodes see for choice i of r after `tries` decode retries: r's id, "-i"
 * when r has several choices, ".tries" after a retry (so a late Abort of the last try's id
 * cannot reach the next try's reservation; left out where the id would grow past what the
 * nodes take). */
void srv_choice_sub_id(const sreq *r, int i, int tries, char *out, size_t cap);
/* --prefill-timeout in milliseconds: the Prefill call's deadline and the reservation's TTL. */
static inline int srv_prefill_timeout_ms(const pd_apiserver *s)
{
    return (int)(s->p.prefill_timeout_s * 1000 + 0.5);
}

/* ---- server_relay.c (rpc thread, flow control from the loop) --------------------------------- */

void srv_rec_buf_free(rec_buf *b);
/* Appends one token event to b (rpc thread, under r->mu): a record per token (a beam search's
 * answer carries all its tokens at once). */
void srv_rec_push(rec_buf *b, const Pd__TokenEvent *ev);
/* The rpc thread's map of relayed choices by sub_id. */
void srv_cmap_add(pd_apiserver *s, choice *c);
void srv_cmap_del(pd_apiserver *s, choice *c);
/* The relay id of decode instance k for a new request (out: 48 bytes), opening the stream when
 * none is open; "" when it could not be opened. */
void srv_relay_for(pd_apiserver *s, int k, char *out);
/* Packed event bytes c's decode instance may send ahead (DecodeRequest.relay_credit). */
uint64_t srv_choice_credit(const choice *c);
flow_op srv_flow_plan(choice *c, bool paused);
void srv_flow_apply(choice *c, const flow_op *op);
/* The message callback of a Decode stream that carries its events itself. */
void srv_on_decode_msg(void *arg, const uint8_t *msg, size_t len);

/* ---- server_request.c (loop thread) ---------------------------------------------------------- */

/* Starts the chain of every choice of a parsed, admitted request; on a routing failure 503. */
void srv_dispatch(sreq *r);
/* The ready list's uv_async callback: lost instances, then every posted request. */
void srv_on_async(uv_async_t *h);
/* The registry's on_change (heartbeat thread). */
void srv_on_instance_change(void *arg, int k, bool up);
/* The HTTP exchange's abort callback: the client disconnected. */
void srv_on_client_abort(void *arg);
/* Aborts every chain of r (cancels calls, sends Abort to P and D). */
void srv_abort_chains(sreq *r);
/* A failure of the request: HTTP error before the first event, in-band error after it. */
void srv_request_fail(sreq *r, int status, const char *msg);
/* Answers an error before dispatch: counts the request out, then ends the exchange (which may
 * free r). */
void srv_reject(sreq *r, int status, const char *msg, const char *extra);
void srv_respond_error(sreq *r, int status, const char *msg, const char *extra);
/* Drops the exchange's reference; call right after the exchange ended (it is freed then). */
void srv_end_exchange_ref(sreq *r);
void srv_sreq_unref(sreq *r);
/* Frees r and its arena (the one place; srv_sreq_unref calls it at zero references). */
void srv_sreq_free(sreq *r);

/* ---- server_routes.c (loop thread) ----------------------------------------------------------- */

/* Runs fn on the threadpool, then done on the loop, for a request body of bytes: counted in
 * s->parse_bytes meanwhile; a body of SRV_BIG_BODY bytes or more waits for the one large body
 * being parsed, so large bodies never take the threads that small requests need. */
void srv_parse_submit(pd_apiserver *s, srv_parse_job *j, size_t bytes, uv_work_cb fn,
                      uv_after_work_cb done);
#define SRV_BIG_BODY ((size_t)1 << 20)

/* ---- server_admission.c (loop thread) -------------------------------------------------------- */

/* Puts c in the admission queue (at the front when it was the head being retried); it gives
 * back its prefill charge meanwhile (the pump picks again). */
void srv_admit_wait(pd_apiserver *s, choice *c, bool front);
/* Picks c's prefill instance and sends its Reserve now; or queues c behind the choices already
 * waiting, or when no prefill instance has room for its prompt (server_admission.c); or, none
 * being up, fails the request with 503. */
void srv_admit_or_reserve(pd_apiserver *s, choice *c);
void srv_admit_unlink(pd_apiserver *s, choice *c);
/* Retries the head of the admission queue. */
void srv_admit_pump(pd_apiserver *s);

/* ---- server_response.c (loop thread) --------------------------------------------------------- */

const char *srv_model_name(const pd_apiserver *s);
/* Moves the event built in r->ev to r->out as an SSE "data:" line. */
void srv_emit(sreq *r);
/* Status line, headers and (chat) the role and echo chunks: sent with the first event. */
void srv_stream_start(sreq *r);
/* One token chunk of choice c with text (len bytes); final adds finish and stop reasons.
 * lp: the chunk's logprobs object, or NULL for null. */
void srv_token_chunk(sreq *r, choice *c, const char *text, size_t len, bool final, const pd_sb *lp);
/* The usage chunk (stream_options.include_usage) and [DONE]. */
void srv_finish_stream(sreq *r);
/* Legacy /generate: {"text": [...]} of every choice (python_style: a stream line). */
void srv_legacy_texts(sreq *r, pd_sb *b, bool python_style);
/* The choices of the answer: every choice, or with best_of > n the picked ones (r->answer), in
 * the order they are answered (their index in the response). */
int srv_n_answer(const sreq *r);
choice *srv_answer(sreq *r, int i);
/* The non-streaming response. */
void srv_respond_full(sreq *r);
/* Appends token t's logprob items to out[0..3]; srv_lp_object wraps them. */
void srv_lp_items(sreq *r, choice *c, const rec_buf *w, const tok_rec *t, pd_sb out[4]);
void srv_lp_object(pd_sb *b, bool chat, pd_sb items[4]);
/* Completions echo + logprobs: appends the items of c's prompt tokens to out[0..3] (the first
 * token's logprob and top entries null), once, before its first generated token's. */
void srv_lp_prompt_items(sreq *r, choice *c, pd_sb out[4]);

/* ---- server_routes.c, server_metrics.c (loop thread) ----------------------------------------- */

void srv_on_http(void *ctx, pd_http_exchange *ex);
int srv_on_headers(void *ctx, const pd_http_exchange *ex, char *message, size_t msg_cap,
                   char *extra, size_t extra_cap);
void srv_on_refused(void *ctx, const pd_http_exchange *ex, int status, const char *message,
                    char *extra, size_t extra_cap);
uint64_t srv_next_rand(pd_apiserver *s);
int srv_metrics_init(pd_apiserver *s);
void srv_handle_metrics(pd_apiserver *s, pd_http_exchange *ex);

/* ---- apiserver.c (loop thread) --------------------------------------------------------------- */

/* SIGTERM, SIGINT or pd_apiserver_shutdown: the drain (a second one stops at once). */
void srv_begin_drain(pd_apiserver *s);

#endif
