/* Beam search through the api-server (docs/beam_search.md): the guide's parameter combinations
 * and other early_stopping and length_penalty values on /v1/completions,
 * /v1/chat/completions and the legacy /generate (the only one that takes "never", as vLLM 0.5),
 * served split (the prefill instance computes the prompt's KV, the decode instance runs the whole
 * search) and colocated (a second api-server with --max-local-prefill-length, whose decode instance
 * prefills itself): the n choices equal each other's text, finish reason and usage, and the best
 * one pd-generate --beam-width's. Also 1P2D (every search stays on one decode instance, both
 * serve), stream: true answered whole, the vllm:request_params_best_of / _n histograms, the
 * refusals, and a client that leaves mid-search: every block comes back. */
#define _GNU_SOURCE
#include "scheduler_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rpc/pd.pb-c.h"

/* A prompt of over two blocks of 16 tokens (its last block is copied on write by the forks). */
static const char LONG_PROMPT[] =
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the waves, and wondering who would";

/* The request bodies the api-server and its colocated twin both answer: (path, body). */
typedef struct {
    const char *path, *body;
} beam_case;

static const beam_case CASES[] = {
    /* the guide's combination: length_penalty with use_beam_search, best_of 2, top_k -1 */
    {"/v1/completions",
     "{\"prompt\":\"The knight rode\",\"max_tokens\":12,\"use_beam_search\":true,\"best_of\":2,"
     "\"temperature\":0,\"top_k\":-1,\"length_penalty\":0.5}"},
    {"/v1/completions",
     "{\"prompt\":\"The knight rode\",\"max_tokens\":16,\"use_beam_search\":true,\"n\":2,"
     "\"best_of\":4,\"temperature\":0,\"early_stopping\":true}"},
    {"/v1/completions",
     "{\"prompt\":\"LONG\",\"max_tokens\":10,\"use_beam_search\":true,\"n\":3,\"best_of\":3,"
     "\"temperature\":0,\"length_penalty\":2,\"early_stopping\":false,\"ignore_eos\":true}"},
    {"/v1/completions",
     "{\"prompt\":[\"Hello\",\"LONG\"],\"max_tokens\":8,\"use_beam_search\":true,\"n\":2,"
     "\"best_of\":3,\"temperature\":0}"},
    {"/v1/chat/completions",
     "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story\"}],\"max_tokens\":14,"
     "\"use_beam_search\":true,\"n\":2,\"best_of\":3,\"temperature\":0,\"length_penalty\":1.5}"},
};

/* body with "LONG" replaced by LONG_PROMPT (malloc'd). */
static char *expand(const char *body)
{
    const char *at = strstr(body, "LONG");
    char *out = malloc(strlen(body) + sizeof LONG_PROMPT);
    if (!out) return NULL;
    if (!at) return strcpy(out, body);
    sprintf(out, "%.*s%s%s", (int)(at - body), body, LONG_PROMPT, at + 4);
    return out;
}

/* The answer of a completions or chat response as one comparable string: each choice's index,
 * finish reason and text, then the usage; NULL when the response is not one. */
static char *answer_of(const json_t *o, size_t want_choices)
{
    const json_t *cs = json_object_get(o, "choices");
    if (!json_is_array(cs) || json_array_size(cs) != want_choices) return NULL;
    json_t *a = json_array();
    size_t i;
    const json_t *c;
    json_array_foreach(cs, i, c)
    {
        const json_t *text = json_object_get(c, "text");
        if (!text) text = json_object_get(json_object_get(c, "message"), "content");
        if ((size_t)json_integer_value(json_object_get(c, "index")) != i || !json_is_string(text))
            break;
        json_array_append_new(
            a, json_pack("[sO]", json_string_value(json_object_get(c, "finish_reason")), text));
    }
    json_array_append(a, json_object_get(o, "usage"));
    char *s = i == want_choices ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    return s;
}

