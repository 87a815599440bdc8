/* TopK over a whole fusion bucket on the CPU: the compiled twin of kernels/bucket_topk.py.
 *
 * The layers of a bucket are the rows of one int64 segment table tab[L][W] built by
 * hvdsparse/compressors/topk_bucket.py (tensor addresses, host integers, fp32 scalars as
 * their bit patterns); its column order is COLUMNS below, which hvd_layout() hands to
 * the Python loader (hvdsparse/native/__init__.py), so the two cannot disagree.
 *
 * Per bucket and step, the same math as the Triton kernels and the per-layer path, bit
 * for bit (every product and sum its own fp32 rounding: built with -ffp-contract=off,
 * never -ffast-math; NaN never compares true):
 *
 *   hvd_accumulate   d = grad * s (s: AMP scale, optional); fin = |d| < inf, counted;
 *                    momentum rows: g = fin ? d : +0; g = g + wd * param (if wd);
 *                                   u = u * m; u = u + c * g; x = nesterov ? g + m * u : u;
 *                                   fin2 = |x| < inf, counted; r = fin2 ? r + x : r
 *                    plain rows:    r = fin ? r + d : r
 *   hvd_sample       S[j][i] = |r_j[off_j + stride_j * i]| for i < s_j, -1 after
 *   hvd_top_m        V[j] = the mmax largest of S[j], descending (torch.topk's values)
 *   hvd_select       per row: the refinement rounds (kernels/refine.py's rule; a round
 *                    whose threshold did not move reuses the count) -- or, on
 *                    ROUTE_GIVEN (Threshold between refreshes), t = *C_TIN * f (f: the
 *                    fp32 factor in C_TGT, one rounding) --, then the selection
 *                    |r| >= max(t, tiny) in ascending index order into the row's slots
 *                    [out, out + cap), the residual of a sent element set to +0 (fp32
 *                    values), cnt[j] = {min(selected, cap), selected}, tau[j] = t.
 *                    Every counting pass also collects the first cap indices it finds,
 *                    so when the final threshold is the last counted one (the usual
 *                    case: the sampled estimate is in range) the layer is read once.
 *                    MODE_GUARD rows (Threshold's overflow guard, threshold.py): when
 *                    more than cap pass t, the selection uses the overflow ladder's
 *                    rung, selected = the count at t. The count at t collects up
 *                    to max(cap, min(n, hits_x cap)) hits, so an overflow within that finds its rung and
 *                    selection among them (ladder_pick_hits, collect_hits); a larger
 *                    one reads the layer twice more (ladder_pick, count_collect); ratio =
 *                    selected / cap (fp32),
 *                    *C_TOUT = ratio > 1 ? t * min(sqrt(ratio), 2) : t.
 *   hvd_mask         momentum rows: u[idx[out + i]] = 0 for i < cnt[j][0], 0 <= idx < n
 *
 * Only fp32 gradients, parameters and values: the loader's caller (topk_bucket.layer_plan)
 * sends every other layer through the per-layer path. Single-threaded: the caller runs
 * one rank per core; the loops are written so that gcc vectorises them (target_clones
 * builds an AVX2 copy next to the baseline one, chosen at load time by the CPU).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dgc.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define COLUMNS(X) X(C_G) X(C_R) X(C_U) X(C_P) X(C_N) X(C_MODE) X(C_M) X(C_C) X(C_WD) \
    X(C_NF) X(C_RK) X(C_RCAP) X(C_CAP) X(C_STRIDE) X(C_OFF) X(C_S) X(C_R0) X(C_MLEN) \
    X(C_OUT) X(C_BLK0) X(C_EXACT) X(C_TGT) X(C_TIN) X(C_TOUT) X(C_W)
#define AS_ENUM(c) c,
#define AS_NAME(c) #c " "
enum { COLUMNS(AS_ENUM) W };
/* C_W, MODE_SCORE and MODE_TIES (fresh_weight's score rows) are the Triton path's only: the
 * CPU never plans such a row; they keep the two layouts one */
enum { MODE_MOMENTUM = 1, MODE_NESTEROV = 2, MODE_WD = 4, MODE_GUARD = 8, MODE_SCORE = 16,
       MODE_TIES = 32 };
enum { ROUTE_SAMPLED = 0, ROUTE_EXACT = 1, ROUTE_GIVEN = 2 };   /* column C_EXACT */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

