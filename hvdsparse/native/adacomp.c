/* AdaComp's accumulate + bin selection on the CPU in one pass: the compiled form of
 * hvdsparse/cpu.py's residual_add_binmax followed by binned_select (AdaComp._compress,
 * the CPU branch), the same bits.
 *
 * Per bin b of L consecutive elements (the last one partial), every element i:
 *   d = grad[i] * s                 (s: AMP inverse scale, or no multiply)
 *   fin = |d| < inf; nonfinite += !fin
 *   G[i] = fin ? G[i] + d : G[i]    (the residual, in place)
 * then gmax[b] = max |G| over the bin (NaN if the bin holds a NaN, as torch.amax), and
 * with d0 = fin ? d : 0 and h = G + hm1 * d0 (hm1 = fp32(scale - 1); two roundings):
 *   candidates: |h| >= max(gmax[b], tiny)         (NaN compares false)
 *   selected += #candidates; the bin keeps its c largest |h| (ties: lower index first)
 * Kept slots are packed bin after bin, largest |h| first inside a bin: gidx (layer
 * index), rel (index - b * L), bin_counts[b]; returns the number of kept slots. The
 * bin (at most 65536 elements) is read twice while it is in cache: the layer once.
 *
 * With DGC's momentum correction (u != NULL; LocalUpdate.corrected's rule, as in
 * bucket_topk.c's MOMENTUM_BODY) the velocity update comes first, in the same pass:
 *   gg = fin ? d : 0;  gg = gg + wd * p[i] (wd != 0);  u[i] = u[i] * m + cd * gg
 *   x = u[i]  (Nesterov: gg + m * u[i]);  nonfinite += !fin + !(|x| < inf)
 * and x takes the gradient's place above (G += x where finite; h from x, unscaled):
 * the bits of LocalUpdate.corrected followed by the plain call on x.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dgc.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT_ADA __attribute__((target_clones("avx2", "default")))
#else
#define HOT_ADA
#endif

/* accumulate one bin; returns its non-finite count, *mx = max |G| (NaN-propagating) */
HOT_ADA static int64_t acc_bin(const float *restrict g, float *restrict r, int64_t m,
                               int has_scale, float s, float *mx)
{
    int64_t bad = 0;
    /* max |G| on the bit patterns: for x >= 0 they grow with the value, and every NaN's
     * (sign cleared by fabsf) lies above +Inf's, so an unsigned max vectorises and still
     * sees a NaN (a float max with NaN rules would not vectorise without -ffast-math) */
    uint32_t best = 0;
    for (int64_t i = 0; i < m; i++) {
        float d = has_scale ? g[i] * s : g[i];
        int fin = fabsf(d) < INFINITY;
        bad += !fin;
        float a = r[i];
        a = fin ? a + d : a;
        r[i] = a;
        float x = fabsf(a);
        uint32_t xb;
        memcpy(&xb, &x, sizeof xb);
        best = xb > best ? xb : best;
    }
    if (best > 0x7f800000u) {
        *mx = NAN;
    } else {
        float f;
        memcpy(&f, &best, sizeof f);
        *mx = f;
    }
    return bad;
}

/* one element of the velocity update (the header's rule, dgc.h); x into xs[i] */
#define MC_BODY(WDTERM, NESTEROV)                                                      \
    {                                                                                  \
        DGC_VELOCITY(has_scale ? g[i] * s : g[i], WDTERM, NESTEROV, u, mom, cd, bad)   \
        float a = r[i];                                                                \
        a = fin2 ? a + x : a;                                                          \
        r[i] = a;                                                                      \
        xs[i] = x;                                                                     \
        float ax = fabsf(a);                                                           \
        uint32_t xb;                                                                   \
        memcpy(&xb, &ax, sizeof xb);                                                   \
        best = xb > best ? xb : best;                                                  \
    }

/* acc_bin with the velocity update first; x of every element into xs */
HOT_ADA static int64_t acc_bin_mc(const float *restrict g, float *restrict r,
                                  float *restrict u, const float *restrict p, int64_t m,
                                  int has_scale, float s, float mom, float cd, float wd,
                                  int nesterov, float *restrict xs, float *mx)
{
    int64_t bad = 0;
    uint32_t best = 0;
    /* four straight loops (weight decay or not, Nesterov or not) that gcc vectorises */
    if (p) {
        if (nesterov)
            for (int64_t i = 0; i < m; i++)
                MC_BODY(gg + wd * p[i], 1)
        else
            for (int64_t i = 0; i < m; i++)
                MC_BODY(gg + wd * p[i], 0)
    } else {
        if (nesterov)
            for (int64_t i = 0; i < m; i++)
                MC_BODY(gg, 1)
        else
            for (int64_t i = 0; i < m; i++)
                MC_BODY(gg, 0)
    }
    if (best > 0x7f800000u) {
        *mx = NAN;
    } else {
        float f;
        memcpy(&f, &best, sizeof f);
        *mx = f;
    }
    return bad;
}

