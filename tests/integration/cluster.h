/* Integration-test harness: builds real pdserve clusters on loopback from the built executables
 * (pd-mkmodel, pd-ranktable, pd-prefill, pd-decode), drives them with the gRPC client, and stops
 * everything it started. Every wait is bounded. Executables are found under PD_BUILD_ROOT. */
#ifndef PD_TEST_CLUSTER_H
#define PD_TEST_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "rpc/pd.pb-c.h"
#include "rpc/rpc.h"

typedef struct {
    pid_t pid;
    char name[64];
    char log[512];
} cl_proc;

/* Path of a built executable, e.g. cl_bin("tools/mkmodel/pd-mkmodel"), under $PD_BUILD_ROOT or
 * else the build directory of the running program. Thread-local buffer. */
const char *cl_bin(const char *rel);
/* Runs argv to completion within timeout_s; stdout (and stderr) go to out_file when not NULL.
 * Returns the exit status, or -1 (timeout, spawn failure: killed and reaped). */
int cl_run(char *const argv[], const char *out_file, int timeout_s);
/* Starts argv with extra environment entries ("K=V", NULL-terminated), output to log. */
int cl_spawn(cl_proc *p, const char *name, char *const argv[], char *const env[], const char *log);
/* SIGTERM, wait up to timeout_ms, then SIGKILL. Returns the exit status (-1 when killed). */
int cl_stop(cl_proc *p, int timeout_ms);
/* Waits up to timeout_ms for the process to exit by itself (then SIGKILL). Exit status, or -1. */
int cl_wait(cl_proc *p, int timeout_ms);
/* Sends sig to the process (SIGKILL, SIGSTOP, SIGCONT). */
void cl_signal(cl_proc *p, int sig);
/* Prints the last lines of the process's log (for failures). */
void cl_dump_log(const cl_proc *p, int lines);
/* A TCP port that was free a moment ago on 127.0.0.1. */
int cl_free_port(void);

/* Makes the `tiny` synthetic model with pd-mkmodel under the test's temporary directory; its
 * path into out. 0, or -1 with the reason printed. */
int cl_make_tiny(char *out, size_t n);

/* ---- a cluster ---------------------------------------------------------------------------- */

typedef struct {
    char dir[256];    /* temporary directory of the cluster */
    char model[300];  /* model directory */
    char global[400]; /* global ranktable */
    int n_prefill, n_decode;
    cl_proc procs[16]; /* prefill instances then decode instances */
    int ports[16];
    pd_rpc_client *client;
    pd_rpc_channel *ch[16];
    char **argv[16]; /* each node's command line and extra environment, for cl_restart */
    char **env[16];
} cl_cluster;

/* Makes the tiny model (once per process, cached in the tmp dir) and ranktables with
 * pd-ranktable --mode gen: prefill_list / decode_list as on its command line, e.g.
 * "0" and "1", or "0,1" "2" for P TP=2 -> D TP=1. extra_args: more node flags (NULL ok).
 * With PD_TEST_NCCL_HOST_PER_NODE=1 in the environment, NCCL takes every node for a host of
 * its own (NCCL_HOSTID per process, NCCL_SOCKET_IFNAME=lo, P2P, SHM and IB off), so two nodes
 * on one GPU can make an NCCL link: its traffic goes over NCCL's socket transport on
 * loopback. NCCL otherwise refuses two ranks on one GPU of one host. */
int cl_start(cl_cluster *c, const char *model_dir, const char *prefill_list,
             const char *decode_list, char *const extra_args[]);
/* Stops every process (SIGTERM; the nodes must exit 0) and frees the client.
 * Returns the number of processes that did not exit 0. */
int cl_stop_all(cl_cluster *c);

/* Node k: prefill instances first (0..n_prefill-1), then decode instances. */
pd_rpc_channel *cl_node(cl_cluster *c, int k);

/* Unary call with message packing/unpacking: returns the unpacked reply (free with
 * protobuf_c_message_free_unpacked) or NULL with the gRPC status in *st and the message set. */
ProtobufCMessage *cl_call(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *reply_desc, int timeout_ms, int *st);