/* "C_G C_R ... C_TOUT |MODE_MOMENTUM=1 ... ROUTE_GIVEN=2": the table layout */
const char *hvd_layout(void)
{
    return COLUMNS(AS_NAME) "|MODE_MOMENTUM=1 MODE_NESTEROV=2 MODE_WD=4 MODE_GUARD=8 "
                            "MODE_SCORE=16 MODE_TIES=32 ROUTE_SAMPLED=0 ROUTE_EXACT=1 ROUTE_GIVEN=2";
}

static inline float cell_f32(const int64_t *row, int col)
{
    int32_t b = (int32_t)row[col];
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline void *cell_ptr(const int64_t *row, int col)
{
    return (void *)(intptr_t)row[col];
}

/* ---------------------------------------------------------------- accumulate */

HOT static int64_t acc_plain(const float *restrict g, float *restrict r, int64_t n,
                             int has_scale, float s)
{
    int64_t bad = 0;
    if (has_scale) {
        for (int64_t i = 0; i < n; i++) {
            float d = g[i] * s;
            int fin = fabsf(d) < INFINITY;
            bad += !fin;
            float a = r[i];
            r[i] = fin ? a + d : a;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float d = g[i];
            int fin = fabsf(d) < INFINITY;
            bad += !fin;
            float a = r[i];
            r[i] = fin ? a + d : a;
        }
    }
    return bad;
}

/* one element of a momentum row (the module docstring's rule, dgc.h) */
#define MOMENTUM_BODY(D, WDTERM, NESTEROV)                                            \
    {                                                                                  \
        DGC_VELOCITY(D, WDTERM, NESTEROV, u, m, c, bad)                                \
        float a = r[i];                                                                \
        r[i] = fin2 ? a + x : a;                                                       \
    }

HOT static int64_t acc_momentum(const float *restrict g, float *restrict r,
                                float *restrict u, const float *restrict p, int64_t n,
                                int has_scale, float s, float m, float c, float wd,
                                int nesterov)
{
    int64_t bad = 0;
    /* the four variants as separate loops, each a straight vectorisable body */
    if (p != 0) {
        if (nesterov)
            for (int64_t i = 0; i < n; i++)
                MOMENTUM_BODY(has_scale ? g[i] * s : g[i], gg + wd * p[i], 1)
        else
            for (int64_t i = 0; i < n; i++)
                MOMENTUM_BODY(has_scale ? g[i] * s : g[i], gg + wd * p[i], 0)
    } else {
        if (nesterov)
            for (int64_t i = 0; i < n; i++)
                MOMENTUM_BODY(has_scale ? g[i] * s : g[i], gg, 1)
        else
            for (int64_t i = 0; i < n; i++)
                MOMENTUM_BODY(has_scale ? g[i] * s : g[i], gg, 0)
    }
    return bad;
}

/* Every row: the fused residual add (and velocity update); non-finite counts are
 * added into the row's int32 counter. scale: the AMP inverse scale or NULL. */
void hvd_accumulate(const int64_t *tab, int64_t L, const float *scale)
{
    int has_scale = scale != 0;
    float s = has_scale ? *scale : 1.0f;
    for (int64_t j = 0; j < L; j++) {
        const int64_t *row = tab + j * W;
        const float *g = cell_ptr(row, C_G);
        float *r = cell_ptr(row, C_R);
        int64_t n = row[C_N];
        int64_t mode = row[C_MODE];
        int64_t bad;
        if (mode & MODE_MOMENTUM) {
            const float *p = (mode & MODE_WD) ? cell_ptr(row, C_P) : 0;
            bad = acc_momentum(g, r, cell_ptr(row, C_U), p, n, has_scale, s,
                               cell_f32(row, C_M), cell_f32(row, C_C),
                               (mode & MODE_WD) ? cell_f32(row, C_WD) : 0.0f,
                               (mode & MODE_NESTEROV) != 0);
        } else {
            bad = acc_plain(g, r, n, has_scale, s);
        }
        if (bad) {
            int32_t *nf = cell_ptr(row, C_NF);
            *nf += (int32_t)bad;
        }
    }
}

/* ---------------------------------------------------------------- sample */

void hvd_sample(const int64_t *tab, int64_t L, float *S, int64_t smax)
{
    for (int64_t j = 0; j < L; j++) {
        const int64_t *row = tab + j * W;
        const float *r = cell_ptr(row, C_R);
        int64_t s = row[C_S], off = row[C_OFF], stride = row[C_STRIDE];
        float *out = S + j * smax;
        int64_t i = 0;
        for (; i < s && i < smax; i++)
            out[i] = fabsf(r[off + i * stride]);
        for (; i < smax; i++)
            out[i] = -1.0f;
    }
}

/* ---------------------------------------------------------------- top m of the sample */

/* The order key of a sample value: -1 padding (any negative) -> 0, a non-negative fp32
 * -> its bits + 1 (the bits of a non-negative float grow with its value; a NaN, whose
 * bits lie above +inf's, is the largest, as in torch.topk). */
static inline uint32_t top_key(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (b >> 31) ? 0u : b + 1u;
}

/* keys[0..o) sorted descending, LSD radix over 4 bytes (tmp: uint32[o]) */
static void sort_desc_u32(uint32_t *keys, uint32_t *tmp, int64_t o)
{
    uint32_t *src = keys, *dst = tmp;
    for (int sh = 0; sh < 32; sh += 8) {
        int64_t pos[257] = {0};
        for (int64_t i = 0; i < o; i++)
            pos[255 - ((src[i] >> sh) & 255u) + 1]++;      /* descending digit order */
        for (int d = 0; d < 256; d++)
            pos[d + 1] += pos[d];
        for (int64_t i = 0; i < o; i++)
            dst[pos[255 - ((src[i] >> sh) & 255u)]++] = src[i];
        uint32_t *t = src;
        src = dst;
        dst = t;
    }
    /* four passes: the result is back in keys */
}

/* V[0..m) = the m largest values of S[0..n), sorted descending: the values
 * torch.topk(S, m, dim=1, sorted=True) returns (equal values have equal bits: the
 * sample holds fabsf() magnitudes, +0 only, and -1 padding). A radix select on the
 * order keys: one pass keys and histograms the top 11 bits, which fixes the bin of the
 * m-th largest; the keys above it are taken, the keys in it are refined by 11 and then
 * 10 more bits into the m-th largest key K and how many keys equal to K are taken; a
 * radix sort orders the m. O(n + m) whatever the data (many equal magnitudes included),
 * where torch.topk of a [2, 20480] sample cost ~1.3 ms here. keys: uint32[2 n]. */
static void top_m_row(const float *S, int64_t n, int64_t m, float *V, uint32_t *keys)
{
    uint32_t hist[2048];
    uint32_t *cand = keys + n;          /* the keys of the boundary bin */
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++) {
        uint32_t k = top_key(S[i]);
        keys[i] = k;
        hist[k >> 21]++;
    }
    int64_t need = m, b = 2047;
    while (b > 0 && (int64_t)hist[b] < need)
        need -= hist[b--];
    /* take every key of a higher bin (compacted to the front of keys, o <= i), and
     * move the boundary bin's keys to cand */
    int64_t o = 0, nc = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t k = keys[i], top = k >> 21;
        if (top > (uint32_t)b)
            keys[o++] = k;
        else if (top == (uint32_t)b)
            cand[nc++] = k;
    }
    uint32_t prefix = (uint32_t)b << 21;
    static const int shift[2] = {10, 0};
    static const uint32_t width[2] = {2048, 1024};
    uint32_t pmask = 0xFFE00000u;
    for (int p = 0; p < 2; p++) {
        uint32_t w = width[p];
        memset(hist, 0, sizeof hist);
        for (int64_t i = 0; i < nc; i++)
            if ((cand[i] & pmask) == prefix)
                hist[(cand[i] >> shift[p]) & (w - 1)]++;
        int64_t d = (int64_t)w - 1;
        while (d > 0 && (int64_t)hist[d] < need)
            need -= hist[d--];
        prefix |= (uint32_t)d << shift[p];
        pmask |= (w - 1) << shift[p];
    }
    /* prefix = K: the boundary bin's keys > K, then the first `need` keys == K */
    for (int64_t i = 0; i < nc; i++) {
        uint32_t k = cand[i];
        if (k > prefix || (k == prefix && need > 0)) {
            need -= k == prefix;
            keys[o++] = k;
        }
    }
    sort_desc_u32(keys, cand, o);       /* o == m; cand is free again */
    for (int64_t q = 0; q < o; q++) {
        uint32_t k = keys[q];
        if (k == 0) {
            V[q] = -1.0f;
        } else {
            uint32_t bits = k - 1u;
            memcpy(&V[q], &bits, sizeof bits);
        }
    }
}