/* Choices a body asks for: n (1) times its prompts (a list of two in one case). */
static size_t choices_of(const char *body)
{
    json_t *o = json_loads(body, 0, NULL);
    size_t n =
        o && json_object_get(o, "n") ? (size_t)json_integer_value(json_object_get(o, "n")) : 1;
    const json_t *p = json_object_get(o, "prompt");
    if (json_is_array(p)) n *= json_array_size(p);
    json_decref(o);
    return n;
}

static char *serve(int port, const char *path, const char *body, size_t n_choices)
{
    int st = 0;
    json_t *o = post_json(port, path, body, &st);
    char *a = st == 200 && o ? answer_of(o, n_choices) : NULL;
    if (st == 200 && !a) printf("    not an answer of %zu choices\n", n_choices);
    json_decref(o);
    return a;
}

/* pd-generate --beam-width w (length_penalty lp, early_stopping false) on prompt: its text. */
static char *pd_generate(const char *prompt, int w, double lp, int max_tokens)
{
    char ws[16], lps[32], mt[16], out[600];
    snprintf(ws, sizeof ws, "%d", w);
    snprintf(lps, sizeof lps, "%g", lp);
    snprintf(mt, sizeof mt, "%d", max_tokens);
    snprintf(out, sizeof out, "%s/beam_generate.json", g_c.dir);
    char bin[1024];
    snprintf(bin, sizeof bin, "%s", cl_bin("tools/generate/pd-generate"));
    char *argv[] = {bin,
                    "--model",
                    g_model,
                    "--prompt",
                    (char *)prompt,
                    "--max-tokens",
                    mt,
                    "--beam-width",
                    ws,
                    "--length-penalty",
                    lps,
                    "--json",
                    "--cpu-threads",
                    "1",
                    NULL};
    unlink(out);
    if (cl_run(argv, out, 120) != 0) return NULL;
    FILE *f = fopen(out, "r");
    char buf[8192] = "";
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    const char *j = strstr(buf, "{\"prompt_token_ids\""); /* after stderr's log lines */
    json_t *o = j ? json_loads(j, JSON_DISABLE_EOF_CHECK, NULL) : NULL;
    const char *t = json_string_value(json_object_get(o, "text"));
    char *text = t ? strdup(t) : NULL;
    json_decref(o);
    return text;
}

/* Split (the fixture's api-server) equals colocated (its twin that prefills on the decode
 * instance) for every case, streamed or not; the best beam is pd-generate's. */
TEST(sched_beam_split_equals_colocated)
{
    FIXTURE();
    cl_proc lp;
    int lport = 0;
    ASSERT_MSG(start_colocated_scheduler(&lp, &lport, "scheduler_beam_local") == 0,
               "pd-scheduler with --max-local-prefill-length did not start");
    for (size_t k = 0; k < sizeof CASES / sizeof *CASES; k++) {
        char *body = expand(CASES[k].body);
        ASSERT(body);
        size_t nc = choices_of(body);
        char *split = serve(g_port, CASES[k].path, body, nc);
        char *colo = serve(lport, CASES[k].path, body, nc);
        ASSERT_MSG(split && colo, "case %zu: no answer", k);
        ASSERT_MSG(strcmp(split, colo) == 0, "case %zu:\nsplit     %s\ncolocated %s", k, split,
                   colo);
        printf("    case %zu: %.160s\n", k, split);
        /* stream: true is answered whole at the end (the search's beams come at its end) */
        char *sbody = malloc(strlen(body) + 32);
        ASSERT(sbody);
        sprintf(sbody, "%.*s,\"stream\":true}", (int)strlen(body) - 1, body);
        char *streamed = serve(g_port, CASES[k].path, sbody, nc);
        ASSERT_MSG(streamed && strcmp(streamed, split) == 0, "case %zu streamed: %s", k,
                   streamed ? streamed : "(none)");
        free(streamed);
        free(sbody);
        free(split);
        free(colo);
        free(body);
    }
    /* the best beam is the colocated engine's (pd-generate), early_stopping false */
    const char *prompts[] = {"The knight rode", LONG_PROMPT};
    for (int i = 0; i < 2; i++) {
        char body[1024];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"%s\",\"max_tokens\":12,\"use_beam_search\":true,\"best_of\":3,"
                 "\"temperature\":0,\"length_penalty\":0.5}",
                 prompts[i]);
        int st = 0;
        json_t *o = post_json(g_port, "/v1/completions", body, &st);
        ASSERT_EQ_INT(st, 200);
        const char *got = json_string_value(
            json_object_get(json_array_get(json_object_get(o, "choices"), 0), "text"));
        char *want = pd_generate(prompts[i], 3, 0.5, 12);
        ASSERT_MSG(got && want && strcmp(got, want) == 0, "prompt %d: served %s, pd-generate %s", i,
                   got ? got : "(none)", want ? want : "(none)");
        free(want);
        json_decref(o);
    }
    ASSERT_EQ_INT(cl_stop(&lp, 10000), 0);
}