/* |h| of one element (the module docstring's rule) */
static inline float h_abs(float G, float g, int has_scale, float s, float hm1)
{
    float d = has_scale ? g * s : g;
    float d0 = fabsf(d) < INFINITY ? d : 0.0f;
    return fabsf(G + hm1 * d0);
}

/* |h| of 32 elements into hv, and the mask of those with |h| >= t (bit q: element q;
 * NaN compares false). Vectorised: at AdaComp's rates most blocks of 32 hold no
 * candidate and cost only this. */
HOT_ADA static uint32_t hits32(const float *restrict G, const float *restrict g,
                               int has_scale, float s, float hm1, float t,
                               float *restrict hv)
{
    if (has_scale) {
        for (int q = 0; q < 32; q++)
            hv[q] = h_abs(G[q], g[q], 1, s, hm1);
    } else {
        for (int q = 0; q < 32; q++)
            hv[q] = h_abs(G[q], g[q], 0, s, hm1);
    }
    uint32_t bits = 0;
    for (int q = 0; q < 32; q++)
        bits |= (uint32_t)(hv[q] >= t) << q;
    return bits;
}

/* keep (h, i) among the bin's c largest |h| (kv descending; ties: the lower index, which
 * arrives first, stays first) */
static inline void keep_top(float *kv, int64_t *ki, int64_t *k, int64_t c, float h, int64_t i)
{
    int64_t p = *k < c ? *k : c;
    while (p > 0 && kv[p - 1] < h)
        p--;
    if (p >= c)
        return;
    int64_t e = *k < c ? *k : c - 1;
    for (int64_t q = e; q > p; q--) {
        kv[q] = kv[q - 1];
        ki[q] = ki[q - 1];
    }
    kv[p] = h;
    ki[p] = i;
    if (*k < c)
        (*k)++;
}

/* u (the velocity) NULL: plain; else the momentum-corrected form (p NULL: no weight
 * decay). Returns the number of kept slots, or -1 when out of memory (nothing written
 * then). */
int64_t hvd_adacomp_select(const float *grad, float *G, int64_t n, int64_t L, int64_t c,
                           const float *scale, float hm1, float tiny, float *gmax,
                           int64_t *gidx, int64_t *rel, int32_t *bin_counts,
                           int64_t *selected, int32_t *nonfinite, float *u,
                           const float *p, float mom, float cd, float wd, int nesterov)
{
    int has_scale = scale != 0;
    float s = has_scale ? *scale : 1.0f;
    int64_t nb = (n + L - 1) / L, count = 0, sel = 0, bad = 0;
    float kv[256];                 /* the bin's kept |h|, descending (c <= 256 here) */
    int64_t ki[256];
    float *xs = 0;                 /* momentum: the bin's x, read by the selection */
    if (u) {
        xs = malloc((size_t)L * sizeof(float));
        if (!xs)
            return -1;
    }
    for (int64_t b = 0; b < nb; b++) {
        int64_t st = b * L, m = n - st < L ? n - st : L;
        float mx;
        if (u) {
            bad += acc_bin_mc(grad + st, G + st, u + st, p ? p + st : 0, m, has_scale, s,
                              mom, cd, wd, nesterov, xs, &mx);
        } else {
            bad += acc_bin(grad + st, G + st, m, has_scale, s, &mx);
        }
        /* the selection reads x (unscaled, already the velocity) or the gradient */
        const float *hg = u ? xs : grad + st;
        const int hs = u ? 0 : has_scale;
        gmax[b] = mx;
        float t = fmaxf(mx, tiny);              /* clamp_min(TINY); NaN stays NaN */
        if (mx != mx)
            t = NAN;
        int64_t k = 0, i = 0;
        float hv[32];
        for (; i + 32 <= m; i += 32) {
            uint32_t bits = hits32(G + st + i, hg + i, hs, s, hm1, t, hv);
            while (bits) {
                int q = __builtin_ctz(bits);
                bits &= bits - 1;
                sel++;
                keep_top(kv, ki, &k, c, hv[q], i + q);
            }
        }
        for (; i < m; i++) {
            float h = h_abs(G[st + i], hg[i], hs, s, hm1);
            if (h >= t) {
                sel++;
                keep_top(kv, ki, &k, c, h, i);
            }
        }
        for (int64_t q = 0; q < k; q++) {
            gidx[count + q] = st + ki[q];
            rel[count + q] = ki[q];
        }
        bin_counts[b] = (int32_t)k;
        count += k;
    }
    free(xs);
    *selected = sel;
    if (bad)
        *nonfinite += (int32_t)bad;
    return count;
}
