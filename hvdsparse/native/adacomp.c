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
 */
#include <math.h>
#include <stdint.h>

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
    float best = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < m; i++) {
        float d = has_scale ? g[i] * s : g[i];
        int fin = fabsf(d) < INFINITY;
        bad += !fin;
        float a = r[i];
        a = fin ? a + d : a;
        r[i] = a;
        float x = fabsf(a);
        nan |= x != x;
        best = x > best ? x : best;
    }
    *mx = nan ? NAN : best;
    return bad;
}

int64_t hvd_adacomp_select(const float *grad, float *G, int64_t n, int64_t L, int64_t c,
                           const float *scale, float hm1, float tiny, float *gmax,
                           int64_t *gidx, int64_t *rel, int32_t *bin_counts,
                           int64_t *selected, int32_t *nonfinite)
{
    int has_scale = scale != 0;
    float s = has_scale ? *scale : 1.0f;
    int64_t nb = (n + L - 1) / L, count = 0, sel = 0, bad = 0;
    float kv[256];                 /* the bin's kept |h|, descending (c <= 256 here) */
    int64_t ki[256];
    for (int64_t b = 0; b < nb; b++) {
        int64_t st = b * L, m = n - st < L ? n - st : L;
        float mx;
        bad += acc_bin(grad + st, G + st, m, has_scale, s, &mx);
        gmax[b] = mx;
        float t = fmaxf(mx, tiny);              /* clamp_min(TINY); NaN stays NaN */
        if (mx != mx)
            t = NAN;
        int64_t k = 0;
        for (int64_t i = 0; i < m; i++) {
            float d = has_scale ? grad[st + i] * s : grad[st + i];
            float d0 = fabsf(d) < INFINITY ? d : 0.0f;
            float h = fabsf(G[st + i] + hm1 * d0);
            if (!(h >= t))
                continue;
            sel++;
            /* insert after every kept value >= h: ties keep the lower index first */
            int64_t p = k < c ? k : c;
            while (p > 0 && kv[p - 1] < h)
                p--;
            if (p >= c)
                continue;
            int64_t e = k < c ? k : c - 1;
            for (int64_t q = e; q > p; q--) {
                kv[q] = kv[q - 1];
                ki[q] = ki[q - 1];
            }
            kv[p] = h;
            ki[p] = i;
            if (k < c)
                k++;
        }
        for (int64_t q = 0; q < k; q++) {
            gidx[count + q] = st + ki[q];
            rel[count + q] = ki[q];
        }
        bin_counts[b] = (int32_t)k;
        count += k;
    }
    *selected = sel;
    if (bad)
        *nonfinite += (int32_t)bad;
    return count;
}