/* Every row of S [L][n] (n = smax, m <= n); scratch: uint32[2 n]. */
void hvd_top_m(const float *S, int64_t L, int64_t n, int64_t m, float *V, uint32_t *scratch)
{
    for (int64_t j = 0; j < L; j++)
        top_m_row(S + j * n, n, m, V + j * m, scratch);
}

/* ---------------------------------------------------------------- threshold + select */

/* kernels/refine.py's rule: t after `rounds` rounds of counts */
static float replay(const float *v, const int32_t *counts, int64_t r0, float mf, float kf,
                    float capf, float target, int rounds)
{
    float r = (float)r0;
    float t = v[r0 - 1];
    for (int j = 0; j < rounds; j++) {
        float c = (float)counts[j];
        int ok = (c >= kf) & (c <= capf);
        float x = (r * target) / fmaxf(c, 1.0f);
        x = fminf(x, 4194304.0f);
        float f = rintf(x);                    /* round half to even (default mode) */
        float rn = fminf(fmaxf(f, 1.0f), mf);
        float tn = v[(int64_t)rn - 1];
        if (!ok) {
            t = tn;
            r = rn;
        }
    }
    return t;
}

/* Bit q of the result: |a[q]| >= t, q in [0, 32) (ordered >=: false for NaN, as
 * fabsf(x) >= t). SSE2 (every x86-64): a compare mask per 4 elements. */
