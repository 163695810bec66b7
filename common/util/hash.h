/* 64-bit mixing: SplitMix64's finalizer (Steele, Lea, Flood 2014), a bijection whose every
 * output bit depends on every input bit. For hash keys and counter-based random streams; not a
 * cryptographic hash. */
#ifndef PD_UTIL_HASH_H
#define PD_UTIL_HASH_H

#include <stdint.h>

static inline uint64_t pd_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

#endif
