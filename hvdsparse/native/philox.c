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
 * (measured by scripts/bench_overhead.py). Integer arithmetic only, then one int -> fp32
 * conversion (round to nearest) and one fp32 product (no contraction: -ffp-contract=off).
 */
#include "philox.h"

HOT_PHILOX void hvd_philox_uniform(uint64_t seed, uint64_t offset, int64_t n, float *out)
{
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int64_t i = 0; i < n; i++) {
        out[i] = philox_to_uniform(philox_w0(k0, k1, offset + (uint64_t)i));
    }
}
