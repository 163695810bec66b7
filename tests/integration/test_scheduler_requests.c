/* pd-scheduler's answers to requests: the validation messages (§3, §8), the context-length
 * boundary, /metrics names, logprobs (§12), the legacy /generate (USE_OPENAI=0), and the
 * official OpenAI Node SDK against it. */
#define _GNU_SOURCE
#include "scheduler_common.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    const char *path, *body;
    int status;
    const char *message; /* exact; NULL: prefix in `prefix` */
    const char *prefix;
} bad_case;

TEST(sched_bad_inputs)
{
    FIXTURE();
    static const bad_case cases[] = {
        {"/v1/completions", "{\"prompt\":\"a\"", 400, NULL, "Invalid JSON in request body:"},
        {"/v1/completions", "[1,2]", 400, "Request body must be a JSON object.", NULL},
        {"/v1/completions", "{\"prompt\":NaN}", 400, NULL, "Invalid JSON in request body:"},
        {"/v1/completions", "{\"prompt\":\"a\",\"n\":\"2\"}", 400,
         "The field `n` must be an integer.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"n\":1.5}", 400,
         "The field `n` must be an integer.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stream\":1}", 400,
         "The field `stream` must be a boolean.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"temperature\":\"hot\"}", 400,
         "The field `temperature` must be a number.", NULL},
        {"/v1/completions", "{\"prompt\":{}}", 400,
         "The field `prompt` must be a string, an array of strings, an array of integers, or an "
         "array of arrays of integers.",
         NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stop\":3}", 400,
         "The field `stop` must be a string or an array of strings.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"model\":\"gpt-4\"}", 404,
         "The model `gpt-4` does not exist.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"n\":0}", 400, "n must be at least 1, got 0.",
         NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"temperature\":-1}", 400,
         "temperature must be non-negative, got -1.0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"top_p\":1.5}", 400,
         "top_p must be in (0, 1], got 1.5.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"top_k\":-2}", 400,
         "top_k must be 0 (disable), or at least 1, got -2.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"presence_penalty\":2.5}", 400,
         "presence_penalty must be in [-2, 2], got 2.5.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"repetition_penalty\":0}", 400,
         "repetition_penalty must be greater than zero, got 0.0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"min_p\":2}", 400,
         "min_p must be in [0, 1], got 2.0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":0}", 400,
         "max_tokens must be at least 1, got 0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"best_of\":2,\"temperature\":0}", 400,
         "best_of must be 1 when using greedy sampling.Got 2.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"length_penalty\":0.5}", 400,
         "length_penalty is not effective and must be the default value of 1.0 when not using "
         "beam search.",
         NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"early_stopping\":true}", 400,
         "early_stopping is not effective and must be False when not using beam search.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"early_stopping\":\"never\"}", 400,
         "The field `early_stopping` must be a boolean.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stop\":[\"x\",\"\"]}", 400,
         "stop cannot contain an empty string.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stop_token_ids\":[999999]}", 400,
         "Token id 999999 in stop_token_ids is out of vocabulary.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"logit_bias\":{\"abc\":1}}", 400,
         "Invalid key `abc` in logit_bias: keys must be token ids.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"allowed_token_ids\":[]}", 400,
         "allowed_token_ids is not allowed to be empty.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"priority\":3}", 400,
         "Got priority 3 but Priority scheduling is not enabled.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", 400,
         "Stream options can only be defined when `stream=True`.", NULL},
        {"/v1/completions", "{\"max_tokens\":3}", 400,
         "At least one of `prompt` or `prompt_embeds` must be set.", NULL},
        {"/v1/completions", "{\"prompt\":[]}", 400,
         "The field `prompt` must not be an empty array.", NULL},
        {"/v1/completions", "{\"prompt\":[1,2,99999999]}", 400,
         "Token id 99999999 is out of vocabulary", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"suffix\":\"b\"}", 400,
         "suffix is not currently supported", NULL},
        /* beam search: vLLM 0.5's _verify_beam_search on the values in use (temperature's
         * default is 1), then the refusal while the servers cannot run a search yet */
        {"/v1/completions", "{\"prompt\":\"a\",\"use_beam_search\":true}", 400,
         "best_of must be greater than 1 when using beam search. Got 1.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"use_beam_search\":true,\"best_of\":2}", 400,
         "temperature must be 0 when using beam search.", NULL},
        {"/v1/completions",
         "{\"prompt\":\"a\",\"use_beam_search\":true,\"n\":2,\"temperature\":0,"
         "\"top_p\":0.5}",
         400, "top_p must be 1 when using beam search.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"use_beam_search\":true,"
         "\"best_of\":2,\"temperature\":0,\"top_k\":5}",
         400, "top_k must be -1 when using beam search.", NULL},
        {"/v1/completions",
         "{\"prompt\":\"a\",\"use_beam_search\":true,\"n\":3,\"best_of\":2,"
         "\"temperature\":0}",
         400, "best_of must be greater than or equal to n, got n=3 and best_of=2.", NULL},
        {"/v1/completions",
         "{\"prompt\":\"a\",\"use_beam_search\":true,\"best_of\":2,\"temperature\":0,"
         "\"top_k\":-1,\"length_penalty\":0.5,\"min_tokens\":2}",
         400, "use_beam_search: min_tokens is not supported with beam search", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"guided_regex\":\"(x+\"}", 400, NULL,
         "`guided_regex`: "},
        {"/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":600}", 400, NULL,
         "'max_tokens' or 'max_completion_tokens' is too large: 600. This model's maximum "
         "context length is 512 tokens and your request has "},
        {"/v1/completions", "{\"prompt\":\"a\",\"min_tokens\":20,\"max_tokens\":5}", 400,
         "min_tokens must be less than or equal to max_tokens=5, got 20.", NULL},
        {"/v1/chat/completions", "{\"messages\":[]}", 400,
         "The field `messages` must be a non-empty array.", NULL},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":1,\"content\":\"x\"}]}", 400,
         "The field `messages[0].role` must be a string.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 400,
         "Content part type 'image_url' is not supported by this model.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400,
         "when using `top_logprobs`, `logprobs` must be set to true.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"continue_final_message\":true}",
         400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
         NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"auto\"}", 400,
         "When using `tool_choice`, `tools` must be set.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template\":\"{{x}}\"}", 400,
         "Chat template is passed with request, but --trust-request-chat-template is not set. "
         "Refused request with untrusted chat template.",
         NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":0}", 400,
         "max_tokens must be at least 1, got 0.", NULL},
    };
    size_t n = sizeof cases / sizeof *cases;
    for (size_t i = 0; i < n; i++) {
        const bad_case *c = &cases[i];
        http_resp r;
        ASSERT(http_do(g_port, "POST", c->path, NULL, c->body, &r) == 0);
        ASSERT_MSG(r.status == c->status, "case %zu (%s): status %d, expected %d: %s", i, c->body,
                   r.status, c->status, r.body);
        json_t *o = json_loads(r.body, 0, NULL);
        ASSERT_MSG(o, "case %zu: body is not JSON: %s", i, r.body);
        json_t *e = json_object_get(o, "error");
        char keys[128];
        keys_of(e, keys, sizeof keys);
        ASSERT_STR_EQ(keys, "message,type,param,code");
        const char *type = json_string_value(json_object_get(e, "type"));
        ASSERT_STR_EQ(type, c->status == 404 ? "NotFoundError" : "BadRequestError");
        ASSERT_EQ_INT(json_integer_value(json_object_get(e, "code")), c->status);
        ASSERT(json_is_null(json_object_get(e, "param")));
        const char *msg = json_string_value(json_object_get(e, "message"));
        if (c->message)
            ASSERT_MSG(msg && strcmp(msg, c->message) == 0, "case %zu (%s): message \"%s\"", i,
                       c->body, msg ? msg : "(null)");
        else
            ASSERT_MSG(msg && strncmp(msg, c->prefix, strlen(c->prefix)) == 0,
                       "case %zu (%s): message \"%s\"", i, c->body, msg ? msg : "(null)");
        json_decref(o);
        resp_free(&r);
    }
    /* wrong content type */
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", "Content-Type: text/plain\r\n",
                   "{\"prompt\":\"a\"}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"Unsupported Media Type: Only 'application/json' is "
                            "allowed\"");
    resp_free(&r);
    ASSERT(http_do(g_port, "POST", "/v1/completions",
                   "Content-Type: Application/JSON; charset=utf-8\r\n",
                   "{\"prompt\":\"a\",\"max_tokens\":1}", &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    resp_free(&r);
    /* the server keeps serving */
    ASSERT(http_do(g_port, "GET", "/health", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    resp_free(&r);
}

TEST(sched_context_length_boundary)
{
    FIXTURE();
    /* P + M = L is accepted, P + M = L + 1 is not: find P with a token-id prompt */
    char body[8192];
    size_t at = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 500; i++)
        at += (size_t)snprintf(body + at, sizeof body - at, "%s%d", i ? "," : "", 40 + i % 50);
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":12,\"temperature\":0}");
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    resp_free(&r);
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":13,\"temperature\":0}");
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"'max_tokens' or 'max_completion_tokens' is too large: "
                            "13. This model's maximum context length is 512 tokens and your "
                            "request has 500 input tokens (13 > 512 - 500).\"");
    resp_free(&r);
}

