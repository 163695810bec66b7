/* Instance registry of pd-scheduler: who the prefill and decode instances are (global ranktable
 * + NODE_PORTS), whether each is in the routing set, and how loaded each is.
 *
 * Design: one gRPC channel per instance. A heartbeat thread calls Info on every instance that
 * is not verified (the identity must match its ranktable entry: role, instance_index, server_id,
 * server_ip, tp size and device ids, and its max_model_len must not be below the scheduler's,
 * else the instance stays out with a logged reason) and Stats on every verified one, every
 * heartbeat period. A failed call takes the instance out of the routing set (and out of
 * verification, so a restarted process is checked again); it rejoins when it answers. Routing
 * is a policy of balancer.h, one per role, fed with each instance's outstanding tokens
 * (prefill: prompt tokens this scheduler has in flight on it; decode: running + reserved tokens
 * from Stats plus this scheduler's in-flight tokens) and what its prefix cache likely holds of
 * the prompt: least outstanding tokens less cached ones, round-robin among ties. All state sits
 * under one mutex; every function is thread-safe.
 */
#ifndef PD_SCHEDULER_REGISTRY_H
#define PD_SCHEDULER_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "ranktable/ranktable.h"
#include "rpc/pd.pb-c.h"
#include "rpc/rpc.h"
#include "util/arena.h"

typedef struct pd_reg pd_reg;

/* Called from the heartbeat thread when instance k enters (up=true) or leaves the routing set. */
typedef void (*pd_reg_change_fn)(void *arg, int k, bool up);

/* Loads global_file, checks that NODE_PORTS has one port per prefill then decode instance and
 * that no two instances share host:port (PD_EINVAL naming both), and opens one channel per
 * instance on client (which must outlive the registry). Nothing is called yet. */
int pd_reg_create(const char *global_file, const char *node_ports, pd_rpc_client *client,
                  pd_reg **out);
/* The scheduler's max_model_len (L): an instance whose Info reports a smaller one fails the
 * identity check (it would refuse prompts the scheduler admits), its reason naming both values.
 * 0 (the default) checks nothing. Call before pd_reg_start. */
void pd_reg_set_max_model_len(pd_reg *r, int64_t max_model_len);
/* Starts the heartbeat thread: one round at once, then every period_ms; each call has
 * timeout_ms. on_change may be NULL. */
int pd_reg_start(pd_reg *r, int period_ms, int timeout_ms, pd_reg_change_fn on_change, void *arg);
/* pd_reg_close (if not done yet), then frees. */
void pd_reg_free(pd_reg *r);

/* The loaded global ranktable (for the host-table check). */
const rt_global *pd_reg_global(const pd_reg *r);
/* Instances: prefill first (0..n_prefill-1), then decode, as in NODE_PORTS. */
int pd_reg_count(const pd_reg *r);
rt_role pd_reg_role(const pd_reg *r, int k);
/* "<server_ip>:<port>". */
const char *pd_reg_name(const pd_reg *r, int k);
/* Starts a call on instance k's channel (pd_rpc_unary_async / pd_rpc_stream_async contract:
 * done runs exactly once). After pd_reg_close, done runs at once with PD_RPC_CANCELLED. Safe
 * from any thread, including from inside another call's callback. */
int pd_reg_unary(pd_reg *r, int k, const char *method, const void *req, size_t len, int timeout_ms,
                 pd_rpc_done_fn done, void *arg, uint64_t *id);
int pd_reg_stream(pd_reg *r, int k, const char *method, const void *req, size_t len, int timeout_ms,
                  pd_rpc_msg_fn on_msg, pd_rpc_done_fn done, void *arg, uint64_t *id);
/* Stops the heartbeat and destroys the channels (calls in flight keep running until the
 * client is destroyed); later calls are refused. Call before pd_rpc_client_free. */
void pd_reg_close(pd_reg *r);
bool pd_reg_is_up(pd_reg *r, int k);
/* A call to instance k failed because it cannot be reached (UNAVAILABLE): takes it out of the
 * routing set now, with why as the logged reason, instead of at the next heartbeat; it rejoins
 * once it answers the heartbeat again (its identity is checked again first). */
void pd_reg_report_failure(pd_reg *r, int k, const char *why);
/* Instances of a role in the routing set. */
int pd_reg_up_count(pd_reg *r, rt_role role);
/* Blocks until one heartbeat round has completed (or timeout_ms). true when it has. */
bool pd_reg_wait_round(pd_reg *r, int timeout_ms);

/* Picks the least loaded instance of role in the routing set (round-robin among ties), not
 * exclude (-1 = none), and adds tokens to its in-flight count. -1 when none is up. */
int pd_reg_pick(pd_reg *r, rt_role role, int64_t tokens, int exclude);
/* Picks the instance of role for prompt ids (prefix-aware routing): in the routing set, not
 * exclude, the one whose load (as pd_reg_pick's: prefill, the prompt tokens in flight; decode,
 * the tokens its sequences and reservations hold) and in-flight tokens, less the prompt's
 * leading full blocks (the instances' block size) that this scheduler sent it before, which its
 * prefix cache likely still holds, are the least; round-robin among ties. Adds tokens less
 * those cached tokens to its in-flight count (the work, or the KV, the request brings there;
 * tokens >= n_ids) and records the prompt's blocks as its own. *hit_tokens (may be NULL): the
 * tokens counted as cached there (so tokens - *hit_tokens is what pd_reg_release gives back).
 * -1 when none is up. */
