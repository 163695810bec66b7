/* Conversions between pd.proto messages (protobuf-c) and the engine's structs, and packing
 * helpers, shared by the nodes and the scheduler. */
#ifndef PD_RPC_PD_MSG_H
#define PD_RPC_PD_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "engine/sampler.h"
#include "rpc/pd.pb-c.h"
#include "util/arena.h"

/* Packs any message into a malloc'd buffer (*len bytes). NULL when out of memory. */
uint8_t *pd_msg_pack(const ProtobufCMessage *m, size_t *len);

/* proto -> engine: arrays and strings are copied into a (they live as long as a). */
int pd_msg_sampling_from_proto(const Pd__SamplingParams *m, pd_arena *a, pd_sampling_params *out);
/* engine -> proto: m borrows the arrays of p (keep p alive until m is packed); the pointer
 * arrays m needs (logit_bias entries) are allocated in a. */
int pd_msg_sampling_to_proto(const pd_sampling_params *p, pd_arena *a, Pd__SamplingParams *m);

#endif
