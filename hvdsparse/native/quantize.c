/* QSGD's stochastic quantisation and its dense decode on the CPU: the compiled twin of
 * hvdsparse/cpu.py's quantize_pack / dequantize_unpack (numpy blocks) and of the
 * quantised branch of kernels/scatter.py for DENSE segments, bit for bit.
 *
 * Quantise, per bucket b of B consecutive elements (slots j >= count read as 0):
 *   scale[b] = max |v_j|            (NaN if any |v_j| is NaN, as numpy's max)
 *   r_j = fp32(fp32(|v_j| * s) / scale[b])   or 0 when scale[b] is 0, Inf or NaN
 *   q_j = copysign(min(s, floor(r_j) + (u_j < r_j - floor(r_j))), v_j)
 *   code_j = uint8(int32(q_j) + 2^(bits-1)),  u_j = tl.rand(seed, j)  (philox.h)
 * with s = 2^(bits-1) - 1, codes packed 8 / bits per byte, element j at byte
 * j * bits / 8, bit (j * bits) % 8; bits past the last element are 0.
 *
 * Dequantise: v_j = fp32(fp32(q_j * scale[j / B]) / s), q_j = code_j - 2^(bits-1);
 * the decode of a DENSE segment adds row p's v_j into dense[j] for j < count[p], rows in
 * order (index_add_ row by row, the same sums on every rank).
 *
 * Why: the numpy route walks each block ~15 times (abs, max, multiply, divide, floor,
 * compare, pack...) and draws the uniforms into a buffer first; the DENSE decode went
 * through the generic scatter (an int64 copy and a range check of arange indices, then
 * index_add_). Here the quantiser reads each element twice (bucket max, then codes,
 * the bucket still in cache) with the Philox rounds inline, and the decode reads each
 * code byte once per row.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#include "philox.h"

/* elements of one working block: whole buckets, a multiple of the codes per byte */
static int64_t block_len(int64_t B, int per)
{
    int64_t rows = 4096 / B > 0 ? 4096 / B : 1;
    int64_t g = B, h = per;
    while (h) {
        int64_t t = g % h;
        g = h;
        h = t;
    }
    int64_t step = per / g;
    rows = (rows + step - 1) / step * step;
    return rows * B;
}

#define CHUNK 1024

/* codes of elements [j0, j1) of one bucket into q8 (q8[0] is element j0), in chunks:
 * the uniforms first, then the rounding (two loops gcc vectorises; one loop with both
 * did not vectorise) */
HOT_PHILOX static void bucket_codes(const float *restrict v, int64_t j0, int64_t j1,
                                    int64_t count, float sc, float fs, int half,
                                    uint32_t k0, uint32_t k1, uint8_t *restrict q8)
{
    const int ok = sc > 0.0f && sc < INFINITY;   /* false for NaN */
    float u[CHUNK], a[CHUNK];
    for (int64_t c0 = j0; c0 < j1; c0 += CHUNK) {
        const int64_t m = j1 - c0 < CHUNK ? j1 - c0 : CHUNK;
        const float *restrict x = v + c0;
        uint8_t *restrict q = q8 + (c0 - j0);
        for (int64_t i = 0; i < m; i++)
            u[i] = philox_to_uniform(philox_w0(k0, k1, (uint64_t)(c0 + i)));
        const int64_t valid = count <= c0 ? 0 : (count - c0 < m ? count - c0 : m);
        for (int64_t i = 0; i < m; i++)
            a[i] = i < valid ? fabsf(x[i]) : 0.0f;
        if (ok) {
            for (int64_t i = 0; i < m; i++)
                a[i] = (a[i] * fs) / sc;
        } else {
            for (int64_t i = 0; i < m; i++)
                a[i] = 0.0f;
        }
        for (int64_t i = 0; i < m; i++) {
            float r = a[i];
            float fl = floorf(r);
            float f = fl + (u[i] < r - fl ? 1.0f : 0.0f);
            f = f < fs ? f : fs;                  /* min(f, s); f is never NaN */
            f = copysignf(f, x[i]);
            q[i] = (uint8_t)((int32_t)f + half);
        }
    }
}

/* Elements [s0, e0) of v (count valid, the rest read as 0): scales[s0 / B ...] and the
 * packed codes from byte s0 * bits / 8 on. s0 is a multiple of B and of 8 / bits;
 * e0 is too, or is the layer's end. Returns 0, or -1 when out of memory. */
