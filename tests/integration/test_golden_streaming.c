/* Golden tests of the HTTP framing and of bodies and streams byte for byte: §18.3
 * (Expect: 100-continue over and under the body limit), §18.11-17 (non-streaming bodies, the
 * chat and completions streams, stream_options, n=3 streams, several prompts). */
#define _GNU_SOURCE
#include "golden.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- HTTP framing (§1) -------------------------------------------------------------------- */

/* §18.3: Expect: 100-continue with a declared length over the limit gets 413 at once (before
 * any body byte is sent) and the connection closes; under the limit, 100 Continue. */
TEST(golden_03_expect_continue)
{
    FIXTURE();
    char rq[512];
    int n = snprintf(rq, sizeof rq,
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     "\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n",
                     BODY_LIMIT + 1);
    cl_conn c;
    ASSERT(cl_conn_open_raw(&c, g_port, rq, (size_t)n) == 0);
    int64_t deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (!c.eof && pd_now_ns() < deadline) cl_conn_poll(&c, 1, 100, 0);
    ASSERT_MSG(c.eof, "the connection stayed open; got: %s", c.buf ? c.buf : "(nothing)");
    ASSERT_EQ_INT(c.status, 413);
    ASSERT_MSG(strncmp(c.buf, "HTTP/1.1 413", 12) == 0, "no 100 Continue first: %s", c.buf);
    char *body = cl_conn_body(&c);
    char want[256];
    snprintf(want, sizeof want,
             "{\"error\":{\"message\":\"Request body exceeds %d bytes.\",\"type\":"
             "\"PayloadTooLargeError\",\"param\":null,\"code\":413}}",
             BODY_LIMIT);
    ASSERT_STR_EQ(body ? body : "", want);
    free(body);
    cl_conn_close(&c);

    /* a body one byte over the limit on a keep-alive connection: 413, then the server closes */
    char *big = malloc(BODY_LIMIT + 2);
    memset(big, ' ', BODY_LIMIT + 1);
    big[0] = '{';
    big[BODY_LIMIT] = '}';
    big[BODY_LIMIT + 1] = '\0';
    int rc = cl_conn_open(&c, g_port, "POST", "/v1/completions", NULL, big, true);
    free(big);
    ASSERT(rc == 0);
    deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (!c.eof && pd_now_ns() < deadline) cl_conn_poll(&c, 1, 100, 0);
    bool closed = c.eof;
    int st = c.status;
    cl_conn_close(&c);
    ASSERT_EQ_INT(st, 413);
    ASSERT_MSG(closed, "the connection stayed open after 413");

    /* under the limit: "100 Continue", then the body, then the real answer */
    const char *js = "{\"prompt\":[1,2,3],\"max_tokens\":1}";
    n = snprintf(rq, sizeof rq,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
                 strlen(js));
    ASSERT(cl_conn_open_raw(&c, g_port, rq, (size_t)n) == 0);
    deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (c.len < 25 && !c.eof && pd_now_ns() < deadline) cl_conn_poll(&c, 1, 100, 0);
    bool cont = c.buf && strncmp(c.buf, "HTTP/1.1 100 Continue\r\n\r\n", 25) == 0;
    ASSERT_MSG(cont || !c.buf, "first bytes: %s", c.buf ? c.buf : "");
    ssize_t w = send(c.fd, js, strlen(js), MSG_NOSIGNAL);
    bool done = cl_conn_wait_all(&c, 1, REQ_TIMEOUT_MS);
    conn_hangup(&c);
    const char *final = c.buf ? strstr(c.buf, "HTTP/1.1 200") : NULL;
    bool ok = cont && w == (ssize_t)strlen(js) && done && final;
    char got[256];
    snprintf(got, sizeof got, "%s", c.buf ? c.buf : "");
    cl_conn_close(&c);
    ASSERT_MSG(ok, "100-continue under the limit: %s", got);
}

/* ---- shapes and streaming (§10, §11) ------------------------------------------------------ */