/* The text of ids (return_tokens_as_token_ids' "token_id:N" strings) by /detokenize (malloc'd). */
static char *detokenize(const json_t *tokens)
{
    json_t *ids = json_array();
    size_t i;
    const json_t *t;
    json_array_foreach(tokens, i, t)
    {
        const char *s = json_string_value(t);
        json_array_append_new(ids,
                              json_integer(s && strchr(s, ':') ? atoll(strchr(s, ':') + 1) : -1));
    }
    json_t *q = json_pack("{so}", "tokens", ids);
    char *body = json_dumps(q, JSON_COMPACT);
    json_decref(q);
    int st = 0;
    json_t *o = post_json(g_port, "/detokenize", body, &st);
    free(body);
    const char *text = json_string_value(json_object_get(o, "prompt"));
    char *out = st == 200 && text ? strdup(text) : NULL;
    json_decref(o);
    return out;
}

/* Stop strings end beams during the search (vLLM 0.5: a candidate whose text reaches one
 * finishes there), and logprobs come per token: split equals colocated, choices included
 * whole; a choice that stopped on the string has the text before it (its tokens' text goes on
 * with the string), the others do not contain it. */
TEST(sched_beam_stop_strings_and_logprobs)
{
    FIXTURE();
    cl_proc lp;
    int lport = 0;
    ASSERT_MSG(start_colocated_scheduler(&lp, &lport, "scheduler_beam_local2") == 0,
               "pd-scheduler with --max-local-prefill-length did not start");
    const char *base = "{\"prompt\":\"The knight rode\",\"max_tokens\":16,"
                       "\"use_beam_search\":true,\"n\":3,\"best_of\":3,\"temperature\":0,"
                       "\"ignore_eos\":true";
    char body[1024];
    snprintf(body, sizeof body, "%s}", base);
    int st = 0;
    json_t *o = post_json(g_port, "/v1/completions", body, &st);
    ASSERT_EQ_INT(st, 200);
    /* a stop string from the middle of the best beam's text */
    const char *t0 = json_string_value(
        json_object_get(json_array_get(json_object_get(o, "choices"), 0), "text"));
    ASSERT(t0 && strlen(t0) > 12);
    char stop[8];
    snprintf(stop, sizeof stop, "%.3s", t0 + strlen(t0) / 2);
    json_decref(o);
    json_t *js = json_string(stop);
    char *sj = json_dumps(js, JSON_ENCODE_ANY);
    json_decref(js);
    snprintf(body, sizeof body,
             "%s,\"stop\":[%s],\"logprobs\":2,\"return_tokens_as_token_ids\":true}", base, sj);
    json_t *a = post_json(g_port, "/v1/completions", body, &st);
    ASSERT_EQ_INT(st, 200);
    json_t *b = post_json(lport, "/v1/completions", body, &st);
    ASSERT_EQ_INT(st, 200);
    char *ca = json_dumps(json_object_get(a, "choices"), JSON_COMPACT);
    char *cb = json_dumps(json_object_get(b, "choices"), JSON_COMPACT);
    ASSERT_MSG(ca && cb && strcmp(ca, cb) == 0, "split:\n%s\ncolocated:\n%s", ca, cb);
    int stopped = 0;
    size_t i;
    const json_t *c;
    json_array_foreach(json_object_get(a, "choices"), i, c)
    {
        const char *text = json_string_value(json_object_get(c, "text"));
        const char *fin = json_string_value(json_object_get(c, "finish_reason"));
        const json_t *lps = json_object_get(c, "logprobs");
        const json_t *toks = json_object_get(lps, "tokens");
        ASSERT(text && fin && json_array_size(toks) > 0);
        ASSERT_EQ_INT(json_array_size(json_object_get(lps, "token_logprobs")),
                      json_array_size(toks));
        ASSERT_EQ_INT(json_array_size(json_object_get(lps, "top_logprobs")), json_array_size(toks));
        ASSERT_MSG(!strstr(text, stop), "choice %zu's text %s contains the stop string %s", i, text,
                   stop);
        if (strcmp(fin, "stop") != 0) continue;
        stopped++;
        ASSERT_STR_EQ(json_string_value(json_object_get(c, "stop_reason")), stop);
        char *all = detokenize(toks);
        ASSERT(all);
        ASSERT_MSG(strncmp(all, text, strlen(text)) == 0 &&
                       strncmp(all + strlen(text), stop, strlen(stop)) == 0,
                   "choice %zu: tokens' text %s, answer %s + stop %s", i, all, text, stop);
        free(all);
    }
    ASSERT_MSG(stopped > 0, "no beam stopped on %s: %s", stop, ca);
    printf("    stop %s: %d of 3 beams stopped on it\n", sj, stopped);
    free(ca);
    free(cb);
    json_decref(a);
    json_decref(b);
    free(sj);
    /* chat with logprobs: the content items of each beam, split as colocated */
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story\"}],"
                       "\"max_tokens\":10,\"use_beam_search\":true,\"n\":2,\"best_of\":3,"
                       "\"temperature\":0,\"logprobs\":true,\"top_logprobs\":3}";
    a = post_json(g_port, "/v1/chat/completions", chat, &st);
    ASSERT_EQ_INT(st, 200);
    b = post_json(lport, "/v1/chat/completions", chat, &st);
    ASSERT_EQ_INT(st, 200);
    ca = json_dumps(json_object_get(a, "choices"), JSON_COMPACT);
    cb = json_dumps(json_object_get(b, "choices"), JSON_COMPACT);
    ASSERT_MSG(ca && cb && strcmp(ca, cb) == 0, "chat split:\n%s\ncolocated:\n%s", ca, cb);
    size_t n_items = 0; /* every beam's tokens, each with its 3 top ones */
    json_array_foreach(json_object_get(a, "choices"), i, c)
    {
        const json_t *items = json_object_get(json_object_get(c, "logprobs"), "content");
        const json_t *it;
        size_t j;
        ASSERT(json_array_size(items) > 0);
        json_array_foreach(items, j, it)
            ASSERT_EQ_INT(json_array_size(json_object_get(it, "top_logprobs")), 3);
        n_items += json_array_size(items);
    }
    ASSERT_EQ_INT(n_items, json_integer_value(
                               json_object_get(json_object_get(a, "usage"), "completion_tokens")));
    free(ca);
    free(cb);
    json_decref(a);
    json_decref(b);
    ASSERT_EQ_INT(cl_stop(&lp, 10000), 0);
}

