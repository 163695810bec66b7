/* pd-bench internals: the pieces of the serving benchmark that main.c wires together.
 *
 * Design: one blocking HTTP/1.1 connection per request and one thread per request in flight
 * (a worker pool sized by --max-concurrency), so a request's timestamps are taken by the thread
 * that reads its socket, with nothing else queued in front of it. Responses are parsed with
 * llhttp (the parser the server uses; it undoes chunked encoding) and the body is split into
 * SSE events ("data: ...\n\n") or, for /generate, NDJSON lines. Every time is CLOCK_MONOTONIC
 * nanoseconds (pd_now_ns). Buffers of a request are sized before it is sent (token times for
 * its expected output length plus slack), so reading the stream does not allocate per token
 * unless a server sends more tokens than asked for.
 */
#ifndef PD_TOOLS_BENCH_H
#define PD_TOOLS_BENCH_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    PDB_EP_COMPLETIONS = 0, /* POST /v1/completions, SSE */
    PDB_EP_CHAT = 1,        /* POST /v1/chat/completions, SSE */
    PDB_EP_GENERATE = 2,    /* POST /generate (USE_OPENAI=0), NDJSON stream */
} pdb_endpoint;

/* Where requests go: parsed from --base-url and --endpoint. */
typedef struct {
    char host[256];
    char port[16];
    char path[512];   /* prefix + the endpoint's path */
    char prefix[512]; /* path prefix of --base-url (no trailing '/'), for per-request endpoints */
    pdb_endpoint endpoint;
    const char *model;   /* --model NAME, sent as "model" (NULL: omitted) */
    const char *api_key; /* sent as "Authorization: Bearer KEY" (NULL: none) */
    int timeout_s;       /* per-request socket inactivity limit */
    json_t *extra_body;  /* --extra-body: members added to every request body (NULL: none) */
} pdb_target;

/* Parses "http://host:port" (+ optional path prefix) and an endpoint path into t.
 * Fails with PD_EINVAL naming the bad option. */
int pdb_target_init(pdb_target *t, const char *base_url, const char *endpoint);

/* The shape of one request in a mixed workload (--workload mixed); a zeroed shape (set false)
 * means the target's endpoint, streaming, n = 1, no logprobs, read to the end. */
typedef struct {
    bool set;
    pdb_endpoint ep;     /* completions or chat */
    bool stream;         /* false: one JSON body */
    int n;               /* choices (n > 1: every choice streams its own chunks) */
    int logprobs;        /* 0: none; k: completions "logprobs":k, chat top_logprobs k */
    int64_t abort_after; /* > 0 (streams only): the client closes the connection after this
                          * many token chunks, a deliberate client abort */
} pdb_shape;

/* One prompt of the dataset. Exactly one of text / ids is set. */
typedef struct {
    char *text;   /* UTF-8 prompt (chat, /generate, JSONL prompts); owned */
    int32_t *ids; /* (n_ids) token ids (random prompts for /v1/completions); owned */
    size_t n_ids;
    int64_t input_len;  /* intended prompt length in tokens (ids or words); -1 unknown */
    int64_t output_len; /* max_tokens to request (ignore_eos makes it exact) */
    pdb_shape shape;
} pdb_prompt;

typedef struct {
    pdb_prompt *items; /* (n) */
    size_t n;
} pdb_dataset;

/* Random prompts: prefix_len tokens shared by every prompt (vLLM's --random-prefix-len: a
 * system prompt, say; with n_prefixes > 1, prompt i starts with prefix i mod n_prefixes), then
 * input lengths uniform in [in*(1-r), in*(1+r)]; output lengths likewise. For /v1/completions
 * prompts are token ids uniform in [3, vocab) (ids below 3 are the synthetic models' special
 * tokens); otherwise words from a fixed list, one word per token asked for. A pure function of
 * seed. */
int pdb_dataset_random(pdb_dataset *d, size_t n, int64_t prefix_len, int64_t n_prefixes,
                       int64_t input_len, int64_t output_len, double range_ratio, int64_t vocab,
                       bool ids, uint64_t seed);
/* JSONL: one object per line with "prompt" (string) and optional "output_len" (integer,
 * default default_out). Takes the first n lines (all when n == 0); errors name file:line. */
int pdb_dataset_jsonl(pdb_dataset *d, const char *file, size_t n, int64_t default_out);
/* Mixed workload: gives every prompt a shape drawn from seed (rng stream 4): chat or
 * completions 1:1, streaming 3 in 4, n = 2 for 1 in 10, logprobs (2) for 3 in 20, and for a
 * fraction abort_ratio of the streaming requests a client abort after a uniform number of token
 * chunks in [1, max(1, n * output_len / 2)]. Text prompts serve both endpoints. */
int pdb_dataset_mix(pdb_dataset *d, double abort_ratio, uint64_t seed);
void pdb_dataset_free(pdb_dataset *d);

/* One raw stream event: when it arrived and where its payload lies in pdb_result.ev_text. */
typedef struct {
    int64_t ns;
    size_t off;
} pdb_event;

/* What happened to one request. Times are pd_now_ns() values. */
typedef struct {
    bool ok;
    bool aborted;     /* ok and closed by the client on purpose (pdb_shape.abort_after) */
    bool streamed;    /* false: a non-streaming answer, which has no token times (n_tok == 0) */
    char error[256];  /* first error, when !ok */
    int64_t t_send;   /* before connect() */
    int64_t t_end;    /* after the last byte ([DONE] or end of body) */
    int64_t *tok_ns;  /* (n_tok) arrival time of each token chunk */
    uint8_t *tok_fin; /* (n_tok) while streaming: 1 for a closing chunk (client.c) */
    size_t n_tok, cap_tok;
    size_t n_choices;      /* non-streaming answers: choices in the body */
    int64_t prompt_tokens; /* from usage; -1 when the endpoint reports none */
    int64_t output_tokens; /* from usage; token chunk count when the endpoint reports none */
    /* --dump-timestamps only: every event's arrival time and raw payload */
    pdb_event *ev; /* (n_ev) */
    size_t n_ev, cap_ev;
    char *ev_text; /* payloads, each NUL-terminated */
    size_t ev_len, ev_cap;
} pdb_result;

/* Sizes r's buffers for about expect_tokens tokens; record_events keeps raw events. */
int pdb_result_init(pdb_result *r, int64_t expect_tokens, bool record_events);
void pdb_result_free(pdb_result *r);

/* Sends one request for p (streaming unless p->shape says otherwise) and reads the whole
 * answer into r. Never fails as a function: a transport, HTTP or in-band error is recorded as
 * r->ok = false with r->error. On the OpenAI endpoints the answer must hold exactly
 * n * output_len completion tokens by its usage (ignore_eos), no more token chunks than that
 * (fewer where the server sent several tokens in one chunk), and logprobs where they were asked
 * for. */
void pdb_request_run(const pdb_target *t, const pdb_prompt *p, uint64_t seed, pdb_result *r);

/* Summary statistics over n values (copied and sorted internally; n may be 0 -> zeros).
 * Percentiles interpolate linearly between order statistics, as numpy.percentile does. */
typedef struct {
    double mean, median, std, p90, p99, min, max;
} pdb_stats;
int pdb_stats_compute(const double *v, size_t n, pdb_stats *out);
double pdb_percentile_sorted(const double *sorted, size_t n, double pct);

#endif