/* §18.12/13: the chat stream byte for byte (id and created masked after checking them), token
 * chunk count = completion_tokens, concatenation = the non-streaming content. */
TEST(golden_13_chat_stream_bytes)
{
    FIXTURE();
    const char *base = "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story\"}],"
                       "\"max_tokens\":7,\"temperature\":0,\"ignore_eos\":true";
    char body[512];
    snprintf(body, sizeof body, "%s}", base);
    /* §18.11: the non-streaming chat body of §10 byte for byte (id, created, content, P masked) */
    resp f;
    ASSERT(post(g_port, "/v1/chat/completions", body, &f) == 0);
    ASSERT_EQ_INT(f.status, 200);
    json_t *full = json_loads(f.body, 0, NULL);
    ASSERT(full);
    char want_text[4096], want_full[8192];
    snprintf(want_text, sizeof want_text, "%s", choice_text(full, 0));
    int64_t P = usage_of(full, "prompt_tokens"), C = usage_of(full, "completion_tokens");
    char *qt = jstr(want_text);
    snprintf(
        want_full, sizeof want_full,
        "{\"id\":\"%s\",\"object\":\"chat.completion\",\"created\":%lld,\"model\":\"tiny\","
        "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":%s,"
        "\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,"
        "\"tool_calls\":[],\"reasoning_content\":null},\"logprobs\":null,\"finish_reason\":"
        "\"length\",\"stop_reason\":null}],\"service_tier\":null,\"system_fingerprint\":null,"
        "\"usage\":{\"prompt_tokens\":%lld,\"total_tokens\":%lld,\"completion_tokens\":7,"
        "\"prompt_tokens_details\":null},\"prompt_logprobs\":null,\"kv_transfer_params\":null}",
        json_string_value(json_object_get(full, "id")),
        (long long)json_integer_value(json_object_get(full, "created")), qt, (long long)P,
        (long long)(P + 7));
    free(qt);
    json_decref(full);
    bool same_full = strcmp(f.body, want_full) == 0;
    if (!same_full) printf("    got  %s\n    want %s\n", f.body, want_full);
    resp_free(&f);
    ASSERT(same_full);
    ASSERT_EQ_INT(C, 7);

    snprintf(body, sizeof body, "%s,\"stream\":true,\"stream_options\":{}}", base);
    int64_t t0 = (int64_t)time(NULL);
    resp r;
    ASSERT(post(g_port, "/v1/chat/completions", body, &r) == 0);
    int64_t t1 = (int64_t)time(NULL);
    ASSERT_MSG(r.status == 200, "status %d %s", r.status, r.body);
    char h[128], rid[64];
    ASSERT_STR_EQ(hdr(&r, "Content-Type", h, sizeof h), "text/event-stream; charset=utf-8");
    ASSERT_STR_EQ(hdr(&r, "Transfer-Encoding", h, sizeof h), "chunked");
    ASSERT(hdr(&r, "X-Request-Id", rid, sizeof rid));
    char *copy = strdup(r.body);
    char *ev[64];
    int n = cl_sse_events(copy, ev, 64);
    ASSERT_MSG(n == 1 + 7 + 1 + 1, "%d events in %s", n, r.body);
    json_t *e0 = json_loads(ev[0], 0, NULL);
    ASSERT(e0);
    char id[64];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(e0, "id")));
    int64_t created = json_integer_value(json_object_get(e0, "created"));
    json_decref(e0);
    ASSERT_MSG(is_hex_id(id, "chatcmpl-"), "id %s", id);
    ASSERT_STR_EQ(id + 9, rid);
    ASSERT_MSG(created >= t0 - 1 && created <= t1 + 1, "created %lld", (long long)created);
    /* the whole body from the contract's template, with each chunk's delta */
    size_t cap = strlen(r.body) + 4096, at = 0;
    char *want = malloc(cap);
    char pre[256], text[4096] = "";
    snprintf(pre, sizeof pre,
             "data: {\"id\":\"%s\",\"object\":\"chat.completion.chunk\",\"created\":%lld,"
             "\"model\":\"tiny\",\"choices\":",
             id, (long long)created);
    at += (size_t)snprintf(want + at, cap - at,
                           "%s[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
                           "\"logprobs\":null,\"finish_reason\":null}]}\n\n",
                           pre);
    for (int i = 1; i <= 7; i++) {
        json_t *e = json_loads(ev[i], 0, NULL);
        const char *d = e ? choice_text(e, 0) : NULL;
        char *q = jstr(d ? d : "(missing)");
        strncat(text, d ? d : "", sizeof text - strlen(text) - 1);
        at += (size_t)snprintf(want + at, cap - at,
                               "%s[{\"index\":0,\"delta\":{\"content\":%s},\"logprobs\":null,"
                               "\"finish_reason\":%s}]}\n\n",
                               pre, q, i < 7 ? "null" : "\"length\",\"stop_reason\":null");
        free(q);
        json_decref(e);
    }
    at += (size_t)snprintf(want + at, cap - at,
                           "%s[],\"usage\":{\"prompt_tokens\":%lld,\"total_tokens\":%lld,"
                           "\"completion_tokens\":7}}\n\ndata: [DONE]\n\n",
                           pre, (long long)P, (long long)(P + 7));
    bool same = strcmp(r.body, want) == 0;
    if (!same) printf("    got:\n%s\n    want:\n%s\n", r.body, want);
    free(want);
    free(copy);
    resp_free(&r);
    ASSERT_MSG(same, "chat stream differs from §11.2");
    ASSERT_STR_EQ(text, want_text);
}