/* prompt_logprobs with a search are the prefill instance's, as for any request: equal to a
 * greedy request's of the same prompt, in every choice; with echo and logprobs each choice's
 * logprobs start with the prompt's items. */
TEST(sched_beam_prompt_logprobs)
{
    FIXTURE();
    int st = 0;
    json_t *g = post_json(g_port, "/v1/completions",
                          "{\"prompt\":\"The knight rode far\",\"max_tokens\":2,"
                          "\"temperature\":0,\"prompt_logprobs\":2}",
                          &st);
    ASSERT_EQ_INT(st, 200);
    json_t *b = post_json(g_port, "/v1/completions",
                          "{\"prompt\":\"The knight rode far\",\"max_tokens\":6,"
                          "\"use_beam_search\":true,\"n\":2,\"best_of\":3,\"temperature\":0,"
                          "\"prompt_logprobs\":2}",
                          &st);
    ASSERT_EQ_INT(st, 200);
    char *want = json_dumps(
        json_object_get(json_array_get(json_object_get(g, "choices"), 0), "prompt_logprobs"),
        JSON_COMPACT);
    ASSERT(want && strlen(want) > 20);
    for (size_t i = 0; i < 2; i++) {
        char *got = json_dumps(
            json_object_get(json_array_get(json_object_get(b, "choices"), i), "prompt_logprobs"),
            JSON_COMPACT);
        ASSERT_MSG(got && strcmp(got, want) == 0, "choice %zu: %s, greedy %s", i, got, want);
        free(got);
    }
    free(want);
    json_decref(g);
    json_decref(b);
    b = post_json(g_port, "/v1/completions",
                  "{\"prompt\":\"The knight rode far\",\"max_tokens\":6,\"use_beam_search\":true,"
                  "\"n\":2,\"best_of\":3,\"temperature\":0,\"echo\":true,\"logprobs\":1}",
                  &st);
    ASSERT_EQ_INT(st, 200);
    for (size_t i = 0; i < 2; i++) {
        const json_t *c = json_array_get(json_object_get(b, "choices"), i);
        const json_t *lp = json_object_get(json_object_get(c, "logprobs"), "token_logprobs");
        ASSERT_MSG(json_array_size(lp) > 4 && json_is_null(json_array_get(lp, 0)) &&
                       json_is_number(json_array_get(lp, 1)),
                   "choice %zu: %s", i, json_dumps(c, JSON_COMPACT));
        ASSERT(strncmp(json_string_value(json_object_get(c, "text")), "The knight rode far", 19) ==
               0);
    }
    json_decref(b);
}