TEST(sched_metrics_counts)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_CONTAINS(r.body, "# TYPE vllm:request_success_total counter");
    ASSERT_CONTAINS(r.body, "vllm:request_success_total{model_name=\"tiny\",engine=\"0\","
                            "finished_reason=\"abort\"}");
    ASSERT_CONTAINS(r.body, "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\","
                            "engine=\"0\",le=\"0.001\"}");
    ASSERT_CONTAINS(r.body, "pd:instance_up{role=\"prefill\",instance=\"127.0.0.1:");
    ASSERT_CONTAINS(r.body, "pd:kv_transfer_bytes_total{model_name=\"tiny\",transport=\"tcp\"");
    ASSERT_CONTAINS(r.body, "vllm:request_prompt_tokens_bucket{model_name=\"tiny\",engine=\"0\","
                            "le=\"500.0\"}");
    resp_free(&r);
}

/* One completions answer's choices: their texts and the sums of their token logprobs (when
 * listed). Returns the number of choices. */
static int best_of_choices(const char *body, char texts[][256], double *sums, int max)
{
    json_t *o = json_loads(body, 0, NULL);
    json_t *cs = json_object_get(o, "choices");
    int n = 0;
    for (; o && n < (int)json_array_size(cs) && n < max; n++) {
        json_t *c = json_array_get(cs, (size_t)n);
        if (json_integer_value(json_object_get(c, "index")) != n) break;
        snprintf(texts[n], 256, "%s", json_string_value(json_object_get(c, "text")));
        json_t *tl = json_object_get(json_object_get(c, "logprobs"), "token_logprobs");
        sums[n] = 0;
        for (size_t k = 0; k < json_array_size(tl); k++)
            sums[n] += json_number_value(json_array_get(tl, k));
    }
    json_decref(o);
    return n;
}