/* §18.12/14: the completions stream byte for byte (§11.3 example's shape): token-id prompt of
 * known length, every chunk with "usage":null, the usage chunk without prompt_tokens_details. */
TEST(golden_14_completions_stream_bytes)
{
    FIXTURE();
    const char *base = "{\"prompt\":[40,41,42,43,44,45],\"max_tokens\":3,\"temperature\":0,"
                       "\"ignore_eos\":true";
    char body[512];
    snprintf(body, sizeof body, "%s}", base);
    /* §18.11: the non-streaming body of §10 byte for byte (id, created and text masked) */
    resp f;
    ASSERT(post(g_port, "/v1/completions", body, &f) == 0);
    ASSERT_EQ_INT(f.status, 200);
    json_t *full = json_loads(f.body, 0, NULL);
    ASSERT(full);
    char want_text[4096], want_full[8192];
    snprintf(want_text, sizeof want_text, "%s", choice_text(full, 0));
    char *qt = jstr(want_text);
    snprintf(want_full, sizeof want_full,
             "{\"id\":\"%s\",\"object\":\"text_completion\",\"created\":%lld,\"model\":\"tiny\","
             "\"choices\":[{\"index\":0,\"text\":%s,\"logprobs\":null,\"finish_reason\":\"length\","
             "\"stop_reason\":null,\"prompt_logprobs\":null}],\"service_tier\":null,"
             "\"system_fingerprint\":null,\"usage\":{\"prompt_tokens\":6,\"total_tokens\":9,"
             "\"completion_tokens\":3,\"prompt_tokens_details\":null},\"kv_transfer_params\":null}",
             json_string_value(json_object_get(full, "id")),
             (long long)json_integer_value(json_object_get(full, "created")), qt);
    free(qt);
    json_decref(full);
    bool same_full = strcmp(f.body, want_full) == 0;
    if (!same_full) printf("    got  %s\n    want %s\n", f.body, want_full);
    resp_free(&f);
    ASSERT(same_full);

    snprintf(body, sizeof body, "%s,\"stream\":true,\"stream_options\":{}}", base);
    resp r;
    ASSERT(post(g_port, "/v1/completions", body, &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d %s", r.status, r.body);
    char rid[64];
    ASSERT(hdr(&r, "X-Request-Id", rid, sizeof rid));
    char *copy = strdup(r.body);
    char *ev[16];
    int n = cl_sse_events(copy, ev, 16);
    ASSERT_MSG(n == 3 + 1 + 1, "%d events", n);
    json_t *e0 = json_loads(ev[0], 0, NULL);
    ASSERT(e0);
    char id[64];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(e0, "id")));
    int64_t created = json_integer_value(json_object_get(e0, "created"));
    json_decref(e0);
    ASSERT_MSG(is_hex_id(id, "cmpl-"), "id %s", id);
    ASSERT_STR_EQ(id + 5, rid);
    size_t cap = strlen(r.body) + 4096, at = 0;
    char *want = malloc(cap);
    char pre[256], text[4096] = "";
    snprintf(pre, sizeof pre,
             "data: {\"id\":\"%s\",\"object\":\"text_completion\",\"created\":%lld,"
             "\"model\":\"tiny\",\"choices\":",
             id, (long long)created);
    for (int i = 0; i < 3; i++) {
        json_t *e = json_loads(ev[i], 0, NULL);
        const char *d = e ? choice_text(e, 0) : NULL;
        char *q = jstr(d ? d : "(missing)");
        strncat(text, d ? d : "", sizeof text - strlen(text) - 1);
        at += (size_t)snprintf(want + at, cap - at,
                               "%s[{\"index\":0,\"text\":%s,\"logprobs\":null,\"finish_reason\":"
                               "%s,\"stop_reason\":null}],\"usage\":null}\n\n",
                               pre, q, i < 2 ? "null" : "\"length\"");
        free(q);
        json_decref(e);
    }
    at += (size_t)snprintf(want + at, cap - at,
                           "%s[],\"usage\":{\"prompt_tokens\":6,\"total_tokens\":9,"
                           "\"completion_tokens\":3}}\n\ndata: [DONE]\n\n",
                           pre);
    bool same = strcmp(r.body, want) == 0;
    if (!same) printf("    got:\n%s\n    want:\n%s\n", r.body, want);
    free(want);
    free(copy);
    resp_free(&r);
    ASSERT_MSG(same, "completions stream differs from §11.3");
    ASSERT_STR_EQ(text, want_text);
}
/* §18.12/15: stream_options {} / include_usage false / without stream / continuous usage. */
TEST(golden_15_stream_options)
{
    FIXTURE();
    json_t *ev[64];
    bool done;
    /* include_usage:false: no usage chunk; created and id the same in every chunk */
    int n = stream_events(g_port, "/v1/completions",
                          "{\"prompt\":[50,51,52],\"max_tokens\":4,\"temperature\":0,"
                          "\"ignore_eos\":true,\"stream\":true,"
                          "\"stream_options\":{\"include_usage\":false}}",
                          ev, 64, &done);
    ASSERT_EQ_INT(n, 4);
    ASSERT(done);
    bool same_created = true, no_usage_chunk = true;
    for (int i = 0; i < n; i++) {
        same_created &= json_integer_value(json_object_get(ev[i], "created")) ==
                            json_integer_value(json_object_get(ev[0], "created")) &&
                        strcmp(json_string_value(json_object_get(ev[i], "id")),
                               json_string_value(json_object_get(ev[0], "id"))) == 0;
        no_usage_chunk &= json_array_size(json_object_get(ev[i], "choices")) == 1 &&
                          json_is_null(json_object_get(ev[i], "usage"));
    }
    free_events(ev, n);
    ASSERT(same_created);
    ASSERT(no_usage_chunk);
    /* chat, include_usage:false: no usage chunk either */
    n = stream_events(g_port, "/v1/chat/completions",
                      "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":2,"
                      "\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                      "\"stream_options\":{\"include_usage\":false}}",
                      ev, 64, &done);
    ASSERT_EQ_INT(n, 1 + 2);
    bool any_usage = false;
    for (int i = 0; i < n; i++) any_usage |= json_object_get(ev[i], "usage") != NULL;
    free_events(ev, n);
    ASSERT(!any_usage);
    /* stream_options without stream: 400 (non-empty object), null: accepted */
    resp r;
    ASSERT(post(g_port, "/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":1,"
                "\"stream_options\":{\"include_usage\":false}}",
                &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_STR_EQ(r.body, "{\"error\":{\"message\":\"Stream options can only be defined when "
                          "`stream=True`.\",\"type\":\"BadRequestError\",\"param\":null,"
                          "\"code\":400}}");
    resp_free(&r);
    ASSERT(post(g_port, "/v1/completions",
                "{\"prompt\":[1,2],\"max_tokens\":1,\"stream\":false,\"stream_options\":null}",
                &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d %s", r.status, r.body);
    resp_free(&r);
    /* chat continuous_usage_stats, n=2: every chunk has usage; c per choice, 0 in role chunks */
    n = stream_events(g_port, "/v1/chat/completions",
                      "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":3,"
                      "\"n\":2,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                      "\"stream_options\":{\"continuous_usage_stats\":true}}",
                      ev, 64, &done);
    ASSERT_EQ_INT(n, 2 + 6 + 1);
    int64_t P = usage_of(ev[n - 1], "prompt_tokens");
    ASSERT(P > 0);
    int seen[2] = {0, 0};
    for (int i = 0; i < n; i++) {
        json_t *u = json_object_get(ev[i], "usage");
        char keys[128] = "";
        const char *k;
        json_t *v;
        json_object_foreach(u, k, v)
        {
            strcat(keys, k);
            strcat(keys, ",");
        }
        ASSERT_STR_EQ(keys, "prompt_tokens,total_tokens,completion_tokens,");
        json_t *c = json_array_get(json_object_get(ev[i], "choices"), 0);
        int64_t ct = usage_of(ev[i], "completion_tokens");
        if (c) {
            int idx = (int)json_integer_value(json_object_get(c, "index"));
            bool role = json_object_get(json_object_get(c, "delta"), "role") != NULL;
            if (!role) seen[idx]++;
            ASSERT_MSG(ct == seen[idx], "chunk %d choice %d: completion_tokens %lld, want %d", i,
                       idx, (long long)ct, seen[idx]);
        } else {
            ASSERT_EQ_INT(ct, 6); /* the final usage chunk sums the choices */
        }
        ASSERT_EQ_INT(usage_of(ev[i], "prompt_tokens"), P);
        ASSERT_EQ_INT(usage_of(ev[i], "total_tokens"), P + ct);
    }
    free_events(ev, n);
    /* completions continuous_usage_stats: usage with prompt_tokens_details:null per token chunk */
    resp rr;
    ASSERT(post(g_port, "/v1/completions",
                "{\"prompt\":[60,61,62,63],\"max_tokens\":2,\"temperature\":0,\"ignore_eos\":"
                "true,\"stream\":true,\"stream_options\":{\"continuous_usage_stats\":true}}",
                &rr) == 0);
    ASSERT_EQ_INT(rr.status, 200);
    ASSERT_CONTAINS(rr.body, "\"usage\":{\"prompt_tokens\":4,\"total_tokens\":5,"
                             "\"completion_tokens\":1,\"prompt_tokens_details\":null}}\n\n");
    ASSERT_CONTAINS(rr.body, "\"usage\":{\"prompt_tokens\":4,\"total_tokens\":6,"
                             "\"completion_tokens\":2,\"prompt_tokens_details\":null}}\n\n");
    ASSERT_CONTAINS(rr.body, "\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"total_tokens\":6,"
                             "\"completion_tokens\":2}}\n\ndata: [DONE]\n\n");
    resp_free(&rr);
}

/* §18.16: n=3 streaming: three role chunks first (index 0,1,2), each choice's chunks complete
 * and ending with its final chunk, one usage chunk with the summed completion_tokens. */
TEST(golden_16_n3_stream)
{
    FIXTURE();
    json_t *ev[64];
    bool done;
    int n = stream_events(g_port, "/v1/chat/completions",
                          "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4,"
                          "\"n\":3,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                          "\"stream_options\":{\"include_usage\":true}}",
                          ev, 64, &done);
    ASSERT_EQ_INT(n, 3 + 12 + 1);
    ASSERT(done);
    int count[3] = {0, 0, 0}, usage_chunks = 0;
    bool ok = true;
    char why[256] = "";
    for (int i = 0; i < n && ok; i++) {
        json_t *ch = json_object_get(ev[i], "choices");
        if (json_array_size(ch) == 0) {
            usage_chunks++;
            ok = i == n - 1 && usage_of(ev[i], "completion_tokens") == 12;
            snprintf(why, sizeof why, "usage chunk %d", i);
            continue;
        }
        ok = json_array_size(ch) == 1;
        json_t *c = json_array_get(ch, 0);
        int idx = (int)json_integer_value(json_object_get(c, "index"));
        bool role = json_object_get(json_object_get(c, "delta"), "role") != NULL;
        const char *fr = json_string_value(json_object_get(c, "finish_reason"));
        if (i < 3) {
            ok = ok && role && idx == i;
            snprintf(why, sizeof why, "chunk %d is not the role chunk of choice %d", i, i);
            continue;
        }
        ok = ok && !role && idx >= 0 && idx < 3;
        count[idx < 0 || idx > 2 ? 0 : idx]++;
        /* in order within the choice: only its 4th chunk is the final one */
        ok = ok && ((count[idx] == 4) == (fr != NULL)) && count[idx] <= 4;
        snprintf(why, sizeof why, "chunk %d (choice %d, #%d, finish %s)", i, idx, count[idx],
                 fr ? fr : "null");
    }
    free_events(ev, n);
    ASSERT_MSG(ok, "%s", why);
    ASSERT_EQ_INT(usage_chunks, 1);
    for (int i = 0; i < 3; i++) ASSERT_EQ_INT(count[i], 4);
}

/* §18.17: several prompts: index = prompt_idx*n+i; usage counts each prompt once. */
TEST(golden_17_multi_prompt_usage)
{
    FIXTURE();
    json_t *o = post_ok(g_port, "/v1/completions",
                        "{\"prompt\":[[10,11,12],[20,21,22,23,24]],\"n\":2,\"max_tokens\":3,"
                        "\"temperature\":0,\"ignore_eos\":true}");
    ASSERT(o);
    json_t *ch = json_object_get(o, "choices");
    size_t nc = json_array_size(ch);
    int64_t P = usage_of(o, "prompt_tokens"), C = usage_of(o, "completion_tokens");
    int64_t T = usage_of(o, "total_tokens");
    bool idx_ok = nc == 4;
    for (size_t i = 0; i < nc; i++)
        idx_ok &= json_integer_value(json_object_get(json_array_get(ch, i), "index")) == (int)i;
    bool same01 = strcmp(choice_text(o, 0), choice_text(o, 1)) == 0;
    json_decref(o);
    ASSERT(idx_ok);
    ASSERT(same01); /* greedy n=2: identical choices (§7.1) */
    ASSERT_EQ_INT(P, 3 + 5);
    ASSERT_EQ_INT(C, 4 * 3);
    ASSERT_EQ_INT(T, 8 + 12);
    /* streamed: the prompt of choice 2 and 3 is the second one; usage the same */
    json_t *ev[64];
    bool done;
    int n = stream_events(g_port, "/v1/completions",
                          "{\"prompt\":[[10,11,12],[20,21,22,23,24]],\"n\":2,\"max_tokens\":3,"
                          "\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                          "\"stream_options\":{}}",
                          ev, 64, &done);
    ASSERT_EQ_INT(n, 12 + 1);
    int64_t sp = usage_of(ev[n - 1], "prompt_tokens"),
            sc = usage_of(ev[n - 1], "completion_tokens");
    free_events(ev, n);
    ASSERT_EQ_INT(sp, 8);
    ASSERT_EQ_INT(sc, 12);
}