/* The legacy /generate (USE_OPENAI=0): {"text": [...]} of the n beams, prompt included. */
TEST(sched_beam_legacy_generate)
{
    FIXTURE();
    const char *body = "{\"prompt\":\"The knight rode\",\"max_tokens\":12,\"use_beam_search\":true,"
                       "\"n\":2,\"best_of\":3,\"temperature\":0}";
    int st = 0;
    json_t *o = post_json(g_port_legacy, "/generate", body, &st);
    ASSERT_EQ_INT(st, 200);
    const json_t *texts = json_object_get(o, "text");
    ASSERT_EQ_INT(json_array_size(texts), 2);
    json_t *c = post_json(g_port, "/v1/completions", body, &st);
    ASSERT_EQ_INT(st, 200);
    for (size_t i = 0; i < 2; i++) {
        char want[1024];
        snprintf(want, sizeof want, "The knight rode%s",
                 json_string_value(
                     json_object_get(json_array_get(json_object_get(c, "choices"), i), "text")));
        ASSERT_STR_EQ(json_string_value(json_array_get(texts, i)), want);
    }
    json_decref(c);
    json_decref(o);
    /* early_stopping "never" is vLLM 0.5's SamplingParams value, which /generate takes */
    o = post_json(g_port_legacy, "/generate",
                  "{\"prompt\":\"The knight rode\",\"max_tokens\":12,\"use_beam_search\":true,"
                  "\"n\":2,\"best_of\":3,\"temperature\":0,\"length_penalty\":2,"
                  "\"early_stopping\":\"never\"}",
                  &st);
    ASSERT_EQ_INT(st, 200);
    ASSERT_EQ_INT(json_array_size(json_object_get(o, "text")), 2);
    json_decref(o);
}

/* What the engine's search does not apply is refused before anything runs, naming the field;
 * the histograms count a search's best_of (its width) and n. */
