"""Study variants of hvdsparse's compressors, for ``scripts/bench_convergence.py`` only
(method names ``adacomp-fp32``, ...): each changes one thing of a library compressor to
measure where a gap comes from. Not part of the library, not a user option."""
import torch

from hvdsparse.compressors import AdaComp
from hvdsparse.payload import LayerPayload, Segment, ValueEncoding


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
