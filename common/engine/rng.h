/* Counter-based random numbers for sampling: Philox4x32-10 (Salmon et al., SC'11, the
 * generator of Random123, cuRAND and PyTorch).
 *
 * Design choice: no generator state at all. A draw is a pure function of
 * (seed, sequence index, step, stream), so a request gives the same tokens whether it ran
 * split (first token sampled on a prefill node, the rest on a decode node) or colocated,
 * alone or in a batch, in any order, in any process. The 128-bit counter is
 *   { step low 32 bits, step high 32 bits, sequence index, stream }
 * and the 64-bit key is the seed (low word first). `stream` separates independent uses
 * at the same step (PD_RNG_STREAM_SAMPLE for the token draw).
 */
#ifndef PD_ENGINE_RNG_H
#define PD_ENGINE_RNG_H

#include <stdint.h>

enum {
    PD_RNG_STREAM_SAMPLE = 0, /* the uniform that picks a token */
};

/* One Philox4x32-10 block: out = philox(ctr, key). All arrays of uint32. */
void pd_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* The four raw 32-bit words for (seed, seq_index, step, stream). */
void pd_rng_words(uint64_t seed, uint32_t seq_index, uint64_t step, uint32_t stream,
                  uint32_t out[4]);

/* A uniform double in [0, 1) with 53 random bits (words 0 and 1 of the block). */
double pd_rng_uniform(uint64_t seed, uint32_t seq_index, uint64_t step, uint32_t stream);

/* Four uniform floats in [0, 1), 24 random bits each (one per word of the block). */
void pd_rng_uniform4f(uint64_t seed, uint32_t seq_index, uint64_t step, uint32_t stream,
                      float out[4]);

/* A seed for a request that did not give one: 64 bits from getrandom(), or from the clock
 * and the process id when that fails. Never fails. */
uint64_t pd_rng_random_seed(void);

#endif