/* One whole split request: Reserve on decode node dk, Prefill on prefill node pk, Decode on dk.
 * Returns the generated token ids (first token included) in out (cap entries), *n_out, and the
 * finish reason. sampling NULL = greedy with max_tokens. */
typedef struct {
    int32_t tokens[4096];
    size_t n;
    char finish[16];
    char text[8192];
    int status;     /* gRPC status of the failing step, 0 on success */
    double t_start; /* pd_now_s() just before Reserve (after the Info call) */
    double t_first; /* pd_now_s() when the first token (the Prefill reply) arrived */
    double prefill_seconds, kv_seconds; /* the Prefill reply's: request -> reply less the KV time,
                                           and first KV byte sent -> decode acknowledgement */
    int64_t kv_bytes;      /* the Prefill reply's: payload moved to the decode instance */
    char kv_transport[16]; /* the Prefill reply's: the transport that carried it */
    int64_t decode_cached; /* the Reserve reply's cached_tokens (the prompt ids go in Reserve,
                              as pd-scheduler sends them) */
    char error[512];
    char *prompt_logprobs; /* cl_reference_ex with --prompt-logprobs K in extra: pd-generate's
                              "prompt_logprobs" as compact JSON (malloc'd: the caller frees
                              it), else NULL */
} cl_result;

/* Sampling for cl_generate: n 1, the given temperature and seed, top_p 1, no penalties, no
 * logprobs, max_tokens, special tokens skipped. */
Pd__SamplingParams cl_sampling(double temperature, int64_t seed, int max_tokens);

int cl_generate(cl_cluster *c, int pk, int dk, const char *request_id, const int32_t *prompt,
                size_t n_prompt, const Pd__SamplingParams *sampling, cl_result *out);

/* cl_generate with hook(arg, decode Info, Reserve reply) called between Reserve and Prefill
 * (fault injection on the reservation); a negative return fails the request with the message. */
typedef int (*cl_reserved_fn)(void *arg, const Pd__InfoReply *info, const Pd__ReserveReply *rr);
int cl_generate_hook(cl_cluster *c, int pk, int dk, const char *request_id, const int32_t *prompt,
                     size_t n_prompt, const Pd__SamplingParams *sampling, cl_reserved_fn hook,
                     void *hook_arg, cl_result *out);

/* The first two steps of cl_generate_hook: Reserve on dk, Prefill on pk (out holds the first
 * token). PD_OK with the seed and first token for the Decode request; 1 when the first token
 * was the final one; negative with out->status and out->error on failure. */
int cl_prefill(cl_cluster *c, int pk, int dk, const char *request_id, const int32_t *prompt,
               size_t n_prompt, const Pd__SamplingParams *sampling, cl_reserved_fn hook,
               void *hook_arg, cl_result *out, uint64_t *seed, int32_t *first);

/* Colocated reference: pd-generate --json on the same model for prompts (one per line of
 * comma-separated ids), same sampling. Returns the token ids per prompt in out[i]. */
int cl_reference(const char *model, const int32_t *const *prompts, const size_t *n_prompt, size_t n,
                 int max_tokens, double temperature, int64_t seed, const char *dir, cl_result *out);
/* The same with more pd-generate flags (at most 8, NULL-terminated; e.g. --cuda-device 0). */
int cl_reference_ex(const char *model, const int32_t *const *prompts, const size_t *n_prompt,
                    size_t n, int max_tokens, double temperature, int64_t seed, const char *dir,
                    char *const extra[], cl_result *out);

/* ---- faults, HTTP clients, process figures (reliability tests) -------------------------- */

/* Starts node k again with the command line and environment of its first start (so on the same
 * gRPC port) after it exited or was killed (cl_signal SIGKILL), and waits up to timeout_ms until
 * it answers Info. */
int cl_restart(cl_cluster *c, int k, int timeout_ms);
/* Stats of node k (free with pd__stats_reply__free_unpacked), or NULL. */
Pd__StatsReply *cl_stats(cl_cluster *c, int k);