/* best_of > n (vLLM 0.5): best_of sequences are sampled and the n of the highest cumulative
 * logprob answered, best first, whole even when a stream was asked for. With the same seed the
 * sequences are those of an n = best_of request (choice i samples with seed + i), whose listed
 * logprobs give the order; through the split cluster. */
TEST(sched_best_of)
{
    FIXTURE();
    http_resp r;
    char all[4][256], got[4][256];
    double sum[4], unused[4];
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL,
                   "{\"prompt\":\"Hello world\",\"max_tokens\":8,\"temperature\":1,\"seed\":123,"
                   "\"n\":4,\"logprobs\":0,\"ignore_eos\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    ASSERT_EQ_INT(best_of_choices(r.body, all, sum, 4), 4);
    resp_free(&r);
    int order[4] = {0, 1, 2, 3}; /* by sum, best first, stable */
    for (int i = 1; i < 4; i++)
        for (int j = i; j > 0 && sum[order[j - 1]] < sum[order[j]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    ASSERT_MSG(sum[order[0]] - sum[order[1]] > 1e-3 && sum[order[1]] - sum[order[2]] > 1e-3,
               "near ties (%g %g %g): pick another seed", sum[order[0]], sum[order[1]],
               sum[order[2]]);
    const char *bodies[2] = {
        "{\"prompt\":\"Hello world\",\"max_tokens\":8,\"temperature\":1,\"seed\":123,\"n\":2,"
        "\"best_of\":4,\"ignore_eos\":true}",
        "{\"prompt\":\"Hello world\",\"max_tokens\":8,\"temperature\":1,\"seed\":123,\"n\":2,"
        "\"best_of\":4,\"ignore_eos\":true,\"stream\":true}"};
    for (int k = 0; k < 2; k++) {
        ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, bodies[k], &r) == 0);
        ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
        char ct[64];
        ASSERT_STR_EQ(header(&r, "Content-Type", ct, sizeof ct), "application/json");
        ASSERT_EQ_INT(best_of_choices(r.body, got, unused, 4), 2);
        ASSERT_STR_EQ(got[0], all[order[0]]);
        ASSERT_STR_EQ(got[1], all[order[1]]);
        ASSERT_CONTAINS(r.body, "\"logprobs\":null");
        ASSERT_CONTAINS(r.body, "\"completion_tokens\":16,");
        resp_free(&r);
    }
}

