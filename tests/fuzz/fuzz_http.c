/* libFuzzer target: the HTTP request parser of common/http/http_server.c (llhttp callbacks,
 * header and body limits, chunked bodies, Expect: 100-continue, pipelining) and, for every
 * complete request to a generation route, the scheduler's request validation (pd_api_parse of
 * scheduler/api.c: JSON, every §8 rule, chat template, tokenization).
 *
 * Input: one control byte, then the payload.
 *   control >> 6 == 3: the payload is a request body, validated directly as kind
 *                      (control & 63) % 3 (completions, chat, generate): JSON coverage without
 *                      HTTP framing in the way.
 *   otherwise:         the payload is what a client sends on one connection. It is parsed by
 *                      pd_http_parse_buffer (the server's own parser) in one read, and again in
 *                      reads of (control & 63) bytes; both must give the same requests, the
 *                      same error and the same 100-continue count, else abort (a finding).
 *                      POSTs to /v1/completions, /v1/chat/completions and /generate go to
 *                      pd_api_parse with the request's arena, as the scheduler does.
 * Limits are small (8 KiB body, 2 KiB headers) so that 413 and 431 are reachable.
 *
 * Every accepted request must satisfy what the engine relies on, else abort: at least one
 * prompt, every prompt non-empty with ids in [0, vocab) and shorter than max_model_len, each
 * prompt's max_tokens >= 1 (0 only with completions echo) with prompt + max_tokens <=
 * max_model_len, and the sampling parameters pass pd_sampling_params_validate (the engine's own
 * admission check). A refusal must be 400 or 404 with a message.
 *
 * The tokenizer and chat template are pd-mkmodel's tiny byte-level BPE (tests/fuzz/model,
 * loaded once; PD_FUZZ_MODEL_DIR overrides the directory). With PD_FUZZ_TRUST_TEMPLATE set, a
 * request's own chat_template is rendered too (--trust-request-chat-template).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "engine/sampler.h"
#include "http/http_server.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "util/status.h"

#ifndef FUZZ_MODEL_DIR
#error "FUZZ_MODEL_DIR must name the directory of the fuzzer's tokenizer files"
#endif

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const NAMES[] = {"tiny", "alias"};
static pd_api_limits g_lim;
static pd_http_params g_params;

static void fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_http invariant broken: %s: %s\n", what, detail);
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *dir = getenv("PD_FUZZ_MODEL_DIR");
    if (!dir) dir = FUZZ_MODEL_DIR;
    pd_tok *tok = NULL;
    pd_chat_template *tmpl = NULL;
    json_t *vars = NULL;
    char *src = NULL, *what = NULL;
    if (pd_tok_load(dir, &tok) < 0 || pd_chat_select(dir, NULL, false, &src, &what) < 0 || !src ||
        pd_chat_compile(src, what, &tmpl) < 0 ||
        pd_chat_config_vars(pd_tok_config(tok), &vars) < 0) {
        fprintf(stderr, "fuzz_http: cannot load the model in %s: %s\n", dir, pd_last_error());
        exit(1);
    }
    free(src);
    free(what);
    g_lim.served_names = NAMES;
    g_lim.n_served_names = 2;
    g_lim.max_model_len = 256;
    g_lim.vocab = pd_tok_vocab_size(tok);
    g_lim.max_logprobs = 20;
    g_lim.max_n = 8;
    g_lim.defaults = pd_sampling_default_params();
    g_lim.max_new_tokens = -1;
    g_lim.response_role = "assistant";
    g_lim.tok = tok;
    g_lim.chat_template = tmpl;
    g_lim.chat_config_vars = vars;
    /* PD_FUZZ_TRUST_TEMPLATE=1: requests may bring their own chat_template (the server's
     * --trust-request-chat-template), which puts the Jinja engine under the fuzzer too */
    g_lim.trust_request_template = getenv("PD_FUZZ_TRUST_TEMPLATE") != NULL;
    g_params = pd_http_default_params();
    g_params.max_body_bytes = 8192;
    g_params.max_header_bytes = 2048;
    /* tok, tmpl and vars live as long as the process */
    return 0;
}

static bool contains(const char *s, size_t n, const char *needle)
{
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(s + i, needle, k) == 0) return true;
    return false;
}

static void check_request(pd_api_kind kind, const char *body, size_t len, pd_arena *a)
{
    pd_api_request r;
    int http = 0;
    pd_error_clear();
    int rc = pd_api_parse(&g_lim, kind, body, len, a, &r, &http);
    if (rc < 0) {
        if (rc == PD_ENOMEM) return;
        if (http != 400 && http != 404) fail("refusal status", pd_last_error());
        /* the one refusal whose message may be empty: a request's own template calling
           raise_exception('') or raise_exception(undefined) (§8.3: the message is msg exactly) */
        if (!pd_last_error()[0] &&
            !(g_lim.trust_request_template && contains(body, len, "raise_exception")))
            fail("refusal", "no message");
        return;
    }
    if (r.n_prompts == 0 || !r.prompts) fail("accepted request", "no prompt");
    for (size_t i = 0; i < r.n_prompts; i++) {
        const pd_api_prompt *p = &r.prompts[i];
        if (p->n_ids == 0) fail("accepted request", "an empty prompt");
        if ((int64_t)p->n_ids >= g_lim.max_model_len) fail("accepted request", "prompt too long");
        for (size_t k = 0; k < p->n_ids; k++)
            if (p->ids[k] < 0 || p->ids[k] >= g_lim.vocab)
                fail("accepted request", "id not in vocab");
        /* max_tokens 0 is allowed with completions echo (§5: the prompt only) */
        int64_t least = kind == PD_API_COMPLETIONS && r.echo && r.max_tokens == 0 ? 0 : 1;
        if (p->max_tokens < least || (int64_t)p->n_ids + p->max_tokens > g_lim.max_model_len) {
            char msg[128];
            snprintf(msg, sizeof msg, "prompt %zu tokens, max_tokens %lld", p->n_ids,
                     (long long)p->max_tokens);
            fail("accepted request exceeds the context", msg);
        }
        if (r.sp.min_tokens > p->max_tokens) fail("accepted request", "min_tokens > max_tokens");
    }
    if (r.sp.n < 1 || r.sp.n > g_lim.max_n) fail("accepted request", "n out of range");
    if (pd_sampling_params_validate(&r.sp, g_lim.vocab) < 0)
        fail("accepted sampling parameters fail the engine's check", pd_last_error());
}

