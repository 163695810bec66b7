/* Which transport carries each KV send of a prefill instance (--kv-transport): the one place that
 * knows the choice and auto's fallback chain.
 *
 * tcp, cuda_ipc, nccl: every send goes that way (the device ones need the pools in device
 * memory; a rank that cannot send that way fails the route's creation).
 * auto: on device memory, per decode rank, CUDA IPC, else NCCL, else TCP: each transport the
 * instance's ranks can use, in that order, from the first one the destination ("host:port")
 * has not refused. A refusal is remembered for that destination: CUDA IPC refused (another
 * host, a decode rank without CUDA: PD_EUNSUPPORTED), NCCL refused (PD_EUNSUPPORTED: a decode
 * rank without NCCL, or on the prefill rank's own GPU) or its link not made (no request frame
 * went out). A cancelled send is never a refusal. On host memory auto is tcp.
 */
#ifndef PD_TRANSFER_KV_ROUTE_H
#define PD_TRANSFER_KV_ROUTE_H

#include <stdbool.h>

#include "transfer/kv_tcp.h"

typedef struct pd_kv_route pd_kv_route;

/* PD_EINVAL when transport is not auto or a transport's name, or names one that needs device
 * memory while device is false ("--kv-transport nccl needs --device cuda (...)"). */
int pd_kv_route_check(const char *transport, bool device);

typedef struct {
    const char *transport;       /* --kv-transport: "auto", "tcp", "cuda_ipc" or "nccl" */
    bool device;                 /* the pools are in device memory (--device cuda) */
    int n_ranks;                 /* the prefill instance's tensor-parallel size */
    pd_backend *const *backends; /* (n_ranks) each rank's backend */
    const pd_kv *const *kvs;     /* (n_ranks) each rank's pool */
} pd_kv_route_params;

/* Sets up every transport the route may use for every rank (CUDA IPC shares each pool) and the
 * sender the sends go through. Logs the choice. */
int pd_kv_route_create(const pd_kv_route_params *p, pd_kv_route **out);
void pd_kv_route_free(pd_kv_route *rt);

/* The transport a send tries first ("tcp", "cuda_ipc" or "nccl"). */
const char *pd_kv_route_first(const pd_kv_route *rt);

/* Sends r from prefill rank `rank` (r->backend and r->kv are that rank's) by the route's
 * transport for r's destination, falling back under auto as described above; r->share, r->nccl
 * and r->nccl_distinct_gpus are the route's to set. Statuses as pd_kv_tcp_send; stats (may be
 * NULL) are the last try's, stats->transport the transport that carried the KV (or failed).
 * Thread-safe. */
int pd_kv_route_send(pd_kv_route *rt, int rank, const pd_kv_send_req *r, pd_kv_send_stats *stats);

#endif