TEST(sched_logprobs)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL,
                   "{\"prompt\":\"Hello world\",\"max_tokens\":5,\"temperature\":0,"
                   "\"ignore_eos\":true,\"logprobs\":2}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    char keys[256];
    keys_of(lp, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "text_offset,token_logprobs,tokens,top_logprobs");
    json_t *off = json_object_get(lp, "text_offset"), *tl = json_object_get(lp, "token_logprobs");
    json_t *toks = json_object_get(lp, "tokens"), *top = json_object_get(lp, "top_logprobs");
    ASSERT_EQ_INT(json_array_size(off), 5);
    ASSERT_EQ_INT(json_array_size(tl), 5);
    ASSERT_EQ_INT(json_array_size(toks), 5);
    ASSERT_EQ_INT(json_array_size(top), 5);
    ASSERT_EQ_INT(json_integer_value(json_array_get(off, 0)), 0);
    for (size_t i = 0; i < 5; i++) {
        if (i)
            ASSERT(json_integer_value(json_array_get(off, i)) >=
                   json_integer_value(json_array_get(off, i - 1)));
        double v = json_number_value(json_array_get(tl, i));
        ASSERT(v <= 0 && v >= -9999.0);
        json_t *d = json_array_get(top, i);
        ASSERT(json_object_size(d) >= 1 && json_object_size(d) <= 3);
        /* greedy: the sampled token is the most likely one */
        const char *k;
        json_t *x;
        json_object_foreach(d, k, x) ASSERT(json_number_value(x) <= v + 1e-6);
    }
    json_decref(o);
    resp_free(&r);

    ASSERT(http_do(g_port, "POST", "/v1/chat/completions", NULL,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":3,"
                   "\"temperature\":0,\"ignore_eos\":true,\"logprobs\":true,\"top_logprobs\":3,"
                   "\"stream\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    char *ev[16];
    int n = cl_sse_events(r.body, ev, 16);
    ASSERT_EQ_INT(n, 1 + 3 + 1);
    for (int i = 1; i <= 3; i++) {
        json_t *e = json_loads(ev[i], 0, NULL);
        ASSERT(e);
        json_t *c = json_object_get(
            json_object_get(json_array_get(json_object_get(e, "choices"), 0), "logprobs"),
            "content");
        ASSERT_EQ_INT(json_array_size(c), 1);
        json_t *item = json_array_get(c, 0);
        keys_of(item, keys, sizeof keys);
        ASSERT_STR_EQ(keys, "token,logprob,bytes,top_logprobs");
        const char *tok = json_string_value(json_object_get(item, "token"));
        json_t *bytes = json_object_get(item, "bytes");
        ASSERT_EQ_INT(json_array_size(bytes), strlen(tok));
        for (size_t j = 0; j < strlen(tok); j++)
            ASSERT_EQ_INT(json_integer_value(json_array_get(bytes, j)), (unsigned char)tok[j]);
        json_t *tops = json_object_get(item, "top_logprobs");
        ASSERT_EQ_INT(json_array_size(tops), 3);
        for (size_t j = 1; j < 3; j++)
            ASSERT(json_number_value(json_object_get(json_array_get(tops, j), "logprob")) <=
                   json_number_value(json_object_get(json_array_get(tops, j - 1), "logprob")));
        json_decref(e);
    }
    resp_free(&r);
}

TEST(sched_legacy_generate)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port_legacy, "POST", "/v1/completions", NULL, "{\"prompt\":\"a\"}", &r) == 0);
    ASSERT_EQ_INT(r.status, 404);
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", "Content-Type: text/plain\r\n",
                   "{\"prompt\":\"San Francisco is a\",\"max_tokens\":6,\"temperature\":0,"
                   "\"ignore_eos\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    const char *pre = "{\"text\":[\"San Francisco is a";
    ASSERT_MSG(strncmp(r.body, pre, strlen(pre)) == 0, "body %s", r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    char full[4096];
    snprintf(full, sizeof full, "%s",
             json_string_value(json_array_get(json_object_get(o, "text"), 0)));
    json_decref(o);
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL,
                   "{\"prompt\":\"San Francisco is a\",\"max_tokens\":6,\"temperature\":0,"
                   "\"ignore_eos\":true,\"stream\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Content-Type", h, sizeof h), "application/x-ndjson");
    int lines = 0;
    char last[4096] = "";
    for (char *save = NULL, *line = strtok_r(r.body, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        const char *lpre = "{\"text\": [\"San Francisco is a";
        ASSERT_MSG(strncmp(line, lpre, strlen(lpre)) == 0, "line %s", line);
        json_t *e = json_loads(line, 0, NULL);
        ASSERT(e);
        const char *t = json_string_value(json_array_get(json_object_get(e, "text"), 0));
        ASSERT(strncmp(t, last, strlen(last)) == 0); /* cumulative */
        snprintf(last, sizeof last, "%s", t);
        json_decref(e);
        lines++;
    }
    ASSERT_EQ_INT(lines, 6);
    ASSERT_STR_EQ(last, full);
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL, "{\"prompt\":\"a\",\"echo\":true}",
                   &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"Unsupported sampling parameter: `echo`.\"");
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL, "{\"max_tokens\":3}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"The field `prompt` is required.\"");
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL, "{\"prompt\":[1]}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"The field `prompt` must be a string.\"");
    resp_free(&r);
    /* beam search's keys are known here (vLLM 0.5 passes them to SamplingParams) */
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL,
                   "{\"prompt\":\"a\",\"length_penalty\":2,\"use_beam_search\":false}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "length_penalty is not effective and must be the default value of 1.0");
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL,
                   "{\"prompt\":\"a\",\"length_penalty\":1,\"early_stopping\":false,"
                   "\"max_tokens\":2}",
                   &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    resp_free(&r);
    /* and early_stopping may be "never" there (a SamplingParams value) */
    static const struct {
        const char *body, *msg;
    } es[] = {{"{\"prompt\":\"a\",\"early_stopping\":\"never\"}",
               "early_stopping is not effective and must be False when not using beam search."},
              {"{\"prompt\":\"a\",\"early_stopping\":\"soon\"}",
               "early_stopping must be True, False, or 'never', got soon."}};
    for (size_t i = 0; i < sizeof es / sizeof *es; i++) {
        ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL, es[i].body, &r) == 0);
        ASSERT_EQ_INT(r.status, 400);
        ASSERT_CONTAINS(r.body, es[i].msg);
        resp_free(&r);
    }
}

