"""The exact top-k selection the replays use, written independently of torch's kernels:
the ``k`` largest ``|x|``, ties at the k-th value to the lower index -- the rule
``TopK(exact=True)`` documents (``torch.topk`` leaves tie order unspecified, so an
oracle built on it can pick the other of two equal elements)."""
import math

import numpy as np
import torch


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """int64 indices into ``x.reshape(-1)`` of its ``k`` largest ``|x|``, ties to the lower
    index, largest first."""
    mag = x.detach().reshape(-1).abs().double().cpu().numpy()
    order = np.lexsort((np.arange(mag.size), -mag))[:k]
    return torch.from_numpy(order.copy()).to(torch.int64)


def threshold_ladder(a: torch.Tensor, tau, cap: int, ladder):
    """Threshold's overflow ladder by its written rule, one counting pass per rung:
    ``(t*, c_0)`` with ``c_j = #{a >= fp32(tau * ladder[j])}``, ``t*`` the rung ``r`` =
    the number of rungs whose count exceeds ``cap`` (at most the top one), ``c_0`` the
    count at ``tau`` (host floats / ints)."""
    t32 = torch.tensor(float(tau), dtype=torch.float32)
    rungs = [float(t32 * torch.tensor(f, dtype=torch.float32)) for f in ladder]
    counts = [int((a >= t).sum()) for t in rungs]
    r = min(sum(c > cap for c in counts), len(ladder) - 1)
    return rungs[r], counts[0]


def topk_capacity(n: int, k: int, slack: float = 1.5) -> int:
    """TopK's documented capacity (``hvdsparse/compressors/topk.py``): ``k`` when the
    sampled estimate takes its exact route -- the sample would be the whole layer, ``2 s
    > n`` with ``s = min(n, max(4096, ceil(256 n / m)))``, ``m = (k + ceil(slack k)) / 2``
    -- else ``min(n, ceil(slack k))``."""
    c = min(n, math.ceil(slack * k))
    s = min(n, max(4096, math.ceil(256 * n / (0.5 * (k + c)))))
    return k if 2 * s > n else c
