/* DGC's velocity update of one element i, shared by bucket_topk.c and adacomp.c: the
 * bits of hvdsparse/momentum.py's LocalUpdate.corrected (every product and sum its own
 * fp32 rounding: -ffp-contract=off).
 *
 *   d = D (the gradient element, AMP-scaled);  fin = |d| < inf;  gg = fin ? d : 0
 *   gg = WDTERM (gg + wd * p[i] with weight decay, else gg)
 *   U[i] = U[i] * M + C * gg          (C = 1 - dampening)
 *   x = NESTEROV ? gg + M * U[i] : U[i];  fin2 = |x| < inf;  BAD += !fin + !fin2
 *
 * Declares d, fin, gg, uu, x and fin2 in the enclosing block (x / fin2 are what the
 * caller accumulates). */
#ifndef HVDSPARSE_DGC_H
#define HVDSPARSE_DGC_H
#include <math.h>

#define DGC_VELOCITY(D, WDTERM, NESTEROV, U, M, C, BAD)                                \
    float d = (D);                                                                     \
    int fin = fabsf(d) < INFINITY;                                                     \
    float gg = fin ? d : 0.0f;                                                         \
    gg = WDTERM;                                                                       \
    float uu = (U)[i] * (M);                                                           \
    uu = uu + (C) * gg;                                                                \
    (U)[i] = uu;                                                                       \
    float x = (NESTEROV) ? gg + (M) * uu : uu;                                         \
    int fin2 = fabsf(x) < INFINITY;                                                    \
    BAD += !fin + !fin2;

#endif
