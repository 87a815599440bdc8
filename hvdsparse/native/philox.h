/* Philox 4x32-10, first output word, as Triton's tl.rand draws it: shared by philox.c
 * (the uniforms themselves) and quantize.c (QSGD's stochastic rounding, which draws
 * them inline instead of through a buffer). See philox.c for the stream's definition.
 */
#ifndef HVDSPARSE_PHILOX_H
#define HVDSPARSE_PHILOX_H
#include <stdint.h>

#define PHILOX_KEY_A 0x9E3779B9u
#define PHILOX_KEY_B 0xBB67AE85u
#define PHILOX_ROUND_A 0xD2511F53u
#define PHILOX_ROUND_B 0xCD9E8D57u

/* AVX-512 nearly halves the cost of the 64-bit products here (an ad-hoc timing, not a
 * benchmark in the repo: 4.35 M uniforms 24 -> 14 ms on one EPYC core); target_clones
 * takes arch=x86-64-v4 from GCC 12 on, older compilers keep the AVX2 / default pair */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define HOT_PHILOX __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT_PHILOX __attribute__((target_clones("avx2", "default")))
#else
#define HOT_PHILOX
#endif

static inline uint32_t philox_w0(uint32_t k0, uint32_t k1, uint64_t ctr)
{
    uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;
    for (int r = 0; r < 10; r++) {
        uint64_t pb = (uint64_t)PHILOX_ROUND_B * c2;
        uint64_t pa = (uint64_t)PHILOX_ROUND_A * c0;
        uint32_t n0 = (uint32_t)(pb >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(pa >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)pb;
        c3 = (uint32_t)pa;
        c0 = n0;
        c2 = n2;
        k0 += PHILOX_KEY_A;
        k1 += PHILOX_KEY_B;
    }
    return c0;
}


/* tl.rand's int -> fp32 map of one word: i = int32(w), i < 0 -> -i - 1, u = i * 2^-31 */
static inline float philox_to_uniform(uint32_t word)
{
    int32_t w = (int32_t)word;
    w ^= w >> 31;                      /* i < 0 -> -i - 1 */
    return (float)w * 4.6566127342e-10f;
}

#endif
