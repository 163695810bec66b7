/* pd-scheduler: the api-server's entry points (apiserver.h): default parameters, start-up, the
 * loop, and shutdown.
 *
 * Design: start-up reads and checks everything that can be wrong (model files, ranktables,
 * NODE_PORTS, the host table) before the port is bound, so a bad launch fails at once with a
 * message that names the file, field or flag. Shutdown is a drain: new requests get 503 while
 * those in flight may finish for --shutdown-timeout, then the rest fail and the HTTP server
 * closes; libuv handles are freed only once their close callbacks have run.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "json/json.h"
#include "model/config.h"
#include "server_internal.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

pd_apiserver_params pd_apiserver_default_params(void)
{
    pd_apiserver_params p;
    memset(&p, 0, sizeof p);
    p.host = "0.0.0.0";
    p.port = 8000;
    p.max_concurrent_requests = 4096;
    p.max_request_body_bytes = 16 * 1024 * 1024;
    p.queue_timeout_s = 600;
    p.keep_alive_s = 5;
    p.header_timeout_s = 10;
    p.body_timeout_s = 60;
    p.response_role = "assistant";
    p.max_logprobs = 20;
    p.use_openai = true;
    p.heartbeat_ms = 1000;
    p.rpc_timeout_ms = 5000;
    p.prefill_timeout_s = 60;
    p.shutdown_timeout_s = 30;
    return p;
}

/* The _host local table must be the scheduler of the global table. */
static int check_host_table(const pd_apiserver_params *p, const rt_global *g)
{
    if (!p->local_ranktable || !*p->local_ranktable) return PD_OK;
    rt_local *l = NULL;
    PD_CHECK(rt_local_load_file(p->local_ranktable, 0, NULL, &l));
    int rc = PD_OK;
    const rt_instance *mine = rt_local_instance(l), *sch = rt_global_scheduler(g);
    if (!rt_local_is_host(l))
        rc = pd_error(PD_EINVAL, "RANK_TABLE_FILE_PATH=%s: not a scheduler (_host) table",
                      p->local_ranktable);
    else if (!sch || strcmp(mine->server_id, sch->server_id) != 0 ||
             strcmp(mine->server_ip, sch->server_ip) != 0)
        rc = pd_error(PD_EINVAL,
                      "RANK_TABLE_FILE_PATH=%s: server %s (%s) is not the scheduler of %s",
                      p->local_ranktable, mine->server_id, mine->server_ip, p->global_ranktable);
    rt_local_free(l);
    return rc;
}