/* The npm cache directory holding the OpenAI SDK (abs: PATH_MAX bytes), or NULL when it is not
 * cached (tests/npm_cache.sh openai@4). */
static const char *sdk_cache(char *abs)
{
    const char *cache = getenv("PD_NPM_CACHE");
    const char *root = getenv("PD_SOURCE_ROOT");
    char cdir[700], pkg[800];
    if (cache)
        snprintf(cdir, sizeof cdir, "%s", cache);
    else
        snprintf(cdir, sizeof cdir, "%s/.cache/npm", root ? root : ".");
    snprintf(pkg, sizeof pkg, "%s/node_modules/openai/package.json", cdir);
    if (access(pkg, R_OK) != 0) return NULL;
    if (!realpath(cdir, abs)) snprintf(abs, PATH_MAX, "%s", cdir);
    return abs;
}

/* Runs tests/data/scheduler/<script> with node and args; its exit status (0: all it checks held;
 * its output in <cluster dir>/<script>.out, the tail printed when it failed). */
static int run_sdk_script(const char *cache, const char *script, char *const args[])
{
    char path[800], out[800], cenv[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/scheduler/%s", pdt_data_dir(), script);
    snprintf(out, sizeof out, "%s/%s.out", g_c.dir, script);
    snprintf(cenv, sizeof cenv, "PD_NPM_CACHE=%s", cache);
    char *argv[8] = {"/usr/bin/node", path};
    for (int i = 0; args[i] && i < 5; i++) argv[2 + i] = args[i];
    char *env[] = {cenv, NULL};
    cl_proc p;
    if (cl_spawn(&p, "node", argv, env, out) != 0) return -1;
    int st = cl_wait(&p, 60000);
    if (st != 0) cl_dump_log(&p, 20);
    return st;
}

/* The official OpenAI Node SDK against pd-scheduler (skipped when the SDK is not cached). */
TEST(sched_openai_node_sdk)
{
    FIXTURE();
    char abs[PATH_MAX], url[64];
    const char *cache = sdk_cache(abs);
    if (!cache) SKIP("openai SDK not in the npm cache (tests/npm_cache.sh openai@4)");
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1", g_port);
    char *args[] = {url, "tiny", NULL};
    ASSERT_EQ_INT(run_sdk_script(cache, "openai_sdk.mjs", args), 0);
}

/* The SDK's tools flow (openai_sdk_tools.mjs says what it checks: auto, "required", named) on a
 * scheduler started with --enable-auto-tool-choice --tool-call-parser hermes next to the
 * fixture's, which has neither and refuses tool_choice auto with vLLM's message. */
TEST(sched_openai_node_sdk_tools)
{
    FIXTURE();
    char abs[PATH_MAX], with[64], without[64];
    const char *cache = sdk_cache(abs);
    if (!cache) SKIP("openai SDK not in the npm cache (tests/npm_cache.sh openai@4)");
    char *flags[] = {"--enable-auto-tool-choice", "--tool-call-parser", "hermes", NULL};
    cl_proc sp;
    int port = 0;
    ASSERT_OK(start_scheduler(&sp, &port, "scheduler_tools", flags, "1"));
    snprintf(with, sizeof with, "http://127.0.0.1:%d/v1", port);
    snprintf(without, sizeof without, "http://127.0.0.1:%d/v1", g_port);
    char *args[] = {with, without, "tiny", g_model, NULL};
    int st = run_sdk_script(cache, "openai_sdk_tools.mjs", args);
    int stopped = cl_stop(&sp, 10000);
    ASSERT_EQ_INT(st, 0);
    ASSERT_EQ_INT(stopped, 0);
}

/* vLLM's start-up checks of the tool flags: each bad command line stops pd-scheduler with a
 * message naming the flag (and, for a parser, the ones there are). */
TEST(sched_tool_flags_checked_at_start)
{
    FIXTURE();
    static const struct {
        const char *flags[4];
        const char *message;
    } cases[] = {
        {{"--enable-auto-tool-choice"},
         "--enable-auto-tool-choice requires --tool-call-parser (hermes, llama3_json or mistral)"},
        {{"--enable-auto-tool-choice", "--tool-call-parser", "pythonic"},
         "--tool-call-parser: expected hermes, llama3_json or mistral, got 'pythonic'"},
        {{"--tool-parser-plugin", "my_parser.py"},
         "--tool-parser-plugin my_parser.py: pdserve cannot load vLLM's Python tool parser "
         "plugins"},
        {{"--enable-auto-tool-choice", "--tool-call-parser", "mistral"},
         "--tool-call-parser mistral: the tokenizer of"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cl_proc sp;
        int port = 0;
        char name[32], cmd[1200];
        snprintf(name, sizeof name, "scheduler_tool_flags_%zu", i);
        ASSERT_MSG(start_scheduler(&sp, &port, name, (char *const *)cases[i].flags, "1") != 0,
                   "pd-scheduler started with %s", cases[i].flags[0]);
        cl_stop(&sp, 10000);
        snprintf(cmd, sizeof cmd, "grep -qF -- \"%s\" '%s/%s.log'", cases[i].message, g_c.dir,
                 name);
        ASSERT_MSG(system(cmd) == 0, "case %zu: the start-up error is not \"%s\"", i,
                   cases[i].message);
    }
}

/* The greedy answer's text from the scheduler on port (malloc'd), or NULL: body to path, the
 * first choice's message content (chat) or text. */
static char *answer_text(int port, const char *path, const char *body)
{
    http_resp r;
    if (http_do(port, "POST", path, NULL, body, &r) != 0) return NULL;
    json_t *o = r.status == 200 ? json_loads(r.body, 0, NULL) : NULL;
    if (!o) printf("    %s: status %d: %s\n", path, r.status, r.body ? r.body : "");
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    json_t *m = json_object_get(c, "message");
    const char *t =
        json_string_value(m ? json_object_get(m, "content") : json_object_get(c, "text"));
    char *out = t ? strdup(t) : NULL;
    json_decref(o);
    resp_free(&r);
    return out;
}

/* --tokenizer DIR (vLLM's) on every role: the tokenizer and the chat template come from DIR, the
 * rest of the model from --model. A 1P1D cluster and its scheduler on a model directory without
 * tokenizer files answer as the fixture's do: chat (the template), and a stop string (which the
 * decode instance needs the tokenizer for). Without --tokenizer that directory is refused at
 * start-up, naming the file. */
TEST(sched_tokenizer_from_another_directory)
{
    FIXTURE();
    char dir[700], src[1000], dst[1000];
    snprintf(dir, sizeof dir, "%s/model-without-tokenizer", pdt_tmp_dir());
    ASSERT(mkdir(dir, 0755) == 0 || errno == EEXIST);
    DIR *d = opendir(g_model);
    ASSERT(d);
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.' || strncmp(e->d_name, "tokenizer", 9) == 0 ||
            strncmp(e->d_name, "chat_template", 13) == 0)
            continue;
        snprintf(src, sizeof src, "%s/%s", g_model, e->d_name);
        snprintf(dst, sizeof dst, "%s/%s", dir, e->d_name);
        if (symlink(src, dst) != 0 && errno != EEXIST) break;
    }
    closedir(d);
    char *tok[] = {"--tokenizer", g_model, NULL};
    cl_cluster c2;
    ASSERT_OK(cl_start(&c2, dir, "0", "1", tok));
    char *with[] = {"--model", dir, "--tokenizer", g_model, NULL};
    cl_proc sp;
    int port = 0;
    int started = start_scheduler_on(&c2, &sp, &port, "scheduler_tokenizer", with, "1");
    const char *chat = "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"Tell "
                       "me a story\"}],\"max_tokens\":12,\"temperature\":0}";
    const char *stop = "{\"model\":\"tiny\",\"prompt\":\"Once upon a time\",\"max_tokens\":16,"
                       "\"temperature\":0,\"ignore_eos\":true,\"stop\":[\"e\"]}";
    char *got[2] = {NULL, NULL}, *want[2] = {NULL, NULL};
    if (started == 0) {
        got[0] = answer_text(port, "/v1/chat/completions", chat);
        got[1] = answer_text(port, "/v1/completions", stop);
    }
    want[0] = answer_text(g_port, "/v1/chat/completions", chat);
    want[1] = answer_text(g_port, "/v1/completions", stop);
    int stopped = started == 0 ? cl_stop(&sp, 10000) : 0;
    cl_stop_all(&c2);
    ASSERT_MSG(started == 0, "pd-scheduler with --tokenizer did not start");
    for (int i = 0; i < 2; i++) {
        ASSERT_MSG(got[i] && want[i], "request %d failed", i);
        printf("    through --tokenizer: \"%s\"\n", got[i]);
        ASSERT_STR_EQ(got[i], want[i]);
        free(got[i]);
        free(want[i]);
    }
    ASSERT_EQ_INT(stopped, 0);
    /* an instance detokenizes its answers (and checks stop strings): without a tokenizer it
       refuses to start, naming the file, as the scheduler does */
    int bare = cl_start(&c2, dir, "0", "1", NULL);
    cl_stop_all(&c2);
    ASSERT_MSG(bare != 0, "instances started on a model directory without a tokenizer");
    pd_error_clear();
    char cmd[900];
    snprintf(cmd, sizeof cmd,
             "grep -q 'model-without-tokenizer/tokenizer.json: No such file.*--tokenizer' "
             "'%s/prefill0.log'", /* the one cl_start waited for; decode is stopped meanwhile */
             c2.dir);
    ASSERT_MSG(system(cmd) == 0, "the instances' start-up error does not name tokenizer.json");
    char *without[] = {"--model", dir, NULL};
    ASSERT_MSG(start_scheduler(&sp, &port, "scheduler_no_tokenizer", without, "1") != 0,
               "pd-scheduler started on a model directory without a tokenizer");
    cl_stop(&sp, 10000);
    snprintf(cmd, sizeof cmd,
             "grep -q 'model-without-tokenizer/tokenizer.json' '%s/scheduler_no_tokenizer.log'",
             g_c.dir);
    ASSERT_MSG(system(cmd) == 0, "the start-up error does not name tokenizer.json");
}