static inline uint32_t mask32(const float *a, float t)
{
#if defined(__SSE2__)
    const __m128 tv = _mm_set1_ps(t);
    const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    uint32_t bits = 0;
    for (int q = 0; q < 32; q += 4) {
        __m128 x = _mm_and_ps(_mm_loadu_ps(a + q), absmask);
        bits |= (uint32_t)_mm_movemask_ps(_mm_cmpge_ps(x, tv)) << q;
    }
    return bits;
#else
    uint32_t bits = 0;
    for (int q = 0; q < 32; q++)
        bits |= (uint32_t)(fabsf(a[q]) >= t) << q;
    return bits;
#endif
}

/* #{|a_i| >= t}, the first `cap` such i written to idx in ascending order (and, with
 * mag, |a_i| to mag at the same slot), 32 elements at a time: a block without hits
 * costs its compare mask (at TopK densities most blocks have none); a block with hits
 * writes each hit's index straight into idx while 32 slots are free (a store per hit,
 * no staging copy), one by one near the end. Inlined into count_collect (mag NULL: the
 * stores compiled out) and count_collect_mag. */
static inline int64_t count_collect_impl(const float *restrict a, int64_t n, float t,
                                         int32_t *restrict idx, float *restrict mag,
                                         int64_t cap)
{
    int64_t c = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        uint32_t bits = mask32(a + i, t);
        if (!bits)
            continue;
        if (c + 32 <= cap) {
            int32_t *o = idx + c;
            float *m = mag ? mag + c : NULL;
            c += __builtin_popcount(bits);
            while (bits) {
                int32_t k = (int32_t)i + __builtin_ctz(bits);
                *o++ = k;
                if (mag)
                    *m++ = fabsf(a[k]);
                bits &= bits - 1;
            }
        } else {
            while (bits) {
                int32_t k = (int32_t)i + __builtin_ctz(bits);
                if (c < cap) {
                    idx[c] = k;
                    if (mag)
                        mag[c] = fabsf(a[k]);
                }
                c++;
                bits &= bits - 1;
            }
        }
    }
    for (; i < n; i++) {
        if (fabsf(a[i]) >= t) {
            if (c < cap) {
                idx[c] = (int32_t)i;
                if (mag)
                    mag[c] = fabsf(a[i]);
            }
            c++;
        }
    }
    return c;
}

HOT static int64_t count_collect(const float *restrict a, int64_t n, float t,
                                 int32_t *restrict idx, int64_t cap)
{
    return count_collect_impl(a, n, t, idx, NULL, cap);
}

HOT static int64_t count_collect_mag(const float *restrict a, int64_t n, float t,
                                     int32_t *restrict idx, float *restrict mag, int64_t cap)
{
    return count_collect_impl(a, n, t, idx, mag, cap);
}

/* How many of the rungs tq[0 .. J-1] (ascending; padded to 32 with +inf) x reaches,
 * given x >= tq[0]: one compare per rung and a popcount, no data-dependent branch
 * (the hits cluster just above t, where a walk up the rungs mispredicts). */