int64_t hvd_quantize_pack(const float *v, int64_t s0, int64_t e0, int64_t count, int bits,
                          int64_t B, uint64_t seed, uint8_t *codes, float *scales)
{
    const int per = 8 / bits, half = 1 << (bits - 1);
    const float fs = (float)(half - 1);
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const int64_t L = block_len(B, per);
    uint8_t *q8 = malloc((size_t)L);
    if (!q8)
        return -1;
    for (int64_t bs = s0; bs < e0; bs += L) {
        int64_t be = bs + L < e0 ? bs + L : e0;
        for (int64_t b0 = bs; b0 < be; b0 += B) {
            int64_t b1 = b0 + B < be ? b0 + B : be;
            float m = 0.0f;
            int nan = 0;
            float first_nan = 0.0f;
            for (int64_t j = b0; j < b1; j++) {
                float a = j < count ? fabsf(v[j]) : 0.0f;
                if (a != a && !nan) {
                    nan = 1;
                    first_nan = a;
                }
                m = a > m ? a : m;
            }
            float sc = nan ? first_nan : m;
            scales[b0 / B] = sc;
            bucket_codes(v, b0, b1, count, sc, fs, half, k0, k1, q8 + (b0 - bs));
        }
        int64_t m = be - bs;
        uint8_t *out = codes + bs / per;
        if (per == 1) {
            for (int64_t i = 0; i < m; i++)
                out[i] = q8[i];
            continue;
        }
        int64_t nfull = m / per;
        for (int64_t k = 0; k < nfull; k++) {
            uint8_t byte = 0;
            for (int t = 0; t < per; t++)
                byte |= (uint8_t)(q8[k * per + t] << (t * bits));
            out[k] = byte;
        }
        if (nfull * per < m) {                       /* the layer's last, partial byte */
            uint8_t byte = 0;
            for (int64_t t = 0; nfull * per + t < m; t++)
                byte |= (uint8_t)(q8[nfull * per + t] << (t * bits));
            out[nfull] = byte;
        }
    }
    free(q8);
    return 0;
}

/* codes of elements [j0, j0 + m) (j0 a multiple of 8 / bits, m <= CHUNK) as q = code -
 * 2^(bits-1), fp32 */
HOT_PHILOX static void unpack_chunk(const uint8_t *restrict codes, int bits, int64_t j0, int64_t m,
                         float *restrict q)
{
    const int half = 1 << (bits - 1);
    if (bits == 8) {
        const uint8_t *restrict c = codes + j0;
        for (int64_t i = 0; i < m; i++)
            q[i] = (float)((int)c[i] - half);
    } else if (bits == 4) {
        const uint8_t *restrict c = codes + j0 / 2;
        int64_t nb = m / 2;
        for (int64_t k = 0; k < nb; k++) {
            q[2 * k] = (float)((int)(c[k] & 15) - half);
            q[2 * k + 1] = (float)((int)(c[k] >> 4) - half);
        }
        if (m & 1)
            q[m - 1] = (float)((int)(c[nb] & 15) - half);
    } else {
        const uint8_t *restrict c = codes + j0 / 4;
        for (int64_t i = 0; i < m; i++)
            q[i] = (float)((int)((c[i >> 2] >> ((i & 3) * 2)) & 3) - half);
    }
}

/* v_j of elements [s0, e0) into out[j - s0] (add = 0) or added to out[j - s0] (add = 1);
 * s0 is a multiple of 8 / bits */
HOT_PHILOX static void dequant_range(const uint8_t *codes, const float *scales, int bits, int64_t B,
                          int64_t s0, int64_t e0, float *restrict out, int add)
{
    const float fs = (float)((1 << (bits - 1)) - 1);
    float q[CHUNK];
    for (int64_t c0 = s0; c0 < e0; c0 += CHUNK) {
        const int64_t m = e0 - c0 < CHUNK ? e0 - c0 : CHUNK;
        unpack_chunk(codes, bits, c0, m, q);
        /* per bucket inside the chunk: one scale */
        for (int64_t i0 = 0; i0 < m;) {
            const int64_t j = c0 + i0, b = j / B;
            int64_t i1 = (b + 1) * B - c0;
            i1 = i1 < m ? i1 : m;
            const float sc = scales[b];
            float *restrict o = out + (c0 - s0);
            if (add) {
                for (int64_t i = i0; i < i1; i++)
                    o[i] += (q[i] * sc) / fs;
            } else {
                for (int64_t i = i0; i < i1; i++)
                    o[i] = (q[i] * sc) / fs;
            }
            i0 = i1;
        }
    }
}

/* dequantize_unpack of elements [s0, e0) into out[0 .. e0 - s0) */
void hvd_dequantize(const uint8_t *codes, const float *scales, int bits, int64_t B,
                    int64_t s0, int64_t e0, float *out)
{
    dequant_range(codes, scales, bits, B, s0, e0, out, 0);
}

/* The decode of a quantised DENSE segment: dense[j] += v_j of row p for j < count[p],
 * rows p = 0 .. P-1 in order; row p's codes / scales start cstride bytes /
 * sstride floats after row p - 1's (the caller checks every count first). */
void hvd_dense_add_dequantize(float *dense, const uint8_t *codes, int64_t cstride,
                              const float *scales, int64_t sstride, const int64_t *count,
                              int64_t P, int bits, int64_t B)
{
    for (int64_t p = 0; p < P; p++)
        dequant_range(codes + p * cstride, scales + p * sstride, bits, B, 0, count[p],
                      dense, 1);
}

/* The decode of an fp32 DENSE segment: dense[j] += values[p][j] for j < count[p], rows
 * in order (index_add_ of arange indices, row by row). */
void hvd_dense_add_f32(float *restrict dense, const float *values, int64_t vstride,
                       const int64_t *count, int64_t P)
{
    for (int64_t p = 0; p < P; p++) {
        const float *restrict row = values + p * vstride;
        for (int64_t j = 0; j < count[p]; j++)
            dense[j] += row[j];
    }
}