int pd_reg_pick_cached(pd_reg *r, rt_role role, const int32_t *ids, size_t n_ids, int64_t tokens,
                       int exclude, int64_t *hit_tokens);
/* How much work a pick may add to an instance (pd_reg_pick_room). */
typedef struct {
    double horizon_s;       /* what it finishes in horizon_s at its measured rate */
    int64_t unmeasured_max; /* before it has a rate (pd_reg_prefill_done): tokens */
} pd_reg_room;
enum { PD_REG_BUSY = -2 };
/* pd_reg_pick_cached (no exclusion) when the picked instance has room for the prompt: nothing
 * else in flight there, or the work in flight, the prompt's included, within room's limits.
 * PD_REG_BUSY, with nothing charged or recorded, when it has not. */
int pd_reg_pick_room(pd_reg *r, rt_role role, const int32_t *ids, size_t n_ids, int64_t tokens,
                     const pd_reg_room *room, int64_t *hit_tokens);
/* Takes tokens back from instance k's in-flight count. */
void pd_reg_release(pd_reg *r, int k, int64_t tokens);
/* Prefill instance k finished a prompt of tokens (what pd_reg_pick_cached charged it; call
 * before pd_reg_release gives them back): they count into its measured rate, the tokens it
 * finishes a second of the time it has work in flight. */
void pd_reg_prefill_done(pd_reg *r, int k, int64_t tokens);
/* Records the full blocks of ids as held by instance k's prefix cache (as pd_reg_pick_cached
 * does for the prompt it picks k for): for a decode instance, a finished sequence's prompt and
 * the generated tokens it computed, which a later turn's prompt starts with. */
void pd_reg_note_cached(pd_reg *r, int k, const int32_t *ids, size_t n_ids);

/* Decode instance k's ranks as Prefill targets: *out is an array of *n pointers to targets,
 * allocated with their strings in a. PD_ENOTFOUND when k has not been verified. */
int pd_reg_decode_targets(pd_reg *r, int k, pd_arena *a, Pd__DecodeTarget ***out, size_t *n);

/* Copies the KV transport instance k reported in Info ("tcp", "nccl", "cuda_ipc"; "" before
 * its first Info) into buf (n bytes). */
void pd_reg_transport(pd_reg *r, int k, char *buf, size_t n);

/* Smallest max_num_seqs among verified decode instances (0 when none is known). */
int pd_reg_max_num_seqs(pd_reg *r);
/* Cluster aggregates from the last Stats: KV used / total over decode instances (0 when no
 * block is known), preemptions summed over decode instances. */
double pd_reg_kv_usage(pd_reg *r);
int64_t pd_reg_preemptions(pd_reg *r);
/* The block size of the first up instance of role that caches prefixes (its Info), 0 when none
 * does. */
int pd_reg_cache_block(pd_reg *r, rt_role role);
/* Prefix cache tokens queried and hit, summed over every instance (from the last Stats). */
void pd_reg_prefix_cache(pd_reg *r, int64_t *queries, int64_t *hits);

/* Speculative decoding's counters of the decode instances, cumulative (their last Stats). */
typedef struct {
    int64_t drafts, draft_tokens, accepted;
    int64_t per_pos[PD_ENGINE_SPEC_MAX_TOKENS];
} pd_reg_spec;
void pd_reg_spec_totals(pd_reg *r, pd_reg_spec *out);
/* The engines' queues from the instances' last Stats (those that answered within three
 * heartbeat periods): *running, sequences in their running batches; *waiting, sequences in
 * their waiting queues plus those a prefill instance holds computed until the decode side has
 * their KV (vLLM's decode side counts a request whose KV is on its way as waiting). */
void pd_reg_queues(pd_reg *r, int64_t *running, int64_t *waiting);
/* Engine steps over every instance by the tokens they ran (StatsReply.step_tokens' bins), and
 * their tokens: cumulative, and monotone across an instance's restart. */
void pd_reg_step_tokens(pd_reg *r, int64_t bins[PD_ENGINE_STEP_BINS], int64_t *sum);

/* Instance k's KV cache configuration: its Info's, and its pool's block count from Stats. */
typedef struct {
    int block_size;
    char kv_dtype[16]; /* "float32", "bfloat16", "float16" */
    bool prefix_caching;
    int64_t num_blocks; /* 0 before its first Stats */
} pd_reg_cache_info;
/* false before instance k's Info was first read. */
bool pd_reg_cache_config(pd_reg *r, int k, pd_reg_cache_info *out);

/* Instance k's pipeline stages as its last Stats gave them: the seconds each stage spent
 * computing (cumulative, this process's); returns their count (0 before its first Stats). */
int pd_reg_stage_seconds(pd_reg *r, int k, double out[PD_ENGINE_MAX_PP]);

#endif
