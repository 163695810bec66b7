/* The KV data plane's wire format (see kv_frames.h): the one place that turns frames,
 * acknowledgements and payload descriptions into bytes and back. Byte by byte, so the layout is
 * the same on every host whatever its endianness or struct padding.
 */
#include "transfer/kv_frames.h"

#include <stdio.h>
#include <string.h>

#include "util/status.h"

_Static_assert(8 + PD_KV_REQUEST_ID_MAX + 6 * 4 + 8 == KV_HDR_BYTES, "frame header layout");
_Static_assert(52 + KV_ACK_MSG_BYTES == KV_ACK_BYTES, "acknowledgement layout");
_Static_assert(KV_BOOT_ID_BYTES + PD_KV_SHARE_HANDLE_BYTES + 8 + 4 + 4 + 8 + 4 * 4 == KV_IPC_FIXED,
               "IPC payload layout");

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

void kv_hdr_pack(const kv_hdr *h, uint8_t p[KV_HDR_BYTES])
{
    memcpy(p, "PDKV", 4);
    put_u16(p + 4, h->version);
    put_u16(p + 6, h->flags);
    memset(p + 8, 0, PD_KV_REQUEST_ID_MAX);
    memcpy(p + 8, h->request_id, strnlen(h->request_id, PD_KV_REQUEST_ID_MAX - 1));
    put_u32(p + 48, h->layer);
    put_u32(p + 52, h->head0);
    put_u32(p + 56, h->n_heads);
    put_u32(p + 60, h->block0);
    put_u32(p + 64, h->n_blocks);
    put_u32(p + 68, h->n_tokens);
    put_u64(p + 72, h->payload_bytes);
}

bool kv_hdr_unpack(const uint8_t p[KV_HDR_BYTES], kv_hdr *h)
{
    if (memcmp(p, "PDKV", 4) != 0) return false;
    h->version = get_u16(p + 4);
    h->flags = get_u16(p + 6);
    memcpy(h->request_id, p + 8, PD_KV_REQUEST_ID_MAX);
    h->request_id[PD_KV_REQUEST_ID_MAX - 1] = '\0';
    h->layer = get_u32(p + 48);
    h->head0 = get_u32(p + 52);
    h->n_heads = get_u32(p + 56);
    h->block0 = get_u32(p + 60);
    h->n_blocks = get_u32(p + 64);
    h->n_tokens = get_u32(p + 68);
    h->payload_bytes = get_u64(p + 72);
    return true;
}

int kv_send_layers(const pd_kv_send_req *r, int *first, int *end)
{
    size_t n = (size_t)r->kv_params.n_layers;
    if (!r->send_layers) {
        *first = 0;
        *end = (int)n;
        return PD_OK;
    }
    if (r->send_layer0 < r->layer0 || r->send_layer0 - r->layer0 > n ||
        r->send_layers > n - (r->send_layer0 - r->layer0))
        return pd_error(PD_EINVAL, "kv send %s: layers [%zu, +%zu) outside the pool's [%zu, +%zu)",
                        r->request_id, r->send_layer0, r->send_layers, r->layer0, n);
    *first = (int)(r->send_layer0 - r->layer0);
    *end = *first + (int)r->send_layers;
    return PD_OK;
}

bool kv_send_partial(const pd_kv_send_req *r)
{
    return r->layer0 != 0 || (r->send_layers && r->send_layers != (size_t)r->kv_params.n_layers);
}

void kv_hdr_for(const pd_kv_send_req *r, int layer, size_t tokens, uint16_t flags,
                uint64_t payload_bytes, uint8_t out[KV_HDR_BYTES])
{
    kv_hdr h = {.version = KV_VERSION,
                .flags = flags,
                .layer = (uint32_t)layer,
                .head0 = (uint32_t)r->head0,
                .n_heads = (uint32_t)r->n_heads,
                .block0 = 0,
                .n_blocks = (uint32_t)r->n_blocks,
                .n_tokens = (uint32_t)tokens,
                .payload_bytes = payload_bytes};
    snprintf(h.request_id, sizeof h.request_id, "%s", r->request_id);
    kv_hdr_pack(&h, out);
}

void kv_ack_pack(uint8_t p[KV_ACK_BYTES], int32_t status, const char *id, const char *msg)
{
    memset(p, 0, KV_ACK_BYTES);
    memcpy(p, "PDKA", 4);
    put_u16(p + 4, KV_VERSION);
    put_u32(p + 8, (uint32_t)status);
    memcpy(p + 12, id, strnlen(id, PD_KV_REQUEST_ID_MAX - 1));
    memcpy(p + 52, msg, strnlen(msg, KV_ACK_MSG_BYTES - 1));
}

bool kv_ack_unpack(const uint8_t p[KV_ACK_BYTES], const char *id, int32_t *status, char *msg)
{
    if (memcmp(p, "PDKA", 4) != 0 || strncmp((const char *)p + 12, id, PD_KV_REQUEST_ID_MAX) != 0)
        return false;
    *status = (int32_t)get_u32(p + 8);
    memcpy(msg, p + 52, KV_ACK_MSG_BYTES);
    msg[KV_ACK_MSG_BYTES - 1] = '\0';
    return true;
}

