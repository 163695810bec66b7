/* pd-scheduler: the api-server. Parses the launch contract (flags + environment), loads the
 * tokenizer, chat template and instance registry, serves the OpenAI-compatible HTTP API of
 * docs/api.md on a libuv loop, and drives every request through one decode instance
 * (Reserve, Decode stream) and one prefill instance (Prefill).
 *
 * Design: one libuv loop thread owns every socket and every request's client-facing state. The
 * gRPC client thread runs the Reserve -> Prefill -> Decode chain; its results are appended to the
 * request under the request's mutex and the request is put on a ready list that the loop drains
 * from one uv_async callback. The registry's heartbeat thread keeps the routing set current.
 * Executables are thin: scheduler/main.c only calls the functions below. The prefix is
 * pd_apiserver_ because pd_sched_ is the engine's batch scheduler (engine/sched.h), which a
 * program may link together with this.
 */
#ifndef PD_SCHEDULER_APISERVER_H
#define PD_SCHEDULER_APISERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define PD_APISERVER_MAX_NAMES 16

/* Every flag and environment value that shapes the scheduler (docs/api.md §17). */
typedef struct {
    const char *model;     /* --model DIR (required) */
    const char *tokenizer; /* --tokenizer DIR: tokenizer and chat template; NULL: model's */
    const char
        *served_names[PD_APISERVER_MAX_NAMES]; /* --served-model-name N [N...]; default model */
    int n_served_names;
    const char *host;                /* --host, default "0.0.0.0" */
    int port;                        /* --port, default 8000; 0 = ephemeral */
    const char *api_key;             /* --api-key, else VLLM_API_KEY, else NULL */
    int64_t max_model_len;           /* --max-model-len; 0 = config.json max_position_embeddings */
    int64_t max_concurrent_requests; /* --max-concurrent-requests, default 4096, 0 = no limit */
    int64_t max_request_body_bytes;  /* --max-request-body-bytes, default 16 MiB */
    /* --max-body-bytes-in-flight: request-body bytes of requests still arriving, over all
     * connections, before new ones get 503; 0 (the default) = 4 x max_request_body_bytes */
    int64_t max_body_bytes_in_flight;
    double queue_timeout_s;  /* --queue-timeout: longest wait for decode KV capacity, default 600 */
    double keep_alive_s;     /* --timeout-keep-alive: idle keep-alive connection, default 5 */
    double header_timeout_s; /* --header-timeout: first byte to last header, default 10 */
    double body_timeout_s;   /* --body-timeout: end of headers to end of body, default 60 */
    const char *chat_template;                /* --chat-template FILE|STRING, or NULL */
    bool trust_request_chat_template;         /* --trust-request-chat-template */
    bool enable_prompt_tokens_details;        /* --enable-prompt-tokens-details */
    const char *default_chat_template_kwargs; /* --default-chat-template-kwargs JSON, or NULL */
    bool generation_config_vllm;              /* --generation-config vllm (default auto) */
    const char *response_role;                /* --response-role, default "assistant" */
    int max_logprobs;                         /* --max-logprobs, default 20 */
    bool enable_auto_tool_choice;             /* --enable-auto-tool-choice */
    const char *tool_call_parser;             /* --tool-call-parser NAME, or NULL */
    const char *log_level;                    /* --log-level (else PD_LOG_LEVEL), or NULL */
    bool use_openai;                          /* USE_OPENAI, default true */
    const char *global_ranktable;             /* GLOBAL_RANK_TABLE_FILE_PATH (required) */
    const char *local_ranktable; /* RANK_TABLE_FILE_PATH (optional: must be the _host table) */
    const char *node_ports;      /* NODE_PORTS (required): one port per P then per D */
    int heartbeat_ms;   /* --heartbeat-ms: heartbeat period and deadline of each Stats call, 1000 */
    int rpc_timeout_ms; /* deadline of Info/Stats/Reserve/Abort: 5000 */
    int64_t max_local_prefill_length; /* --max-local-prefill-length, 0 = never */
    double prefill_timeout_s; /* deadline of Prefill and the TTL of its decode reservation: 60
                                 (Decode and Relay streams have none) */
    /* --shutdown-timeout: after SIGTERM/SIGINT, how long in-flight requests may finish before
     * they end with 503 (seconds, fractions allowed); default 30 */
    double shutdown_timeout_s;
} pd_apiserver_params;

/* Built-in defaults; environment and flags are applied on top by pd_apiserver_parse_args. */
pd_apiserver_params pd_apiserver_default_params(void);
/* The bound of request-body bytes in flight that p gives (--max-body-bytes-in-flight, else 4 x
 * --max-request-body-bytes). */
size_t pd_apiserver_body_bytes_in_flight(const pd_apiserver_params *p);

/* Applies argv[1..argc-1] and then, for what it did not set, the environment
 * (GLOBAL_RANK_TABLE_FILE_PATH, RANK_TABLE_FILE_PATH, NODE_PORTS, USE_OPENAI, VLLM_API_KEY) to
 * *p. Strings borrow argv/environ.
 * PD_EINVAL naming the flag or variable for an unknown flag, a missing value or a bad number.
 * *help is set when --help was given (p is then incomplete). */
int pd_apiserver_parse_args(int argc, char **argv, pd_apiserver_params *p, bool *help);
/* Writes the --help text. */
void pd_apiserver_usage(FILE *out);

typedef struct pd_apiserver pd_apiserver;

/* Loads everything the scheduler needs (tokenizer, template, ranktables, registry), binds the
 * HTTP port and starts the heartbeat. Errors name the file, field, flag or address. */
int pd_apiserver_create(const pd_apiserver_params *p, pd_apiserver **out);
/* Bound HTTP port (useful with port 0). */
int pd_apiserver_port(const pd_apiserver *s);
/* Runs the loop until pd_apiserver_shutdown (or SIGINT/SIGTERM when install_signals was true at
 * run). Returns PD_OK after a clean shutdown. */
int pd_apiserver_run(pd_apiserver *s, bool install_signals);
/* Thread-safe: asks the loop to stop as SIGTERM does (a drain of up to shutdown_timeout_s; see
 * docs/scheduler.md). */
void pd_apiserver_shutdown(pd_apiserver *s);
void pd_apiserver_free(pd_apiserver *s);

#endif