/* ---- the HTTP side ------------------------------------------------------------------------- */

typedef struct {
    char *buf; /* every request serialized: method, path, query, headers, body */
    size_t len, cap;
    bool validate;
} record;

static void put(record *r, const void *p, size_t n)
{
    if (r->len + n > r->cap) {
        size_t cap = r->cap ? r->cap : 1024;
        while (cap < r->len + n) cap *= 2;
        char *b = realloc(r->buf, cap);
        if (!b) abort();
        r->buf = b;
        r->cap = cap;
    }
    memcpy(r->buf + r->len, p, n);
    r->len += n;
}

static void put_str(record *r, const char *s)
{
    put(r, s, strlen(s) + 1);
}

static const char *const HEADERS[] = {
    "Host",          "Content-Type", "Content-Length", "Transfer-Encoding", "Expect", "Connection",
    "Authorization", "X-Request-Id", "Accept"};

static void on_request(void *arg, pd_http_exchange *ex)
{
    record *r = arg;
    const char *method = pd_http_method(ex), *path = pd_http_path(ex);
    size_t blen = 0;
    const char *body = pd_http_body(ex, &blen);
    if (!method || !path || !pd_http_query(ex) || !body) fail("exchange", "a NULL field");
    if (body[blen] != '\0') fail("exchange", "body not NUL-terminated");
    put_str(r, method);
    put_str(r, path);
    put_str(r, pd_http_query(ex));
    for (size_t i = 0; i < sizeof HEADERS / sizeof *HEADERS; i++) {
        const char *v = pd_http_header(ex, HEADERS[i]);
        put_str(r, v ? v : "(none)");
    }
    put(r, &blen, sizeof blen);
    put(r, body, blen);
    if (!r->validate || strcmp(method, "POST") != 0) return;
    if (strcmp(path, "/v1/completions") == 0)
        check_request(PD_API_COMPLETIONS, body, blen, pd_http_arena(ex));
    else if (strcmp(path, "/v1/chat/completions") == 0)
        check_request(PD_API_CHAT, body, blen, pd_http_arena(ex));
    else if (strcmp(path, "/generate") == 0)
        check_request(PD_API_GENERATE, body, blen, pd_http_arena(ex));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    unsigned control = data[0];
    const char *payload = (const char *)data + 1;
    size_t len = size - 1;
    if (control >> 6 == 3) {
        pd_arena *a = pd_arena_create(4096);
        if (!a) return 0;
        check_request((pd_api_kind)((control & 63) % 3), payload, len, a);
        pd_arena_free(a);
        return 0;
    }
    record whole = {.validate = true}, pieces = {.validate = false};
    pd_http_parse_result rw, rp;
    if (pd_http_parse_buffer(&g_params, payload, len, 0, on_request, &whole, &rw) < 0) goto out;
    if (rw.error_status &&
        (rw.error_status != 400 && rw.error_status != 413 && rw.error_status != 431))
        fail("parser error status", rw.error_message);
    if (rw.error_status && !rw.error_message[0]) fail("parser error", "no message");
    if (!rw.error_status && rw.consumed > len) fail("parser", "consumed more than given");
    size_t piece = control & 63;
    if (piece) {
        if (pd_http_parse_buffer(&g_params, payload, len, piece, on_request, &pieces, &rp) < 0)
            goto out;
        char what[96];
        snprintf(what, sizeof what, "reads of %zu bytes", piece);
        if (rw.n_requests != rp.n_requests) fail("request count differs in", what);
        /* Both must fail, but not always with the same status: llhttp reports a header span
         * when it ends or when the read ends, so in one read a malformed byte after an
         * over-long header can be seen (400) before the span reaches the limit (431), while
         * shorter reads report the span first. The server answers either way and closes. */
        if (!rw.error_status != !rp.error_status) {
            char msg[300];
            snprintf(msg, sizeof msg, "%s: %d (%s) vs %d (%s)", what, rw.error_status,
                     rw.error_message, rp.error_status, rp.error_message);
            fail("error differs", msg);
        }
        if (rw.error_status == rp.error_status && strcmp(rw.error_message, rp.error_message) != 0)
            fail("error message differs in", what);
        if (rw.n_continue != rp.n_continue) fail("100-continue count differs in", what);
        if (!rw.error_status && (rw.partial != rp.partial || rw.consumed != rp.consumed))
            fail("end state differs in", what);
        if (whole.len != pieces.len || (whole.len && memcmp(whole.buf, pieces.buf, whole.len)))
            fail("requests differ in", what);
    }
out:
    free(whole.buf);
    free(pieces.buf);
    return 0;
}