static int load_model(pd_apiserver *s)
{
    const pd_apiserver_params *p = &s->p;
    char path[4096];
    const char *tok_dir = p->tokenizer ? p->tokenizer : p->model; /* as vLLM's --tokenizer */
    PD_CHECK(pd_tok_load(tok_dir, &s->tok));
    snprintf(path, sizeof path, "%s/config.json", p->model);
    pd_model_config cfg;
    PD_CHECK(pd_model_config_load(path, &cfg));
    s->vocab = (int32_t)cfg.vocab_size;
    if (pd_tok_vocab_size(s->tok) > s->vocab) s->vocab = pd_tok_vocab_size(s->tok);
    s->L = p->max_model_len;
    PD_CHECK(pd_model_resolve_max_len(&cfg, &s->L)); /* as the instances check it */
    s->gen = pd_generation_config_default();
    snprintf(path, sizeof path, "%s/generation_config.json", p->model);
    if (access(path, F_OK) == 0) PD_CHECK(pd_generation_config_load(path, &s->gen));
    /* chat template: a model without one still serves completions */
    char *src = NULL, *what = NULL, *tsrc = NULL, *twhat = NULL;
    int rc = pd_chat_select(tok_dir, p->chat_template, false, &src, &what);
    if (rc == PD_OK) rc = pd_chat_select(tok_dir, p->chat_template, true, &tsrc, &twhat);
    if (rc == PD_OK && src) rc = pd_chat_compile(src, what, &s->tmpl);
    if (rc == PD_OK && src && tsrc && strcmp(tsrc, src) != 0) /* a list with a 'tool_use' entry */
        rc = pd_chat_compile(tsrc, twhat, &s->tmpl_tools);
    free(src);
    free(what);
    free(tsrc);
    free(twhat);
    PD_CHECK(rc);
    if (!s->tmpl) PD_WARN(NULL, "the model has no chat template: chat requests get 400");
    PD_CHECK(pd_chat_config_vars(pd_tok_config(s->tok), &s->chat_vars));
    if (p->default_chat_template_kwargs) {
        PD_CHECK(pdj_loads(p->default_chat_template_kwargs, strlen(p->default_chat_template_kwargs),
                           "--default-chat-template-kwargs", &s->default_kwargs));
        if (!json_is_object(s->default_kwargs))
            return pd_error(PD_EINVAL, "--default-chat-template-kwargs: must be a JSON object");
    }
    pd_api_limits *l = &s->lim;
    l->served_names = s->p.served_names;
    l->n_served_names = s->p.n_served_names;
    l->max_model_len = s->L;
    l->vocab = s->vocab;
    l->max_logprobs = p->max_logprobs;
    l->defaults = p->generation_config_vllm ? pd_sampling_default_params()
                                            : pd_sampling_model_params(&s->gen);
    l->max_new_tokens = // a row of the table --generation-config vllm skips (contract §7.1)
        !p->generation_config_vllm && s->gen.has_max_new_tokens ? s->gen.max_new_tokens : -1;
    l->response_role = p->response_role;
    l->tok = s->tok;
    l->chat_template = s->tmpl;
    l->chat_template_tools = s->tmpl_tools;
    l->chat_config_vars = s->chat_vars;
    l->trust_request_template = p->trust_request_chat_template;
    l->default_kwargs = s->default_kwargs;
    /* structured output: specs are compiled here once to refuse what cannot be enforced */
    PD_CHECK(pd_gvocab_from_tok(s->tok, NULL, 0, &s->gvocab));
    if (!(l->grammars = pd_gcache_create(s->gvocab, PD_API_GRAMMAR_CACHE)))
        return pd_error(PD_ENOMEM, "out of memory");
    /* vLLM's start-up checks of auto tool choice */
    if (p->enable_auto_tool_choice && !p->tool_call_parser)
        return pd_error(PD_EINVAL, "--enable-auto-tool-choice requires --tool-call-parser "
                                   "(hermes, llama3_json or mistral)");
    if (p->tool_call_parser) {
        PD_CHECK(pd_tool_kind_from_name(p->tool_call_parser, &l->tool_parser));
        const char *need = pd_tool_required_token(l->tool_parser);
        if (need && pd_tok_token_to_id(s->tok, need, strlen(need)) < 0)
            return pd_error(PD_EINVAL,
                            "--tool-call-parser %s: the tokenizer of %s has no %s token, which "
                            "this parser looks for",
                            p->tool_call_parser, tok_dir, need);
        l->auto_tools = p->enable_auto_tool_choice;
    }
    if (!p->generation_config_vllm)
        PD_INFO(NULL,
                "generation config defaults: temperature %g top_p %g top_k %d min_p %g "
                "repetition_penalty %g max_new_tokens %lld",
                l->defaults.temperature, l->defaults.top_p, l->defaults.top_k, l->defaults.min_p,
                l->defaults.repetition_penalty, (long long)l->max_new_tokens);
    return PD_OK;
}

size_t pd_apiserver_body_bytes_in_flight(const pd_apiserver_params *p)
{
    if (p->max_body_bytes_in_flight > 0) return (size_t)p->max_body_bytes_in_flight;
    uint64_t one = (uint64_t)p->max_request_body_bytes;
    return one > SIZE_MAX / 4 ? SIZE_MAX : (size_t)(4 * one);
}

