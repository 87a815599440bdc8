/* Decode + accumulate of fp32 (index, value) rows -- and of sign-bit rows (AdaComp) -- on
 * the CPU: the compiled twin of the fp32 and sign branches of kernels/scatter.py, called
 * by hvdsparse/cpu.py:scatter_add_decode.
 *
 *   dense[idx[p][j]] += val[p][j]    for p = 0 .. P-1 (row order), j < count[p] (slot order)
 *
 * Every row's indices are checked against [0, N) before anything is written (the CPU
 * path raises and writes nothing on a bad message, kernels/scatter.py skips the slot
 * and sets a flag instead). Rows are added one after the other in rank order, each
 * element receiving its addends in that order, so the fp32 sum is the same as
 * torch's index_add_ row by row (and the Triton kernel's stream-ordered launches): the
 * same bits on every rank and every run. Repeated indices inside one (malformed) row
 * accumulate in slot order.
 *
 * Why: the torch route makes an int64 copy of each row's indices and checks their range
 * in separate passes before index_add_; this reads each int32 index twice (check, add)
 * and each value once, without temporaries (the wide MLP's TopK decode at P = 4,
 * codec.accumulate: about 4 -> 2 ms, one thread, in an ad-hoc timing).
 * Rows are strided views into the received message (istride / vstride elements apart).
 */
#include <stdint.h>

/* the first out-of-range (row, slot) into bad and 1, or 0 when every index of every
 * row is in [0, N) */
static int64_t check_rows(int64_t N, const int32_t *idx, int64_t istride,
                          const int64_t *count, int64_t P, int64_t *bad)
{
    for (int64_t p = 0; p < P; p++) {
        const int32_t *ix = idx + p * istride;
        int64_t c = count[p];
        int any = 0;
        for (int64_t j = 0; j < c; j++) {          /* branch-free: vectorised */
            int64_t i = ix[j];
            any |= (i < 0) | (i >= N);
        }
        if (any) {
            for (int64_t j = 0; j < c; j++) {
                int64_t i = ix[j];
                if (i < 0 || i >= N) {
                    bad[0] = p;
                    bad[1] = j;
                    return 1;
                }
            }
        }
    }
    return 0;
}

/* Sign rows (AdaComp): slot j of row p adds -scale[p] when bit j % 8 of byte j / 8 of
 * the row's sign bytes is set, +scale[p] otherwise (torch.where(bit, -s, s) then
 * index_add_, row by row). Same checks and return as hvd_scatter_add_f32. */
int64_t hvd_scatter_add_sign(float *dense, int64_t N, const int32_t *idx, int64_t istride,
                             const uint8_t *signs, int64_t sstride, const float *scale,
                             const int64_t *count, int64_t P, int64_t *bad)
{
    if (check_rows(N, idx, istride, count, P, bad))
        return 1;
    for (int64_t p = 0; p < P; p++) {
        const int32_t *ix = idx + p * istride;
        const uint8_t *sb = signs + p * sstride;
        float pos = scale[p], neg = -scale[p];
        int64_t c = count[p];
        for (int64_t j = 0; j < c; j++)
            dense[ix[j]] += ((sb[j >> 3] >> (j & 7)) & 1) ? neg : pos;
    }
    return 0;
}

/* 0 when every index is in range (then all rows are added), else 1 with the first bad
 * (row, slot) in bad[0], bad[1] and nothing written. */
int64_t hvd_scatter_add_f32(float *dense, int64_t N, const int32_t *idx, int64_t istride,
                            const float *val, int64_t vstride, const int64_t *count,
                            int64_t P, int64_t *bad)
{
    if (check_rows(N, idx, istride, count, P, bad))
        return 1;
    for (int64_t p = 0; p < P; p++) {
        const int32_t *ix = idx + p * istride;
        const float *v = val + p * vstride;
        int64_t c = count[p];
        for (int64_t j = 0; j < c; j++)
            dense[ix[j]] += v[j];
    }
    return 0;
}

/* Bin-relative slot indices (AdaComp's BIN_U8 / BIN_U16 segments) to layer indices, row
 * by row: slot j lies in bin b(j) = #{b : clamp(cum[b], 0, C) <= j}, cum the inclusive
 * prefix sum of the row's bin counts, and idx = b(j) * B + rel[j], or N where rel >= B or
 * the index reaches N -- hvdsparse/codec.py:_slot_indices's histogram rule, exactly.
 * rel: uint8 (rbytes 1) or little-endian uint16 (rbytes 2) rows, rstride bytes apart;
 * bc: int32 rows, bstride elements apart; hist: int64 scratch of C + 1; out: int32 [P][C]. */
void hvd_bin_slot_indices(const uint8_t *rel, int64_t rstride, int64_t rbytes,
                          const int32_t *bc, int64_t bstride, int64_t nb, int64_t P,
                          int64_t C, int64_t B, int64_t N, int64_t *hist, int32_t *out)
{
    for (int64_t p = 0; p < P; p++) {
        for (int64_t x = 0; x <= C; x++)
            hist[x] = 0;
        const int32_t *bp = bc + p * bstride;
        int64_t cum = 0;
        for (int64_t b = 0; b < nb; b++) {
            cum += bp[b];
            int64_t x = cum < 0 ? 0 : (cum > C ? C : cum);
            hist[x]++;
        }
        const uint8_t *rp = rel + p * rstride;
        int32_t *op = out + p * C;
        int64_t bj = 0;
        for (int64_t j = 0; j < C; j++) {
            bj += hist[j];
            int64_t r = rbytes == 1 ? (int64_t)rp[j]
                                    : (int64_t)rp[2 * j] | ((int64_t)rp[2 * j + 1] << 8);
            int64_t a = bj * B + r;
            op[j] = (int32_t)((r >= B || a >= N) ? N : a);
        }
    }
}
