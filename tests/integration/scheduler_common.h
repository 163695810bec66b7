/* Integration tests of pd-scheduler: a real 1P1D cluster on loopback (cluster.h) plus the
 * scheduler process, driven over HTTP with plain sockets. Checks the API contract's shapes
 * (§10, §11), validation messages (§3, §8), routing errors (404/405/401) and the relay
 * (streamed text equals non-streamed text under greedy). Every wait is bounded.
 *
 * One executable (test_scheduler) of several files: this header declares what they share,
 * scheduler_common.c defines it (the HTTP client and the fixture), and each test_scheduler_*.c
 * holds one group of tests. The files are linked in the order the tests run;
 * test_scheduler_capacity.c, last, ends with sched_zz_shutdown. */
#ifndef PD_TESTS_INTEGRATION_SCHEDULER_COMMON_H
#define PD_TESTS_INTEGRATION_SCHEDULER_COMMON_H

#include "harness.h"

#include <jansson.h>
#include <stdbool.h>

#include "cluster.h"
#include "util/clock.h"

/* ---- a tiny HTTP client ------------------------------------------------------------------- */

typedef struct {
    int status;
    char headers[8192]; /* raw header block, lower-cased names kept as sent */
    char *body;         /* de-chunked, NUL-terminated (malloc'd) */
    size_t body_len;
} http_resp;

void resp_free(http_resp *r);
/* A socket connected to 127.0.0.1:port, or -1. */
int connect_port(int port);
/* One request (Connection: close; Content-Type: application/json with a body unless
 * extra_headers name one), read until EOF within 60 s; 0 when a response arrived. */
int http_do(int port, const char *method, const char *path, const char *extra_headers,
            const char *body, http_resp *out);
/* Sends raw bytes (then shuts down the sending side when half_close) and reads until EOF
 * within timeout_ms; 0 when an HTTP/1.1 response arrived. */
int http_raw(int port, const char *req, size_t len, bool half_close, int timeout_ms,
             http_resp *out);
/* Header value (case-insensitive name) into buf; NULL when absent. */
const char *header(const http_resp *r, const char *name, char *buf, size_t n);

/* ---- the fixture: one 1P1D cluster and three schedulers ----------------------------------- */

extern cl_cluster g_c;
extern cl_proc g_sched, g_sched_key, g_sched_legacy;
extern int g_port, g_port_key, g_port_legacy;
extern bool g_ready;
extern char g_model[512];

/* pd-scheduler for the tiny model on cluster cl (served as "tiny" and "tiny-alias") with extra
 * flags and USE_OPENAI=use_openai, on a free port (*port); 0 once its /health answers 200. */
int start_scheduler_on(cl_cluster *cl, cl_proc *p, int *port, const char *name, char *const extra[],
                       const char *use_openai);
/* The same on the fixture's cluster. */
int start_scheduler(cl_proc *p, int *port, const char *name, char *const extra[],
                    const char *use_openai);
/* Starts the cluster and its schedulers once; false (for good) when that failed. */
bool fixture(void);

#define FIXTURE()                                                                                  \
    do {                                                                                           \
        if (!fixture()) {                                                                          \
            ASSERT_MSG(0, "the cluster did not start");                                            \
        }                                                                                          \
    } while (0)

/* A twin of the fixture's api-server on its cluster whose decode instance prefills every
 * prompt itself (--max-local-prefill-length 4096): colocated serving, to compare split with.
 * 0 once it answers /health. */
int start_colocated_scheduler(cl_proc *p, int *port, const char *name);

/* A cluster of its own (prefill and decode server lists as cl_start takes them) with a
 * scheduler on it (extra flags args); false, with both stopped, when either did not start. */
bool side_cluster(cl_cluster *c, const char *prefill, const char *decode, cl_proc *sp, int *port,
                  const char *name, char *const args[]);

/* ---- helpers for the API ------------------------------------------------------------------- */

/* Keys of a JSON object in order, joined by ','. */
void keys_of(const json_t *o, char *buf, size_t n);
/* s is prefix followed by 32 lower-case hex digits. */
bool is_id(const char *s, const char *prefix);
/* Opens a long streaming completion on port and returns the socket once the first bytes came. */
int open_long_stream(int port, const char *auth);
/* POST body to path on port: the parsed response (NULL when none came or it is not JSON) and
 * its status; a non-200 is printed. */
json_t *post_json(int port, const char *path, const char *body, int *status);
/* 0 when instance (JSON text) is valid under schema (JSON text, Draft 7), by the independent
 * python3-jsonschema; else non-zero with its message in why. */
int validate(const char *schema, const char *instance, char *why, size_t n);

#endif