int pd_apiserver_create(const pd_apiserver_params *p, pd_apiserver **out)
{
    *out = NULL;
    if (!p->model) return pd_error(PD_EINVAL, "--model is required");
    if (p->max_body_bytes_in_flight > 0 && p->max_body_bytes_in_flight < p->max_request_body_bytes)
        return pd_error(PD_EINVAL,
                        "--max-body-bytes-in-flight %lld is below --max-request-body-bytes %lld: "
                        "a body of the largest size could never be received",
                        (long long)p->max_body_bytes_in_flight,
                        (long long)p->max_request_body_bytes);
    pd_apiserver *s = calloc(1, sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "out of memory");
    s->p = *p;
    if (pd_idmap_init(&s->cmap, CMAP_BUCKETS) < 0) {
        free(s);
        return PD_ENOMEM;
    }
    if (s->p.n_served_names == 0) {
        s->p.served_names[0] = s->p.model;
        s->p.n_served_names = 1;
    }
    pthread_mutex_init(&s->qmu, NULL);
    pthread_mutex_init(&s->rl_mu, NULL);
    s->rng = (uint64_t)pd_wall_ns() ^ ((uint64_t)getpid() << 32);
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd >= 0) {
        uint64_t x;
        if (read(fd, &x, sizeof x) == (ssize_t)sizeof x) s->rng ^= x;
        close(fd);
    }
    uv_loop_init(&s->loop);
    s->loop.data = s; /* for the threadpool's callbacks (srv_parse_submit) */
    s->async.data = s;
    uv_async_init(&s->loop, &s->async, srv_on_async);
    s->admit_timer.data = s;
    uv_timer_init(&s->loop, &s->admit_timer);
    s->drain_timer.data = s;
    uv_timer_init(&s->loop, &s->drain_timer);
    int rc;
    PD_CHECK_GOTO(load_model(s), rc, fail);
    PD_CHECK_GOTO(pd_rpc_client_create(&s->rpc), rc, fail);
    pd_rpc_client_set_idle_hook(s->rpc, srv_on_rpc_idle, s);
    PD_CHECK_GOTO(pd_reg_create(p->global_ranktable, p->node_ports, s->rpc, &s->reg), rc, fail);
    PD_CHECK_GOTO(check_host_table(p, pd_reg_global(s->reg)), rc, fail);
    s->went_down = calloc((size_t)pd_reg_count(s->reg), 1);
    s->relays = calloc((size_t)pd_reg_count(s->reg), sizeof *s->relays);
    snprintf(s->relay_tag, sizeof s->relay_tag, "%016llx", (unsigned long long)srv_next_rand(s));
    if (!s->went_down || !s->relays) {
        rc = pd_error(PD_ENOMEM, "out of memory");
        goto fail;
    }
    PD_CHECK_GOTO(srv_metrics_init(s), rc, fail);
    pd_http_params hp = pd_http_default_params();
    hp.host = p->host;
    hp.port = p->port;
    hp.max_body_bytes = (size_t)p->max_request_body_bytes;
    hp.max_body_in_flight = pd_apiserver_body_bytes_in_flight(p);
    hp.idle_timeout_ms = (int)(p->keep_alive_s * 1000 + 0.5);
    hp.header_timeout_ms = (int)(p->header_timeout_s * 1000 + 0.5);
    hp.body_timeout_ms = (int)(p->body_timeout_s * 1000 + 0.5);
    PD_CHECK_GOTO(pd_http_server_start(&s->loop, &hp, srv_on_http, s, &s->http), rc, fail);
    pd_http_server_on_headers(s->http, srv_on_headers);
    pd_http_server_on_refused(s->http, srv_on_refused);
    s->port = pd_http_server_port(s->http);
    pd_reg_set_max_model_len(s->reg, s->L); /* an instance with a smaller L stays out */
    PD_CHECK_GOTO(pd_reg_start(s->reg, p->heartbeat_ms, p->heartbeat_ms, srv_on_instance_change, s),
                  rc, fail);
    PD_INFO(NULL, "pd-scheduler listening on %s:%d (model %s, max-model-len %lld, %d instances)",
            p->host, s->port, s->p.served_names[0], (long long)s->L, pd_reg_count(s->reg));
    *out = s;
    return PD_OK;
fail:
    pd_apiserver_free(s);
    return rc;
}

int pd_apiserver_port(const pd_apiserver *s)
{
    return s->port;
}

static void on_http_stopped(void *arg)
{
    pd_apiserver *s = arg;
    s->http = NULL;
    /* from here on the rpc and heartbeat threads must not touch the async handle */
    pthread_mutex_lock(&s->qmu);
    s->closing = true;
    pthread_mutex_unlock(&s->qmu);
    uv_close((uv_handle_t *)&s->async, NULL);
    uv_close((uv_handle_t *)&s->admit_timer, NULL);
    uv_close((uv_handle_t *)&s->drain_timer, NULL);
    if (s->signals) {
        uv_close((uv_handle_t *)&s->sig_int, NULL);
        uv_close((uv_handle_t *)&s->sig_term, NULL);
    }
}

/* The end of a shutdown: whatever is still in flight is aborted, the HTTP server closes. */
static void begin_stop(pd_apiserver *s)
{
    if (s->halted) return;
    s->halted = s->stopping = true;
    uv_timer_stop(&s->drain_timer);
    for (sreq *r = s->live; r; r = r->next) srv_abort_chains(r);
    if (s->http)
        pd_http_server_stop(s->http, on_http_stopped, s);
    else
        on_http_stopped(s);
}

enum { DRAIN_TICK_MS = 50, DRAIN_FLUSH_MS = 2000 };

/* Every DRAIN_TICK_MS of a drain: stops once no request is left; at the deadline, the requests
 * still in flight fail with the contract's 503 (in-band once streaming started) and the server
 * stops when their answers have gone out, or DRAIN_FLUSH_MS later at most. */
