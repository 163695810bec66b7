/* Unit tests: Philox4x32-10 against Random123's published known-answer vectors
 * (kat_vectors, "philox4x32 10" lines), and the (seed, sequence, step) uniforms built on it. */
#include "harness.h"

#include "engine/rng.h"

typedef struct {
    uint32_t ctr[4], key[2], want[4];
} kat;

/* Random123 tests/kat_vectors: CTR (4 words), KEY (2 words), EXPECTED (4 words). */
static const kat philox_kats[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000},
     {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

TEST(philox4x32_10_known_answers)
{
    for (size_t i = 0; i < sizeof philox_kats / sizeof philox_kats[0]; i++) {
        uint32_t out[4];
        pd_philox4x32_10(philox_kats[i].ctr, philox_kats[i].key, out);
        for (int j = 0; j < 4; j++)
            ASSERT_MSG(out[j] == philox_kats[i].want[j], "vector %zu word %d: %08x != %08x", i, j,
                       out[j], philox_kats[i].want[j]);
    }
}

TEST(rng_words_layout)
{
    /* counter = {step lo, step hi, seq_index, stream}, key = {seed lo, seed hi} */
    uint32_t a[4], b[4];
    pd_rng_words(0x299f31d0a4093822ull, 0x13198a2e, 0x85a308d3243f6a88ull, 0x03707344, a);
    ASSERT(a[0] == 0xd16cfe09 && a[1] == 0x94fdcceb && a[2] == 0x5001e420 && a[3] == 0x24126ea1);
    pd_rng_words(0, 0, 0, 0, b);
    ASSERT(b[0] == 0x6627e8d5 && b[3] == 0x9b00dbd8);
}

TEST(rng_uniform_is_pure_and_in_range)
{
    double sum = 0.0, sum2 = 0.0;
    const int n = 200000;
    for (int i = 0; i < n; i++) {
        double u = pd_rng_uniform(42, 3, (uint64_t)i, PD_RNG_STREAM_SAMPLE);
        ASSERT(u >= 0.0 && u < 1.0);
        sum += u;
        sum2 += u * u;
    }
    double mean = sum / n, var = sum2 / n - mean * mean;
    /* mean 1/2 (sd of the estimate 0.00065), variance 1/12 */
    ASSERT_NEAR(mean, 0.5, 0.004);
    ASSERT_NEAR(var, 1.0 / 12.0, 0.002);
    /* pure: the same inputs in any order give the same value */
    double x = pd_rng_uniform(7, 1, 99, 0);
    (void)pd_rng_uniform(8, 2, 5, 0);
    ASSERT(pd_rng_uniform(7, 1, 99, 0) == x);
    /* every input matters */
    ASSERT(pd_rng_uniform(8, 1, 99, 0) != x);
    ASSERT(pd_rng_uniform(7, 2, 99, 0) != x);
    ASSERT(pd_rng_uniform(7, 1, 100, 0) != x);
    ASSERT(pd_rng_uniform(7, 1, 99, 1) != x);
    ASSERT(pd_rng_uniform(7, 1, 99 + (1ull << 32), 0) != x);
    ASSERT(pd_rng_uniform(7 + (1ull << 32), 1, 99, 0) != x);
}

TEST(rng_uniform4f_range)
{
    float lo = 1.0f, hi = 0.0f;
    for (int i = 0; i < 50000; i++) {
        float f[4];
        pd_rng_uniform4f(1, 0, (uint64_t)i, 0, f);
        for (int j = 0; j < 4; j++) {
            ASSERT(f[j] >= 0.0f && f[j] < 1.0f);
            lo = f[j] < lo ? f[j] : lo;
            hi = f[j] > hi ? f[j] : hi;
        }
    }
    ASSERT(lo < 0.001f && hi > 0.999f);
}

TEST(rng_random_seed_varies)
{
    uint64_t a = pd_rng_random_seed(), b = pd_rng_random_seed();
    ASSERT(a != b);
}
