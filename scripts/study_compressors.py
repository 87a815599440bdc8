"""Study variants of hvdsparse's compressors, for ``scripts/bench_convergence.py`` only
(method names ``adacomp-fp32``, ...): each changes one thing of a library compressor to
measure where a gap comes from. Not part of the library, not a user option."""
import dataclasses

import torch

from hvdsparse.compressors import AdaComp, SlimDP, Threshold
from hvdsparse.payload import IndexEncoding, LayerPayload, Segment, ValueEncoding


class AdaCompExactValues(AdaComp):
    """AdaComp's selection (bins, the soft threshold ``|H| >= gmax_b``, the per-bin cap),
    but each selected element travels with its exact fp32 value ``G_i`` instead of
    ``sign(G_i) * s`` (``s``: the layer's mean bin maximum), so its residue is 0: what
    the one-scale-per-layer quantisation costs in quality (and saves in bytes: 4 bytes
    a slot instead of 1 bit)."""

    def _pack(self, name, shape, n, cap, L, ienc, G, scale, gidx, rel, vmask, count,
              bin_counts, selected):
        g = torch.where(vmask, G[gidx], torch.zeros((), dtype=G.dtype, device=G.device))
        nzero = torch.full((), -0.0, dtype=G.dtype, device=G.device)
        G.index_add_(0, gidx, torch.where(vmask, -g, nzero))     # sent: residue 0
        seg = Segment(numel=n, capacity=cap, index_encoding=ienc,
                      value_encoding=ValueEncoding.FP32, count=count, values=g.contiguous(),
                      indices=rel, bin_counts=bin_counts, bin_size=L)
        return LayerPayload(name, shape, [seg]), dict(selected=selected, threshold=scale)


class ThresholdTracking(Threshold):
    """Threshold (DCT-DP) whose reused tau tracks a target count between refreshes: after
    every step ``tau <- tau * clamp(sqrt(selected / target), 1 / 2, 2)`` (both ways),
    ``target = k + track * (capacity - k)``, instead of only raising it on an overflow.
    Per layer only (no bucket path) -- a study of the CNN divergence."""

    bucket_path = False

    def __init__(self, *a, track=0.5, **kw):
        super().__init__(*a, **kw)
        self.track = float(track)

    def _next_tau(self, tau, selected, k, cap):
        target = k + self.track * (cap - k)
        ratio = selected.to(torch.float32) / float(target)
        f = ratio.double().sqrt().float().clamp(0.5, 2.0)
        return tau * f


class ThresholdLargestOnOverflow(Threshold):
    """Threshold (DCT-DP) whose overflowing selection keeps the ``capacity`` LARGEST
    ``|acc|`` passing the reused tau instead of the first ``capacity`` in slot order
    (ascending index on the CPU); the overflow guard is unchanged (it still sees the
    count at tau). Per layer, host-synchronising -- a study of the CNN divergence,
    not a library path."""

    bucket_path = False

    def _select(self, acc, thr, cap, enc, qseed, qb, ef, done=None, **kw):
        a = acc.abs()
        over = int((a >= thr).sum())
        if done is None and over > cap:
            t_cap = torch.topk(a, cap, sorted=False).values.min()
            seg, cnt = super()._select(acc, torch.maximum(thr, t_cap), cap, enc, qseed, qb,
                                       ef, **kw)
            cnt = cnt.clone()
            cnt[1] = over                          # the guard sees the count at tau
            return seg, cnt
        return super()._select(acc, thr, cap, enc, qseed, qb, ef, done=done, **kw)


class ThresholdCoarseLadder(Threshold):
    """Threshold with a coarser overflow ladder: 16 rungs of 2^(1/4) (the library's: 32
    of 2^(1/8)), so an overflowing step fills less of its capacity -- a study of what
    the rung spacing costs."""

    ladder = tuple(float(torch.tensor(2.0 ** (j / 4), dtype=torch.float32))
                   for j in range(16))


class SlimDPSharedExplorer(SlimDP):
    """Slim-DP whose explorer is the same on every rank (a shared seed per step and
    layer, as ``RandomK(shared_seed=True)``), so it travels as values only (IMPLICIT,
    like the core): ``alpha n`` words a step instead of ``(2 alpha - beta) n``, and
    every explorer element gets all P ranks' contributions at once instead of the
    ranks' own random picks."""

    def _explorer(self, name, step, n, core, ex_size, device, shared=False):
        return super()._explorer(name, step, n, core, ex_size, device, shared=True)

    def _compress(self, name, flat, shape, step, cfg, param):
        pl, info = super()._compress(name, flat, shape, step, cfg, param)
        segs = [dataclasses.replace(g, index_encoding=IndexEncoding.IMPLICIT, indices=None,
                                    implicit_indices=g.indices.long(), narrow_indices=False)
                if g.index_encoding == IndexEncoding.INT32 else g for g in pl.segments]
        return LayerPayload(pl.name, pl.shape, segs), info