TEST(sched_beam_refusals_and_metrics)
{
    FIXTURE();
    static const char *const refused[][2] = {
        {"\"min_tokens\":2", "use_beam_search: min_tokens is not supported with beam search"},
        {"\"repetition_penalty\":1.2",
         "use_beam_search: repetition_penalty is not supported with beam search"},
        {"\"presence_penalty\":0.5",
         "use_beam_search: presence_penalty is not supported with beam search"},
        {"\"guided_choice\":[\"a\",\"b\"]",
         "use_beam_search: guided decoding is not supported with beam search"},
    };
    /* what only the decode instance's engine knows: its max_num_seqs, its pool */
    static const char *const too_big[][2] = {
        {"\"best_of\":100,\"max_tokens\":4", "best_of must be at most 64"},
        {"\"best_of\":64,\"max_tokens\":450", "best_of: a beam search of 64 beams may hold "},
    };
    for (size_t i = 0; i < sizeof too_big / sizeof *too_big; i++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"a\",\"use_beam_search\":true,\"temperature\":0,%s}", too_big[i][0]);
        http_resp r;
        ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
        ASSERT_MSG(r.status == 400 && strstr(r.body, too_big[i][1]), "%s: %d %s", too_big[i][0],
                   r.status, r.body);
        resp_free(&r);
    }
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"a\",\"use_beam_search\":true,\"best_of\":2,\"temperature\":0,%s}",
                 refused[i][0]);
        http_resp r;
        ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
        ASSERT_EQ_INT(r.status, 400);
        ASSERT_MSG(strstr(r.body, refused[i][1]), "%s: %s", refused[i][0], r.body);
        resp_free(&r);
    }
    const char *sum_b = "vllm:request_params_best_of_sum{model_name=\"tiny\",engine=\"0\"} ";
    const char *sum_n = "vllm:request_params_n_sum{model_name=\"tiny\",engine=\"0\"} ";
    char *m = NULL;
    ASSERT_EQ_INT(cl_http(g_port, "GET", "/metrics", NULL, CL_MS(10000), &m, NULL), 200);
    double b0 = cl_metric(m, sum_b, -1), n0 = cl_metric(m, sum_n, -1);
    free(m);
    ASSERT(b0 >= 0 && n0 >= 0);
    int st = 0;
    json_t *o = post_json(g_port, "/v1/completions",
                          "{\"prompt\":\"Hi\",\"max_tokens\":4,\"use_beam_search\":true,\"n\":2,"
                          "\"best_of\":5,\"temperature\":0}",
                          &st);
    json_decref(o);
    ASSERT_EQ_INT(st, 200);
    ASSERT_EQ_INT(cl_http(g_port, "GET", "/metrics", NULL, CL_MS(10000), &m, NULL), 200);
    double b1 = cl_metric(m, sum_b, -1), n1 = cl_metric(m, sum_n, -1);
    free(m);
    ASSERT_NEAR(b1 - b0, 5.0, 1e-9);
    ASSERT_NEAR(n1 - n0, 2.0, 1e-9);
}

/* 1P2D: concurrent searches each stay on one decode instance and both instances serve; every
 * answer equals the fixture's (the same model and engine). */
