/* libFuzzer target: pd.proto messages (protobuf-c) and the conversions of common/rpc/pd_msg.c.
 *
 * Every input is unpacked as each of the 17 message types of pd.proto, as the nodes and the
 * scheduler unpack what arrives from the network. For each type that accepts it, a broken
 * invariant aborts (a finding): pd_msg_pack of the unpacked message unpacks again and packs to
 * the same bytes (canonical form is stable). Every SamplingParams found (alone, or inside
 * PrefillRequest / DecodeRequest, where the nodes take it) goes through what the nodes do with
 * it: pd_msg_sampling_from_proto, then pd_sampling_params_validate (the engine's admission
 * check) against a small vocabulary; and the engine struct survives
 * to_proto -> pack -> unpack -> from_proto unchanged, field by field.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"
#include "rpc/pd.pb-c.h"
#include "rpc/pd_msg.h"
#include "util/arena.h"
#include "util/status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_pd_msg invariant broken: %s: %s\n", what, detail);
    abort();
}

static const ProtobufCMessageDescriptor *const g_types[] = {
    &pd__info_request__descriptor,    &pd__rank_info__descriptor,
    &pd__info_reply__descriptor,      &pd__stats_request__descriptor,
    &pd__stats_reply__descriptor,     &pd__logit_bias__descriptor,
    &pd__sampling_params__descriptor, &pd__top_logprob__descriptor,
    &pd__token_event__descriptor,     &pd__reserve_request__descriptor,
    &pd__reserve_reply__descriptor,   &pd__decode_target__descriptor,
    &pd__prefill_request__descriptor, &pd__prefill_reply__descriptor,
    &pd__decode_request__descriptor,  &pd__abort_request__descriptor,
    &pd__abort_reply__descriptor,
};

/* Equal values: the same bits (NaN payloads survive the wire) or equal as numbers. proto3 does
 * not send a field holding its default, and -0.0 == 0, so -0.0 arrives as +0.0; no check
 * tells them apart (every range test treats them alike). */
static bool same_double(double a, double b)
{
    return a == b || memcmp(&a, &b, sizeof a) == 0;
}

static bool same_float(float a, float b)
{
    return a == b || memcmp(&a, &b, sizeof a) == 0;
}

/* Field-by-field equality of two engine structs. */
static void check_same(const pd_sampling_params *a, const pd_sampling_params *b)
{
    if (a->n != b->n || !same_double(a->temperature, b->temperature) ||
        !same_double(a->top_p, b->top_p) || a->top_k != b->top_k ||
        !same_double(a->min_p, b->min_p) ||
        !same_double(a->presence_penalty, b->presence_penalty) ||
        !same_double(a->frequency_penalty, b->frequency_penalty) ||
        !same_double(a->repetition_penalty, b->repetition_penalty))
        fail("sampling round trip", "a numeric field changed");
    if (a->has_seed != b->has_seed || a->seed != b->seed || a->min_tokens != b->min_tokens ||
        a->ignore_eos != b->ignore_eos || a->logprobs != b->logprobs ||
        a->include_stop_str_in_output != b->include_stop_str_in_output ||
        a->max_tokens != b->max_tokens || a->skip_special_tokens != b->skip_special_tokens ||
        a->has_allowed_token_ids != b->has_allowed_token_ids)
        fail("sampling round trip", "a scalar field changed");
    if (a->n_logit_bias != b->n_logit_bias || a->n_allowed_token_ids != b->n_allowed_token_ids ||
        a->n_stop_token_ids != b->n_stop_token_ids || a->n_stop != b->n_stop)
        fail("sampling round trip", "an array length changed");
    for (int32_t i = 0; i < a->n_logit_bias; i++)
        if (a->logit_bias[i].id != b->logit_bias[i].id ||
            !same_float(a->logit_bias[i].bias, b->logit_bias[i].bias))
            fail("sampling round trip", "logit_bias changed");
    if (a->n_allowed_token_ids > 0 && memcmp(a->allowed_token_ids, b->allowed_token_ids,
                                             (size_t)a->n_allowed_token_ids * sizeof(int32_t)) != 0)
        fail("sampling round trip", "allowed_token_ids changed");
    if (a->n_stop_token_ids > 0 && memcmp(a->stop_token_ids, b->stop_token_ids,
                                          (size_t)a->n_stop_token_ids * sizeof(int32_t)) != 0)
        fail("sampling round trip", "stop_token_ids changed");
    for (int32_t i = 0; i < a->n_stop; i++)
        if (strcmp(a->stop[i], b->stop[i]) != 0) fail("sampling round trip", "stop changed");
}

