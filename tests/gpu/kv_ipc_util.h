/* Shared by the CUDA IPC KV-transfer test, its benchmark and kv_ipc_peer (the decode side, a
 * process of its own: CUDA IPC maps only another process's memory): the KV pattern both sides
 * compute, pool fill/check through the backend, and spawning the peer.
 *
 * Pattern: element d of head h (global), token t, layer l, K (kv 0) or V (kv 1) holds
 * ((l * 7 + kv * 3 + h * 11 + t * 13 + d) % 251) / 16 - 7, exact in bf16, so a copy that moves
 * anything to a wrong layer, head, token or block is caught. */
#ifndef PD_TESTS_GPU_KV_IPC_UTIL_H
#define PD_TESTS_GPU_KV_IPC_UTIL_H

#include <stdio.h>
#include <sys/types.h>

#include "backend/backend.h"
#include "transfer/kv_tcp.h"

static inline float kv_ipc_val(int layer, int kv, size_t head, size_t tok, size_t d)
{
    return (float)(((size_t)layer * 7 + (size_t)kv * 3 + head * 11 + tok * 13 + d) % 251) / 16.0f -
           7.0f;
}

/* Writes the pattern into blocks ids[0..n) of every layer of kv (heads [head0, head0 +
 * p->n_kv_heads) globally; token t of the prompt in block ids[t / block_size]). */
int kv_ipc_fill(pd_backend *b, pd_kv *kv, const pd_kv_params *p, size_t head0, const int32_t *ids,
                size_t n);
/* Checks the first n_tokens tokens of blocks ids[0..n), pool heads [lh0, lh0 + nh) holding
 * global heads [gh0, ...). PD_EINTERNAL naming the first wrong element. */
int kv_ipc_check(pd_backend *b, const pd_kv *kv, const pd_kv_params *p, size_t lh0, size_t gh0,
                 size_t nh, const int32_t *ids, size_t n, size_t n_tokens);

/* The integer after flag `name` in argv, or def. */
long kv_ipc_opt(int argc, char **argv, const char *name, long def);

/* Starts kv_ipc_peer (next to this executable) with args and reads its "port N" line.
 * *out is the peer's stdout (pclose it: its exit status says whether its check passed). */
int kv_ipc_spawn_peer(const char *args, FILE **out, int *port);

/* Sends request "r<rep>" (n_tokens of blocks ids, global heads [h0, h0 + nh) of a pool holding
 * heads from 0) by CUDA IPC with share to the peer on 127.0.0.1:port; 20 s timeout. */
int kv_ipc_send(pd_kv_tcp_sender *tx, int port, int rep, pd_backend *b, const pd_kv *kv,
                const pd_kv_params *p, const pd_kv_share *share, const int32_t *ids, size_t n,
                size_t n_tokens, size_t h0, size_t nh, pd_kv_send_stats *st);

/* Reads the peer's last lines (its "imports: ..." line into imports, then its verdict) and waits
 * for it; returns its exit status (0: every import completed and the check passed). */
int kv_ipc_peer_finish(FILE *peer, char *imports, size_t ni, char *verdict, size_t nv);

#endif