static void on_drain_tick(uv_timer_t *t)
{
    pd_apiserver *s = t->data;
    int64_t now = pd_now_ns();
    if (!s->live || now >= s->drain_deadline + (int64_t)DRAIN_FLUSH_MS * PD_NS_PER_MS) {
        begin_stop(s);
        return;
    }
    if (now < s->drain_deadline) return;
    int left = 0;
    for (sreq *r = s->live; r; r = r->next) left += !r->done;
    if (left) PD_WARN(NULL, "shutdown: failing %d request(s) still in progress", left);
    for (sreq *r = s->live, *next; r; r = next) {
        next = r->next;
        if (!r->done) srv_request_fail(r, 503, "The server is shutting down.");
    }
}

/* SIGTERM, SIGINT or pd_apiserver_shutdown: new requests get 503 "The server is shutting down."
 * and /health 503 while the requests in flight go on for up to --shutdown-timeout seconds (the
 * listener stays open, so clients get an answer, not a refused connection); then on_drain_tick
 * ends them. A second signal stops at once. */
void srv_begin_drain(pd_apiserver *s)
{
    if (s->stopping) {
        if (!s->halted) PD_INFO(NULL, "shutdown: second request, stopping now");
        begin_stop(s);
        return;
    }
    s->stopping = true;
    int n = 0;
    for (sreq *r = s->live; r; r = r->next) n += !r->done;
    PD_INFO(NULL, "shutting down: %d request(s) in flight, draining for up to %g s", n,
            s->p.shutdown_timeout_s);
    s->drain_deadline = pd_now_ns() + (int64_t)(s->p.shutdown_timeout_s * 1e9);
    if (!s->live)
        begin_stop(s);
    else
        uv_timer_start(&s->drain_timer, on_drain_tick, DRAIN_TICK_MS, DRAIN_TICK_MS);
}

static void on_signal(uv_signal_t *h, int sig)
{
    (void)sig;
    srv_begin_drain(h->data);
}

int pd_apiserver_run(pd_apiserver *s, bool install_signals)
{
    if (install_signals) {
        s->signals = true;
        uv_signal_init(&s->loop, &s->sig_int);
        uv_signal_init(&s->loop, &s->sig_term);
        s->sig_int.data = s->sig_term.data = s;
        uv_signal_start(&s->sig_int, on_signal, SIGINT);
        uv_signal_start(&s->sig_term, on_signal, SIGTERM);
        signal(SIGPIPE, SIG_IGN);
    }
    if (atomic_load(&s->shutdown_requested)) srv_begin_drain(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return PD_OK;
}

void pd_apiserver_shutdown(pd_apiserver *s)
{
    atomic_store(&s->shutdown_requested, true);
    pthread_mutex_lock(&s->qmu);
    if (!s->closing) uv_async_send(&s->async);
    pthread_mutex_unlock(&s->qmu);
}

void pd_apiserver_free(pd_apiserver *s)
{
    if (!s) return;
    if (s->http || !s->stopping) {
        /* never ran (start-up failure): close what is open */
        if (s->http) pd_http_server_stop(s->http, NULL, NULL);
        s->http = NULL;
        if (!uv_is_closing((uv_handle_t *)&s->async)) uv_close((uv_handle_t *)&s->async, NULL);
        if (!uv_is_closing((uv_handle_t *)&s->admit_timer))
            uv_close((uv_handle_t *)&s->admit_timer, NULL);
        if (!uv_is_closing((uv_handle_t *)&s->drain_timer))
            uv_close((uv_handle_t *)&s->drain_timer, NULL);
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    pthread_mutex_lock(&s->qmu);
    s->closing = true;
    pthread_mutex_unlock(&s->qmu);
    if (s->reg) pd_reg_close(s->reg); /* stops the heartbeat, refuses new calls */
    pd_rpc_client_free(s->rpc);       /* cancels the calls in flight; every callback has run */
    pd_reg_free(s->reg);
    while (s->live) srv_sreq_free(s->live);
    uv_loop_close(&s->loop);
    pd_metrics_free(s->m);
    pd_sb_free(&s->tokbuf);
    for (int k = 0; k < 4; k++) pd_sb_free(&s->lpbuf[k]);
    pd_chat_free(s->tmpl);
    pd_chat_free(s->tmpl_tools);
    json_decref(s->chat_vars);
    json_decref(s->default_kwargs);
    pd_gcache_free(s->lim.grammars);
    pd_gvocab_free(s->gvocab);
    pd_tok_free(s->tok);
    pthread_mutex_destroy(&s->qmu);
    free(s->went_down);
    free(s->relays);
    pd_idmap_free(&s->cmap);
    pthread_mutex_destroy(&s->rl_mu);
    free(s);
}