/* Starts pd-scheduler in front of c on a free port (*port) with USE_OPENAI=1, served model name
 * "tiny", --max-model-len 1024 and extra flags (NULL ok), and waits up to 30 s for /health 200.
 * Log in c->dir/<name>.log. */
int cl_sched_start(cl_cluster *c, cl_proc *p, const char *name, char *const extra[], int *port);

/* One client connection: the request is written at open; cl_conn_poll reads what arrives. */
typedef struct {
    int fd;    /* -1 once closed */
    char *buf; /* (len,) every byte received, NUL-terminated; malloc'd */
    size_t len, cap;
    int status;         /* HTTP status once the status line arrived, else 0 */
    bool eof;           /* the server closed the connection */
    int64_t t_open_ns;  /* pd_now_ns() at open */
    int64_t t_first_ns; /* first byte received, 0 before */
    int64_t t_done_ns;  /* "data: [DONE]" seen or EOF, 0 before */
} cl_conn;

/* Connects to 127.0.0.1:port and writes len bytes of req (all of them, or an error). */
int cl_conn_open_raw(cl_conn *c, int port, const char *req, size_t len);
/* A request with Content-Length (Content-Type: application/json when body is given) and
 * extra_headers (complete "Name: value\r\n" lines, NULL ok); keep_alive false sends
 * "Connection: close". */
int cl_conn_open(cl_conn *c, int port, const char *method, const char *path,
                 const char *extra_headers, const char *body, bool keep_alive);
/* Waits up to timeout_ms for data on the open connections of cs[0..n) and reads what is there
 * (max_read bytes per connection and call; 0 = no limit). Returns the number still open. */
int cl_conn_poll(cl_conn *cs, size_t n, int timeout_ms, size_t max_read);
/* Polls until every connection is done (EOF or [DONE]) or timeout_ms passed; true when done. */
bool cl_conn_wait_all(cl_conn *cs, size_t n, int timeout_ms);
void cl_conn_close(cl_conn *c);
/* The body after the headers, de-chunked when chunked, into a malloc'd NUL-terminated string
 * (NULL before the headers are complete). */
char *cl_conn_body(const cl_conn *c);
/* Header value (name case-insensitive) into buf; NULL when absent. */
const char *cl_conn_header(const cl_conn *c, const char *name, char *buf, size_t n);

/* A whole request on a fresh connection (Connection: close) within timeout_ms: the status, or -1
 * (no response). *body (malloc'd, de-chunked) and retry_after (the Retry-After value, "" when
 * absent; 16 bytes) may be NULL. */
int cl_http(int port, const char *method, const char *path, const char *body, int timeout_ms,
            char **out_body, char *retry_after);
/* Value of the first exposition line that starts with prefix (e.g. "pd:instance_up{...} "), or
 * def when there is none. */
double cl_metric(const char *metrics, const char *prefix, double def);
/* Waits up to timeout_ms (CL_MS-scaled) until the scheduler on port reports node k of c in its
 * routing set (pd:instance_up, want 1) or out (want 0); k -1: every node of c. */
bool cl_wait_instance(const cl_cluster *c, int port, int k, double want, int timeout_ms);

/* PD_TEST_TIME_SCALE (>= 1; valgrind runs set it): tests multiply their time bounds by it. */
double cl_time_scale(void);
/* Milliseconds and seconds of a test's time bounds, stretched by cl_time_scale (valgrind). */
#define CL_MS(ms) ((int)((ms)*cl_time_scale()))
#define CL_SEC(s) ((s)*cl_time_scale())

/* SSE events of a body: each "data: X\n\n" -> X (pointers into body, which is modified).
 * -1 when the framing is not exactly that. */
int cl_sse_events(char *body, char **ev, int cap);

/* Resident set size of pid in KiB (VmRSS), or -1. */
long cl_rss_kb(pid_t pid);
/* A field of /proc/<pid>/status in KiB ("VmHWM", "VmRSS"), -1 when not read. */
long cl_status_kb(pid_t pid, const char *field);
/* Open file descriptors of pid (entries of /proc/<pid>/fd), or -1. */
int cl_fd_count(pid_t pid);

#endif