/* What a node does with the SamplingParams of a request (m may be NULL: defaults). */
static void check_sampling(const Pd__SamplingParams *m)
{
    pd_arena *a = pd_arena_create(4096);
    if (!a) abort();
    pd_sampling_params p;
    if (pd_msg_sampling_from_proto(m, a, &p) < 0) fail("from_proto", pd_last_error());
    pd_error_clear();
    if (pd_sampling_params_validate(&p, 300) < 0 && pd_last_error()[0] == '\0')
        fail("validate", "refused without a message");
    (void)pd_sampling_is_greedy(&p);
    Pd__SamplingParams back;
    if (pd_msg_sampling_to_proto(&p, a, &back) < 0) fail("to_proto", pd_last_error());
    size_t len = 0;
    uint8_t *buf = pd_msg_pack(&back.base, &len);
    if (!buf) abort();
    Pd__SamplingParams *again = pd__sampling_params__unpack(NULL, len, buf);
    if (!again) fail("sampling round trip", "packed params do not unpack");
    pd_sampling_params q;
    if (pd_msg_sampling_from_proto(again, a, &q) < 0) fail("from_proto again", pd_last_error());
    check_same(&p, &q);
    pd__sampling_params__free_unpacked(again, NULL);
    free(buf);
    pd_arena_free(a);
}

/* True when m or a message inside it kept an unknown field numbered 0. protobuf-c 1.4.1 accepts
 * field number 0 spelled as an overlong varint (0x80 0x00), keeps it as an unknown field and
 * packs it back as 0x00, which its own unpack refuses: a library quirk, harmless here because
 * pdserve never forwards a message it received. Such messages skip the repack check. */
static bool has_field_zero(const ProtobufCMessage *m)
{
    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        if (m->unknown_fields[i].tag == 0) return true;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned f = 0; f < d->n_fields; f++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[f];
        if (fd->type != PROTOBUF_C_TYPE_MESSAGE) continue;
        const char *base = (const char *)m + fd->offset;
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)((const char *)m + fd->quantifier_offset);
            const ProtobufCMessage *const *v = *(const ProtobufCMessage *const *const *)base;
            for (size_t k = 0; k < n; k++)
                if (has_field_zero(v[k])) return true;
        } else {
            const ProtobufCMessage *sub = *(const ProtobufCMessage *const *)base;
            if (sub && has_field_zero(sub)) return true;
        }
    }
    return false;
}

static void check_repack(const ProtobufCMessageDescriptor *d, const ProtobufCMessage *m)
{
    size_t len = 0;
    uint8_t *buf = pd_msg_pack(m, &len);
    if (!buf) abort();
    if (len != protobuf_c_message_get_packed_size(m)) fail(d->name, "packed size differs");
    ProtobufCMessage *again = protobuf_c_message_unpack(d, NULL, len, buf);
    if (!again && has_field_zero(m)) {
        free(buf);
        return;
    }
    if (!again) fail(d->name, "packed message does not unpack");
    size_t len2 = 0;
    uint8_t *buf2 = pd_msg_pack(again, &len2);
    if (!buf2) abort();
    if (len2 != len || memcmp(buf, buf2, len) != 0) fail(d->name, "repacking is not stable");
    free(buf2);
    protobuf_c_message_free_unpacked(again, NULL);
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (size_t t = 0; t < sizeof g_types / sizeof g_types[0]; t++) {
        const ProtobufCMessageDescriptor *d = g_types[t];
        ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, size, data);
        if (!m) continue;
        if (!protobuf_c_message_check(m)) fail(d->name, "unpacked message fails its check");
        check_repack(d, m);
        if (d == &pd__sampling_params__descriptor)
            check_sampling((const Pd__SamplingParams *)m);
        else if (d == &pd__prefill_request__descriptor)
            check_sampling(((const Pd__PrefillRequest *)m)->sampling);
        else if (d == &pd__decode_request__descriptor)
            check_sampling(((const Pd__DecodeRequest *)m)->sampling);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    return 0;
}
