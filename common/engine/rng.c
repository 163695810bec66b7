/* Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
 * SC'11), written from the paper's definition: 10 rounds of two 32x32->64 multiplies with a
 * Weyl-sequence key schedule. Checked against Random123's known-answer vectors in
 * tests/unit/sampler/test_rng.c. See rng.h for how (seed, sequence, step) map to a block. */
#include "engine/rng.h"

#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u /* golden ratio */
#define PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

static inline void philox_round(uint32_t c[4], const uint32_t k[2])
{
    uint64_t p0 = (uint64_t)PHILOX_M0 * c[0];
    uint64_t p1 = (uint64_t)PHILOX_M1 * c[2];
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    uint32_t n0 = hi1 ^ c[1] ^ k[0];
    uint32_t n2 = hi0 ^ c[3] ^ k[1];
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
}

void pd_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    uint32_t k[2] = {key[0], key[1]};
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k[0] += PHILOX_W0;
            k[1] += PHILOX_W1;
        }
        philox_round(c, k);
    }
    out[0] = c[0];
    out[1] = c[1];
    out[2] = c[2];
    out[3] = c[3];
}

void pd_rng_words(uint64_t seed, uint32_t seq_index, uint64_t step, uint32_t stream,
                  uint32_t out[4])
{
    const uint32_t ctr[4] = {(uint32_t)step, (uint32_t)(step >> 32), seq_index, stream};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    pd_philox4x32_10(ctr, key, out);
}

double pd_rng_uniform(uint64_t seed, uint32_t seq_index, uint64_t step, uint32_t stream)
{
    uint32_t w[4];
    pd_rng_words(seed, seq_index, step, stream, w);
    /* 27 high bits of word 0 and 26 of word 1: 53 bits, exactly representable. */
    uint64_t bits = ((uint64_t)(w[0] >> 5) << 26) | (uint64_t)(w[1] >> 6);
    return (double)bits * (1.0 / 9007199254740992.0); /* 2^-53 */
}

void pd_rng_uniform4f(uint64_t seed, uint32_t seq_index, uint64_t step, uint32_t stream,
                      float out[4])
{
    uint32_t w[4];
    pd_rng_words(seed, seq_index, step, stream, w);
    for (int i = 0; i < 4; i++) out[i] = (float)(w[i] >> 8) * (1.0f / 16777216.0f); /* 2^-24 */
}

uint64_t pd_rng_random_seed(void)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof s, GRND_NONBLOCK) == (ssize_t)sizeof s) return s;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* Mix clock and pid through one Philox block so nearby values give unrelated seeds. */
    const uint32_t ctr[4] = {(uint32_t)ts.tv_nsec, (uint32_t)ts.tv_sec, (uint32_t)getpid(), 0};
    const uint32_t key[2] = {0x5eed5eedu, (uint32_t)((uint64_t)ts.tv_sec >> 32)};
    uint32_t w[4];
    pd_philox4x32_10(ctr, key, w);
    return ((uint64_t)w[0] << 32) | w[1];
}