TEST(sched_beam_1p2d)
{
    FIXTURE();
    cl_cluster c2;
    cl_proc sp;
    int port = 0;
    ASSERT(side_cluster(&c2, "0", "1 2", &sp, &port, "scheduler_beam_1p2d", NULL));
    enum { N = 6 };
    char bodies[N][1024];
    cl_conn cs[N];
    for (int i = 0; i < N; i++) {
        snprintf(bodies[i], sizeof bodies[i],
                 "{\"prompt\":\"%s %d\",\"max_tokens\":24,\"use_beam_search\":true,\"n\":2,"
                 "\"best_of\":4,\"temperature\":0,\"ignore_eos\":true}",
                 LONG_PROMPT, i);
        ASSERT(cl_conn_open(&cs[i], port, "POST", "/v1/completions", NULL, bodies[i], false) == 0);
    }
    bool done = cl_conn_wait_all(cs, N, CL_MS(120000));
    int64_t served[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        Pd__StatsReply *s = cl_stats(&c2, 1 + k);
        if (s) served[k] = s->requests_finished;
        if (s) pd__stats_reply__free_unpacked(s, NULL);
    }
    bool same = done;
    for (int i = 0; i < N && same; i++) {
        char *b = cl_conn_body(&cs[i]);
        json_t *o = b ? json_loads(b, 0, NULL) : NULL;
        char *got = o ? answer_of(o, 2) : NULL;
        char *want = serve(g_port, "/v1/completions", bodies[i], 2);
        same = got && want && strcmp(got, want) == 0;
        if (!same)
            printf("    request %d:\n    1P2D %s\n    1P1D %s\n", i, got ? got : "(none)",
                   want ? want : "(none)");
        free(got);
        free(want);
        json_decref(o);
        free(b);
    }
    for (int i = 0; i < N; i++) cl_conn_close(&cs[i]);
    int st = cl_stop(&sp, 10000);
    int bad = cl_stop_all(&c2);
    ASSERT_MSG(done, "the searches did not all finish");
    ASSERT(same);
    printf("    decode instances served %lld and %lld requests\n", (long long)served[0],
           (long long)served[1]);
    ASSERT_MSG(served[0] > 0 && served[1] > 0, "one decode instance served every search");
    ASSERT_EQ_INT(st, 0);
    ASSERT_EQ_INT(bad, 0);
}

/* A client that leaves (a reset) mid-search: the search is aborted (request_success_total{abort} +
 * 1) and every block of both instances comes back. */
TEST(sched_beam_abort_frees_every_block)
{
    FIXTURE();
    const char *key = "vllm:request_success_total{model_name=\"tiny\",engine=\"0\","
                      "finished_reason=\"abort\"} ";
    char *m = NULL;
    ASSERT_EQ_INT(cl_http(g_port, "GET", "/metrics", NULL, CL_MS(10000), &m, NULL), 200);
    double before = cl_metric(m, key, -1);
    free(m);
    char body[1024];
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":400,\"use_beam_search\":true,\"best_of\":8,"
             "\"temperature\":0,\"ignore_eos\":true}",
             LONG_PROMPT);
    cl_conn c;
    ASSERT(cl_conn_open(&c, g_port, "POST", "/v1/completions", NULL, body, false) == 0);
    /* wait until the decode instance runs the beams, then hang up */
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(20.0) * PD_NS_PER_S);
    int64_t running = 0;
    while (running < 2 && pd_now_ns() < deadline) {
        Pd__StatsReply *s = cl_stats(&g_c, 1);
        running = s ? s->num_running : 0;
        if (s) pd__stats_reply__free_unpacked(s, NULL);
        if (running < 2) pd_sleep_ns(5 * PD_NS_PER_MS);
    }
    cl_conn_poll(&c, 1, 0, 0);
    bool answered = c.status != 0;
    /* a reset, as from a client that died: a FIN on a request not streamed is a half-close
     * (RFC 9112 §9.6), which the api-server answers */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(c.fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    cl_conn_close(&c);
    ASSERT_MSG(running >= 2 && !answered, "the search was not caught running (%lld beams, %s)",
               (long long)running, answered ? c.buf : "not answered");
    double after = before;
    deadline = pd_now_ns() + (int64_t)(CL_SEC(10.0) * PD_NS_PER_S);
    bool idle = false;
    while ((!idle || after == before) && pd_now_ns() < deadline) {
        pd_sleep_ns(100 * PD_NS_PER_MS);
        ASSERT_EQ_INT(cl_http(g_port, "GET", "/metrics", NULL, CL_MS(10000), &m, NULL), 200);
        after = cl_metric(m, key, -1);
        free(m);
        idle = true;
        for (int k = 0; k < 2; k++) {
            Pd__StatsReply *s = cl_stats(&g_c, k);
            idle = idle && s && s->num_running == 0 && s->num_waiting == 0 && s->num_held == 0 &&
                   s->kv_blocks_free == s->kv_blocks_total;
            if (s) pd__stats_reply__free_unpacked(s, NULL);
        }
    }
    ASSERT_NEAR(after, before + 1, 0.01);
    ASSERT_MSG(idle, "an instance still holds blocks after the abort");
}
