/* Philox 4x32-10 uniforms on the CPU: the compiled twin of hvdsparse/philox.py's numpy
 * stream (and so of Triton's tl.rand), bit for bit.
 *
 *   out[i] = tl.rand(seed, offset + i):  counter block (ctr_lo, ctr_hi, 0, 0) with
 *   ctr = offset + i, key (seed_lo, seed_hi), 10 rounds with Triton's constants; the
 *   first output word w maps to fp32 as Triton's uint_to_uniform_float:
 *   i = int32(w), i < 0 -> -i - 1 (i ^ (i >> 31)), u = fp32(i) * fp32(4.6566127342e-10).
 *
 * Why: QSGD's stochastic rounding needs one uniform per element, and the numpy version
 * (uint64 mulhilo, ~90 ufunc passes over every block) was most of QSGD's CPU cost
 * (BENCHMARKS.md section 7). Integer arithmetic only, then one int -> fp32 conversion
 * (round to nearest) and one fp32 product (no contraction: -ffp-contract=off).
 */
#include <stdint.h>

#define PHILOX_KEY_A 0x9E3779B9u
#define PHILOX_KEY_B 0xBB67AE85u
#define PHILOX_ROUND_A 0xD2511F53u
#define PHILOX_ROUND_B 0xCD9E8D57u

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
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

HOT_PHILOX void hvd_philox_uniform(uint64_t seed, uint64_t offset, int64_t n, float *out)
{
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int64_t i = 0; i < n; i++) {
        int32_t w = (int32_t)philox_w0(k0, k1, offset + (uint64_t)i);
        w ^= w >> 31;                      /* i < 0 -> -i - 1 */
        out[i] = (float)w * 4.6566127342e-10f;
    }
}
