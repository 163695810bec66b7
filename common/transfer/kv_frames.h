/* The KV data plane's wire format: every frame and acknowledgement that crosses a KV connection,
 * whatever transport carries the KV (kv_xport.h). Packing and unpacking live in kv_frames.c
 * alone, so the byte layout is written down once; the transports and the connection code only
 * fill and read the structs below.
 *
 * Little-endian throughout:
 *   frame   = header (80 bytes) + payload
 *   header  = "PDKV" u16 version u16 flags char request_id[40] u32 layer u32 head0 u32 n_heads
 *             u32 block0 u32 n_blocks u32 n_tokens u64 payload_bytes
 *             (layer: the model's layer index; a pipeline stage's pool holds layers from its
 *             first, so sender and receiver each subtract their own)
 *   ack     = "PDKA" u16 version u16 pad i32 status char request_id[40] char message[204]
 *             (256 bytes), sent for a sender's frame flagged LAST
 * One connection carries one request at a time; the sender reads the acknowledgement before
 * it reuses the connection, so acknowledgements never cross requests.
 *
 * The flags say whose frame it is, and so what its payload holds:
 *   none         (tcp.c) the KV itself: K then V, each (n_tokens, n_heads, head_dim) in the pool
 *                dtype: the pd_kv_range layout of the blocks cut after the prompt's last token
 *                (the unused slots of the last block do not move)
 *   IPC          (cuda_ipc.c) a description of the prefill pool instead of the KV:
 *                char boot_id[40] u8 handle[64] u64 pool_id u32 n_layers u32 block_size
 *                u64 n_blocks u32 n_kv_heads u32 head_dim u32 dtype u32 src_head0 (pool-local)
 *                u32 src_blocks[n_blocks]
 *   NCCL_INIT    (nccl.c) the link id (PD_KV_LINK_ID_BYTES); DISTINCT_GPUS asks the receiver
 *                to refuse a link from its own GPU
 *   NCCL         (nccl.c) how the KV that follows on the link is cut (pd_kv_nccl_desc):
 *                u32 chunk_layers u32 0 u64 link_bytes
 * Layouts only grow at the end (a new flag, a new kind of payload); KV_VERSION changes when a
 * field changes meaning.
 */
#ifndef PD_TRANSFER_KV_FRAMES_H
#define PD_TRANSFER_KV_FRAMES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "transfer/kv_tcp.h"

#define KV_HDR_BYTES          80
#define KV_ACK_BYTES          256
#define KV_ACK_MSG_BYTES      204
#define KV_VERSION            2
#define KV_FLAG_LAST          1u
#define KV_FLAG_IPC           2u
#define KV_FLAG_NCCL          4u
#define KV_FLAG_NCCL_INIT     8u
#define KV_FLAG_DISTINCT_GPUS 16u /* NCCL_INIT: refuse a link from the receiver's own GPU */
#define KV_BOOT_ID_BYTES      40
#define KV_IPC_FIXED          144 /* IPC payload bytes before the block ids */

typedef struct {
    uint16_t version, flags;
    char request_id[PD_KV_REQUEST_ID_MAX];
    uint32_t layer, head0, n_heads, block0, n_blocks, n_tokens;
    uint64_t payload_bytes;
} kv_hdr;

void kv_hdr_pack(const kv_hdr *h, uint8_t out[KV_HDR_BYTES]);
/* False when the magic is wrong. The request id is always NUL-terminated. */
bool kv_hdr_unpack(const uint8_t in[KV_HDR_BYTES], kv_hdr *h);
/* The pool layers [*first, *end) r sends (its send_layer0 / send_layers); PD_EINVAL when they
 * are not the pool's. A frame names the model's layer: pool layer + r->layer0. */
int kv_send_layers(const pd_kv_send_req *r, int *first, int *end);
/* 1 when r sends a part of its pool's layers, or a pool of a pipeline stage (what only tcp's
 * frames carry). */
bool kv_send_partial(const pd_kv_send_req *r);
/* The header of a frame of r: version, request id, head and block fields from r; layer (the
 * model's), token count, flags and payload size as given. */
void kv_hdr_for(const pd_kv_send_req *r, int layer, size_t tokens, uint16_t flags,
                uint64_t payload_bytes, uint8_t out[KV_HDR_BYTES]);

void kv_ack_pack(uint8_t out[KV_ACK_BYTES], int32_t status, const char *id, const char *msg);
/* False when the magic is wrong or the acknowledgement is for another request than id; else
 * *status and msg (KV_ACK_MSG_BYTES, NUL-terminated). */
bool kv_ack_unpack(const uint8_t in[KV_ACK_BYTES], const char *id, int32_t *status, char *msg);

/* ---- payload sizes ---- */

/* The prompt's tokens in n_blocks blocks: n_tokens, or every slot when it is 0. PD_EINVAL when
 * the last token does not fall in the last block. */
int kv_tokens_in(const pd_kv_params *kp, size_t n_blocks, size_t n_tokens, size_t *out);
/* Bytes of one token of n_heads heads (K or V). */
size_t kv_token_bytes(const pd_kv_params *kp, size_t n_heads);
/* Payload of one plain frame (one layer): K and V of n_tokens tokens. */
size_t kv_slice_bytes(const pd_kv_params *kp, size_t n_tokens, size_t n_heads);

/* ---- IPC payload ---- */

typedef struct {
    char boot_id[KV_BOOT_ID_BYTES]; /* the sender host's kernel boot id, NUL-terminated */
    pd_kv_share share;              /* handle, pool id and geometry of the prefill pool */
    uint32_t src_head0;             /* first head to copy, local to the prefill pool */
} kv_ipc_desc;

size_t kv_ipc_payload_bytes(size_t n_blocks);
/* out: kv_ipc_payload_bytes(n_blocks) bytes. */
void kv_ipc_pack(const kv_ipc_desc *d, const int32_t *src_blocks, size_t n_blocks, uint8_t *out);
/* The fixed part; the block ids follow (kv_ipc_block). */
void kv_ipc_unpack(const uint8_t *in, kv_ipc_desc *d);
int32_t kv_ipc_block(const uint8_t *in, size_t i);

/* ---- NCCL request payload ---- */

#define PD_KV_NCCL_CHUNK_BYTES ((size_t)64 << 20) /* coalesced NCCL message, at most (bytes) */

/* Layers per NCCL chunk for a request whose layers are layer_bytes each (K and V): as many as
 * fit in cap bytes (0 = PD_KV_NCCL_CHUNK_BYTES), at least 1, at most n_layers. */
int pd_kv_nccl_chunk_layers(size_t layer_bytes, int n_layers, size_t cap);

/* The payload of an NCCL request frame: how the KV that follows on the link is cut. */
typedef struct {
    uint32_t chunk_layers; /* layers per chunk (the last chunk may have fewer) */
    uint64_t link_bytes;   /* bytes the request moves over the link, all chunks */
} pd_kv_nccl_desc;
#define PD_KV_NCCL_DESC_BYTES 16
void pd_kv_nccl_desc_pack(const pd_kv_nccl_desc *d, uint8_t out[PD_KV_NCCL_DESC_BYTES]);
/* PD_EINVAL (message names the field) when the description is not one for a request of
 * n_layers layers of layer_bytes each. */
int pd_kv_nccl_desc_unpack(const uint8_t in[PD_KV_NCCL_DESC_BYTES], int n_layers,
                           size_t layer_bytes, pd_kv_nccl_desc *out);

#endif
