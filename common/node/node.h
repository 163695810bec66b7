/* A prefill or decode instance: the shared runtime of pd-prefill and pd-decode.
 *
 * Design: the executables are thin; pd_node does the work so tests link it directly.
 * A node reads the global and local ranktables, finds its instance (role and index), checks the
 * tensor-parallel size against the instance's device count, creates the engine (engine.h) and
 * serves the pd.proto control plane over gRPC (rpc.h) on --host/--port:
 *   prefill: Prefill runs the prompt as a PREFILL_ONLY request, then a transfer worker sends
 *            the held KV to every decode rank (kv_route.h) and replies with the first token once
 *            the decode side acknowledged; the KV is leased for at most --kv-lease-seconds and
 *            released on acknowledgement, failure, abort or expiry.
 *   decode:  Reserve allocates blocks and expects their KV on each rank's TCP receiver; a
 *            reservation whose Decode did not start within its TTL is dropped; Decode admits
 *            the imported sequence and streams its tokens.
 * One dispatcher thread drains the engine's events and routes them to the calls; gRPC
 * handlers never block. SIGTERM/SIGINT drain: new work is refused (UNAVAILABLE), running
 * requests get --shutdown-timeout seconds, the rest are aborted, and pd_node_run returns 0.
 */
#ifndef PD_NODE_NODE_H
#define PD_NODE_NODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "engine/spec.h"
#include "ranktable/ranktable.h"

typedef struct pd_node pd_node;

typedef struct {
    rt_role role;                  /* RT_ROLE_PREFILL or RT_ROLE_DECODE: what this binary serves */
    const char *global_ranktable;  /* GLOBAL_RANK_TABLE_FILE_PATH */
    const char *local_ranktable;   /* RANK_TABLE_FILE_PATH */
    const char *served_model_name; /* --served-model-name (default: --model) */
    int tensor_parallel_size;      /* --tensor-parallel-size; 0 = device count / pipeline size */
    int pipeline_parallel_size;    /* --pipeline-parallel-size; 0 = 1 */
    const char *host;              /* --host; NULL = the instance's server_ip */
    int port;                      /* --port (required) */
    int shutdown_timeout_s;        /* --shutdown-timeout (30) */
    int kv_lease_s;                /* --kv-lease-seconds (30) */
    const char *kv_transport;      /* --kv-transport auto|tcp|nccl|cuda_ipc (auto) */
    const char *device;            /* --device cpu|cuda (cpu) */
    const char *dtype;             /* --dtype auto|float32|bfloat16|float16 (auto) */
    bool gpu_memory_utilization_set; /* given: the CPU backend logs that it has no effect */
    pd_spec_flags spec;              /* decode: speculative decoding's flags, resolved into the
                                        engine's spec_* fields after parsing */
    int transfer_workers;            /* prefill: concurrent KV sends (4) */
    unsigned ranktable_flags;        /* RT_ALLOW_SHARED_DEVICES for single-GPU setups */
    /* The engine's own (pd_engine_default_params): --model (model_dir), --tokenizer
     * (tokenizer_dir), --max-model-len,
     * --max-num-seqs, --max-num-batched-tokens, --block-size, --kv-cache-bytes,
     * --[no-]enable-prefix-caching, --seed, --cpu-threads (n_threads),
     * --gpu-memory-utilization. The node sets tp_size, the devices and the event callback. */
    pd_engine_params engine;
} pd_node_params;

pd_node_params pd_node_default_params(void);

/* Parses the vLLM-style command line (and the two ranktable environment variables) into p,
 * starting from the defaults. PD_EINVAL naming the flag; 1 when --help was printed. */
int pd_node_parse_args(int argc, char **argv, rt_role role, pd_node_params *p);
/* Usage text of the node executables. */
void pd_node_usage(const char *prog, rt_role role);

/* Loads everything and starts serving. Errors name the file, flag or field. */
int pd_node_create(const pd_node_params *p, pd_node **out);
/* The bound gRPC port. */
int pd_node_port(const pd_node *n);
/* Blocks until SIGTERM/SIGINT (pd_signals_install must have been called) or pd_node_shutdown,
 * then drains as described above. Returns 0. */
int pd_node_run(pd_node *n);
/* Asks a running pd_node_run to drain and return (any thread). */
void pd_node_shutdown(pd_node *n);
void pd_node_free(pd_node *n);

/* main() of pd-prefill and pd-decode. */
int pd_node_main(int argc, char **argv, rt_role role);

#endif
