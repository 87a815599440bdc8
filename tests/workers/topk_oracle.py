"""The exact top-k selection the replays use, written independently of torch's kernels:
the ``k`` largest ``|x|``, ties at the k-th value to the lower index -- the rule
``TopK(exact=True)`` documents (``torch.topk`` leaves tie order unspecified, so an
oracle built on it can pick the other of two equal elements)."""
import numpy as np
import torch


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """int64 indices into ``x.reshape(-1)`` of its ``k`` largest ``|x|``, ties to the lower
    index, largest first."""
    mag = x.detach().reshape(-1).abs().double().cpu().numpy()
    order = np.lexsort((np.arange(mag.size), -mag))[:k]
    return torch.from_numpy(order.copy()).to(torch.int64)