static inline int64_t rungs_reached(float x, const float *tq, int64_t J)
{
    uint32_t bits = 0;
#if defined(__SSE2__)
    const __m128 xv = _mm_set1_ps(x);
    for (int q = 0; q < 32; q += 4)
        bits |= (uint32_t)_mm_movemask_ps(_mm_cmpge_ps(xv, _mm_loadu_ps(tq + q))) << q;
#else
    for (int q = 0; q < 32; q++)
        bits |= (uint32_t)(x >= tq[q]) << q;
#endif
    int64_t c = __builtin_popcount(bits);
    return c < J ? c : J;                     /* x = +inf reaches the padding too */
}

/* The lowest of the J rungs tq[0 .. J-1] whose count fits in cap, from hist[q] =
 * #{elements reaching exactly q rungs} (hist[0] unused): c_q = #{reached > q}. */
static float rung_that_fits(const int64_t *hist, const float *tq, int64_t J, int64_t cap)
{
    int64_t above = 0, r = 0;
    for (int64_t q = J - 1; q >= 0; q--) {
        above += hist[q + 1];
        if (above > cap)
            r++;
    }
    if (r > J - 1)
        r = J - 1;
    return tq[r];
}

/* Threshold's overflow ladder (threshold.py), called once more than cap passed t: the
 * lowest of the J rungs tq[q] = t * ladder[q] (ascending, ladder[0] = 1) whose count
 * fits in cap. Two ways to the same rung:
 *   ladder_pick       reads the layer: the histogram skips elements below t (almost
 *                     all of them) 32 at a time (mask32);
 *   ladder_pick_hits  reads only the hits of the count at t (their indices in hits[],
 *                     ascending), when the collection kept them all (scratch). */
#define LADDER_MAX 32
static void ladder_rungs(float t, const float *ladder, int64_t J, float *tq, int64_t *hist)
{
    for (int64_t q = 0; q < LADDER_MAX; q++)
        tq[q] = q < J ? t * ladder[q] : INFINITY;
    for (int64_t q = 0; q <= LADDER_MAX; q++)
        hist[q] = 0;
}

HOT static float ladder_pick(const float *restrict a, int64_t n, float t,
                             const float *ladder, int64_t J, int64_t cap)
{
    float tq[LADDER_MAX];
    int64_t hist[LADDER_MAX + 1];
    ladder_rungs(t, ladder, J, tq, hist);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {             /* 32 at a time: most blocks have no hit */
        for (uint32_t bits = mask32(a + i, tq[0]); bits; bits &= bits - 1)
            hist[rungs_reached(fabsf(a[i + __builtin_ctz(bits)]), tq, J)]++;
    }
    for (; i < n; i++) {
        float x = fabsf(a[i]);
        if (x >= tq[0])
            hist[rungs_reached(x, tq, J)]++;
    }
    return rung_that_fits(hist, tq, J, cap);
}

static float ladder_pick_hits(const float *mag, int64_t h, float t, const float *ladder,
                              int64_t J, int64_t cap)
{
    float tq[LADDER_MAX];
    int64_t hist[LADDER_MAX + 1];
    ladder_rungs(t, ladder, J, tq, hist);
    for (int64_t q = 0; q < h; q++)             /* every hit reaches tq[0] = t */
        hist[rungs_reached(mag[q], tq, J)]++;
    return rung_that_fits(hist, tq, J, cap);
}

/* The hits (indices ascending, magnitudes mag) that reach ts >= t, the first cap of
 * them into idx; returns their count: count_collect(a, n, ts, idx, cap) without
 * reading the layer again. */
static int64_t collect_hits(const int32_t *hits, const float *mag, int64_t h, float ts,
                            int32_t *restrict idx, int64_t cap)
{
    int64_t c = 0;
    int32_t spill;                              /* where a hit past cap is written */
    for (int64_t q = 0; q < h; q++) {           /* branch-free: most hits are near ts */
        *(c < cap ? idx + c : &spill) = hits[q];
        c += mag[q] >= ts;
    }
    return c;
}

/* Per row: refinement rounds, threshold, selection (see the module docstring).
 * V: [L][mmax] sorted sample magnitudes; counts: int32 [L][R] (zeroed by the caller);
 * idx / vals: the bucket's slots; cnt: int32 [L][2]; tau: fp32 [L]; ladder: Threshold's
 * J rung factors (MODE_GUARD rows; ladder[0] = 1); scratch: room for a MODE_GUARD row's
 * hits at t and their magnitudes, 2 max(cap, min(n, hits_x * cap)) int32 (hits_x <= 1:
 * no overflow is taken from the hits, the ladder reads the layer). */