int kv_tokens_in(const pd_kv_params *kp, size_t n_blocks, size_t n_tokens, size_t *out)
{
    size_t bs = kp->block_size;
    if (n_tokens && (n_tokens > n_blocks * bs || n_tokens <= (n_blocks - 1) * bs))
        return pd_error(PD_EINVAL, "kv: %zu tokens do not end in the last of %zu %zu-token blocks",
                        n_tokens, n_blocks, bs);
    *out = n_tokens ? n_tokens : n_blocks * bs;
    return PD_OK;
}

size_t kv_token_bytes(const pd_kv_params *kp, size_t n_heads)
{
    return n_heads * kp->head_dim * pd_dtype_size(kp->dtype);
}

size_t kv_slice_bytes(const pd_kv_params *kp, size_t n_tokens, size_t n_heads)
{
    return 2 * n_tokens * kv_token_bytes(kp, n_heads);
}

size_t kv_ipc_payload_bytes(size_t n_blocks)
{
    return KV_IPC_FIXED + 4 * n_blocks;
}

void kv_ipc_pack(const kv_ipc_desc *d, const int32_t *src_blocks, size_t n_blocks, uint8_t *p)
{
    const pd_kv_params *kp = &d->share.p;
    memcpy(p, d->boot_id, KV_BOOT_ID_BYTES);
    memcpy(p + 40, d->share.handle, PD_KV_SHARE_HANDLE_BYTES);
    put_u64(p + 104, d->share.id);
    put_u32(p + 112, (uint32_t)kp->n_layers);
    put_u32(p + 116, (uint32_t)kp->block_size);
    put_u64(p + 120, kp->n_blocks);
    put_u32(p + 128, (uint32_t)kp->n_kv_heads);
    put_u32(p + 132, (uint32_t)kp->head_dim);
    put_u32(p + 136, (uint32_t)kp->dtype);
    put_u32(p + 140, d->src_head0);
    for (size_t i = 0; i < n_blocks; i++)
        put_u32(p + KV_IPC_FIXED + 4 * i, (uint32_t)src_blocks[i]);
}

void kv_ipc_unpack(const uint8_t *p, kv_ipc_desc *d)
{
    memcpy(d->boot_id, p, KV_BOOT_ID_BYTES);
    d->boot_id[KV_BOOT_ID_BYTES - 1] = '\0';
    memcpy(d->share.handle, p + 40, PD_KV_SHARE_HANDLE_BYTES);
    d->share.id = get_u64(p + 104);
    d->share.p = (pd_kv_params){.n_layers = (int)get_u32(p + 112),
                                .block_size = get_u32(p + 116),
                                .n_blocks = get_u64(p + 120),
                                .n_kv_heads = get_u32(p + 128),
                                .head_dim = get_u32(p + 132),
                                .dtype = (pd_dtype)get_u32(p + 136)};
    d->src_head0 = get_u32(p + 140);
}

int32_t kv_ipc_block(const uint8_t *p, size_t i)
{
    return (int32_t)get_u32(p + KV_IPC_FIXED + 4 * i);
}

int pd_kv_nccl_chunk_layers(size_t layer_bytes, int n_layers, size_t cap)
{
    if (!cap) cap = PD_KV_NCCL_CHUNK_BYTES;
    if (n_layers < 1) return 1;
    size_t k = layer_bytes ? cap / layer_bytes : (size_t)n_layers;
    if (k < 1) k = 1;
    if (k > (size_t)n_layers) k = (size_t)n_layers;
    return (int)k;
}

void pd_kv_nccl_desc_pack(const pd_kv_nccl_desc *d, uint8_t out[PD_KV_NCCL_DESC_BYTES])
{
    put_u32(out, d->chunk_layers);
    put_u32(out + 4, 0);
    put_u64(out + 8, d->link_bytes);
}

int pd_kv_nccl_desc_unpack(const uint8_t in[PD_KV_NCCL_DESC_BYTES], int n_layers,
                           size_t layer_bytes, pd_kv_nccl_desc *out)
{
    out->chunk_layers = get_u32(in);
    out->link_bytes = get_u64(in + 8);
    if (out->chunk_layers < 1 || n_layers < 1 || out->chunk_layers > (uint32_t)n_layers)
        return pd_error(PD_EINVAL, "kv NCCL frame: chunk_layers %u outside 1..%d",
                        out->chunk_layers, n_layers);
    if (get_u32(in + 4) != 0)
        return pd_error(PD_EINVAL, "kv NCCL frame: reserved field is %u, expected 0",
                        get_u32(in + 4));
    if (out->link_bytes != (uint64_t)n_layers * layer_bytes)
        return pd_error(
            PD_EINVAL, "kv NCCL frame: link_bytes %llu, expected %llu (%d layers of %zu)",
            (unsigned long long)out->link_bytes,
            (unsigned long long)((uint64_t)n_layers * layer_bytes), n_layers, layer_bytes);
    return PD_OK;
}