/* The choices and usage of a 200 answer to body on port (a JSON object "{choices, usage}"),
 * NULL with the reason printed otherwise. */
static json_t *answer_choices(int port, const char *body)
{
    http_resp r;
    if (http_do(port, "POST", "/v1/completions", NULL, body, &r) != 0) return NULL;
    json_t *o = r.status == 200 ? json_loads(r.body, 0, NULL) : NULL;
    if (!o) printf("    status %d: %s\n", r.status, r.body ? r.body : "");
    resp_free(&r);
    json_t *out = o ? json_pack("{sOsO}", "choices", json_object_get(o, "choices"), "usage",
                                json_object_get(o, "usage"))
                    : NULL;
    json_decref(o);
    return out;
}

/* Conditional disaggregation (issue 28 item 3): a scheduler with --max-local-prefill-length 8 on
 * the fixture's cluster has the decode instance prefill prompts of up to 8 tokens itself (the
 * prefill instance's Stats do not move) and sends longer ones through the prefill instance; every
 * answer, greedy and seeded, n = 2 and prompt logprobs included, equals the fixture scheduler's
 * (always split) to the last logprob. */
TEST(sched_local_prefill_equals_split)
{
    FIXTURE();
    char *args[] = {"--max-local-prefill-length", "8", NULL};
    cl_proc sp;
    int port = 0;
    ASSERT_OK(start_scheduler(&sp, &port, "scheduler_local", args, "1"));
    static const char *const bodies[] = {
        "{\"prompt\":[5,6,7],\"max_tokens\":12,\"temperature\":0,\"ignore_eos\":true,"
        "\"logprobs\":2}",
        "{\"prompt\":[9,8,7,6,5],\"max_tokens\":12,\"temperature\":0.9,\"seed\":123,"
        "\"ignore_eos\":true,\"logprobs\":2}",
        "{\"prompt\":[11,12],\"max_tokens\":8,\"temperature\":1,\"seed\":7,\"n\":2,"
        "\"ignore_eos\":true,\"logprobs\":1}",
        "{\"prompt\":[3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22],\"max_tokens\":12,"
        "\"temperature\":0.7,\"seed\":5,\"ignore_eos\":true,\"logprobs\":2}",
        "{\"prompt\":[5,6,7,8],\"max_tokens\":4,\"temperature\":0,\"ignore_eos\":true,"
        "\"prompt_logprobs\":2,\"echo\":true,\"logprobs\":1}",
    };
    enum { NB = sizeof bodies / sizeof *bodies };
    /* prompt tokens prefilled on decode (prompt logprobs come from the prefill instance) */
    int64_t local_tokens[NB] = {3, 5, 2 * 2, 0, 0};
    int bad = 0;
    for (int i = 0; i < NB; i++) {
        Pd__StatsReply *p0 = cl_stats(&g_c, 0), *d0 = cl_stats(&g_c, 1);
        json_t *got = answer_choices(port, bodies[i]);
        Pd__StatsReply *p1 = cl_stats(&g_c, 0), *d1 = cl_stats(&g_c, 1);
        json_t *want = answer_choices(g_port, bodies[i]);
        bool same = got && want && json_equal(got, want);
        int64_t on_p = p0 && p1 ? p1->prompt_tokens - p0->prompt_tokens : -1,
                on_d = d0 && d1 ? d1->prompt_tokens - d0->prompt_tokens : -1;
        printf("    request %d: %s the split answer; prompt tokens on the prefill instance %lld, "
               "on the decode instance %lld\n",
               i, same ? "equals" : "DIFFERS FROM", (long long)on_p, (long long)on_d);
        if (!same) {
            char *a = got ? json_dumps(got, JSON_COMPACT) : NULL,
                 *b = want ? json_dumps(want, JSON_COMPACT) : NULL;
            printf("    local: %.600s\n    split: %.600s\n", a ? a : "-", b ? b : "-");
            free(a);
            free(b);
        }
        bad += !same;
        /* local: nothing on P; split: the prompt on P */
        if (local_tokens[i] ? on_p != 0 : on_p <= 0) bad++;
        if (local_tokens[i] && on_d < local_tokens[i]) bad++;
        json_decref(got);
        json_decref(want);
        Pd__StatsReply *all[] = {p0, p1, d0, d1};
        for (int k = 0; k < 4; k++)
            if (all[k]) pd__stats_reply__free_unpacked(all[k], NULL);
    }
    int st = cl_stop(&sp, 10000);
    if (st != 0 || bad) cl_dump_log(&sp, 30);
    ASSERT_EQ_INT(st, 0);
    ASSERT_EQ_INT(bad, 0);
}

/* --max-model-len past the model's positions is refused by pd-scheduler with the message the
 * instances give, instead of being accepted there and refused only by them. */
TEST(sched_max_model_len_checked_as_on_instances)
{
    FIXTURE();
    char *over[] = {"--max-model-len", "4096", NULL};
    cl_proc sp;
    int port = 0;
    ASSERT_MSG(start_scheduler(&sp, &port, "scheduler_too_long", over, "1") != 0,
               "pd-scheduler started with --max-model-len 4096 on a 2048-position model");
    cl_stop(&sp, 10000);
    char cmd[900];
    snprintf(cmd, sizeof cmd,
             "grep -qF 'User-specified max_model_len (4096) is greater than the derived "
             "max_model_len (max_position_embeddings=2048' '%s/scheduler_too_long.log'",
             g_c.dir);
    ASSERT_MSG(system(cmd) == 0, "the start-up error is not the instances' message");
}