void hvd_select(const int64_t *tab, int64_t L, const float *V, int64_t mmax,
                int32_t *counts, int64_t R, int64_t rounds, float *tau, int32_t *idx,
                float *vals, int32_t *cnt, float tiny, const float *ladder, int64_t J,
                int32_t *scratch, int64_t hits_x)
{
    for (int64_t j = 0; j < L; j++) {
        const int64_t *row = tab + j * W;
        float *r = cell_ptr(row, C_R);
        int64_t n = row[C_N], cap = row[C_CAP], out = row[C_OUT];
        const float *v = V + j * mmax;
        int32_t *cn = counts + j * R;
        int64_t r0 = row[C_R0];
        float kf = (float)row[C_RK], capf = (float)row[C_RCAP], mf = (float)row[C_MLEN];
        float target = cell_f32(row, C_TGT);
        int32_t *slots = idx + out;
        int have = 0;             /* slots hold the collection at threshold `held` */
        float held = 0.0f;
        int64_t held_count = 0;
        int64_t route = row[C_EXACT];
        if (route == ROUTE_SAMPLED) {
            for (int64_t q = 0; q < rounds; q++) {
                float t = replay(v, cn, r0, mf, kf, capf, target, (int)q);
                if (have && t == held) {
                    cn[q] = (int32_t)held_count;     /* same threshold, same count */
                    continue;
                }
                held_count = count_collect(r, n, t, slots, cap);
                held = t;
                have = 1;
                cn[q] = (int32_t)held_count;
            }
        }
        float t = route == ROUTE_GIVEN ? *(const float *)cell_ptr(row, C_TIN) * target
                                       : replay(v, cn, r0, mf, kf, capf, target, (int)rounds);
        t = fmaxf(t, tiny);
        tau[j] = t;
        int64_t guard = route == ROUTE_GIVEN && (row[C_MODE] & MODE_GUARD);
        int64_t at_tau;                          /* selected: the count at tau */
        if (guard) {
            /* the count at t keeps up to `room` (>= cap) hits and their magnitudes in
             * the scratch: a step that fits copies them to the slots, an overflow up
             * to `room` finds its rung and selection among them (the layer is read
             * once), a larger one reads the layer twice more */
            int64_t room = n < hits_x * cap ? n : hits_x * cap;
            if (room < cap)
                room = cap;
            float *mag = (float *)(scratch + room);
            at_tau = count_collect_mag(r, n, t, scratch, mag, room);
            if (at_tau <= cap) {
                memcpy(slots, scratch, (size_t)at_tau * sizeof(int32_t));
                held_count = at_tau;
            } else if (at_tau <= room) {
                float ts = ladder_pick_hits(mag, at_tau, t, ladder, J, cap);
                held_count = collect_hits(scratch, mag, at_tau, ts, slots, cap);
            } else {
                float ts = ladder_pick(r, n, t, ladder, J, cap);
                held_count = count_collect(r, n, ts, slots, cap);
            }
        } else {
            if (!(have && t == held))
                held_count = count_collect(r, n, t, slots, cap);
            at_tau = held_count;
        }
        int64_t sent = held_count < cap ? held_count : cap;
        if (guard)
            held_count = at_tau;
        float *vo = vals + out;
        for (int64_t q = 0; q < sent; q++) {
            int64_t i = slots[q];
            vo[q] = r[i];
            r[i] = 0.0f;
        }
        cnt[2 * j] = (int32_t)sent;
        cnt[2 * j + 1] = (int32_t)held_count;
        if (row[C_MODE] & MODE_GUARD) {
            /* Threshold's overflow guard: the next step's tau, into a new tensor */
            float ratio = (float)held_count / (float)cap;
            float up = fminf(sqrtf(ratio), 2.0f);
            *(float *)cell_ptr(row, C_TOUT) = ratio > 1.0f ? t * up : t;
        }
    }
}

/* ---------------------------------------------------------------- mask */

void hvd_mask(const int64_t *tab, int64_t L, const int32_t *idx, const int32_t *cnt)
{
    for (int64_t j = 0; j < L; j++) {
        const int64_t *row = tab + j * W;
        if (!(row[C_MODE] & MODE_MOMENTUM))
            continue;
        float *u = cell_ptr(row, C_U);
        int64_t n = row[C_N], c = cnt[2 * j];
        const int32_t *slots = idx + row[C_OUT];
        for (int64_t q = 0; q < c; q++) {
            int64_t i = slots[q];
            if (i >= 0 && i < n)
                u[i] = 0.0f;
        }
    }
}
