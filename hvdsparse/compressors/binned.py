"""The bin-relative layout shared by the binned compressors (AdaComp, TopK's binned
indices): the up to ``c`` largest entries of every bin, valid slots first, and the
bin-relative indices in their wire dtype (BIN_U8 / BIN_U16). Device ops only, no host
sync.
"""
from __future__ import annotations

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def binned_topc(a: torch.Tensor, bin_size: int, c: int, thr):
    """Up to ``c`` largest entries of every bin of ``bin_size`` consecutive elements of
    ``a`` (non-negative magnitudes, 1-D) that are ``>= thr`` (a scalar or an [nbins, 1]
    tensor), laid out for the bin-relative wire format (BIN_U8 / BIN_U16).

    Returns ``(gidx, rel, vmask, count, bin_counts, padded)``: ``nbins * c`` slots with the
    valid ones first, in bin order (largest first within a bin); ``gidx`` the absolute
    int64 index (0 in unused slots), ``rel`` the index within its bin (0 in unused slots), cast to the
    wire dtype (uint8 for bins <= 256, else int16 holding the uint16 bits), ``vmask`` the
    valid slots, ``count`` int32[1], ``bin_counts`` int32[nbins], and ``padded`` = ``a``
    zero-padded to whole bins, viewed [nbins, bin_size]. All on the device, no host sync.
    """
    n = a.numel()
    nb = ceil_div(n, bin_size)
    pad = nb * bin_size - n
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    padded = a.view(nb, bin_size)
    tv, ti = torch.topk(padded, c, dim=1, sorted=True)
    valid = tv >= thr                                    # [nb, c]
    bin_counts = valid.sum(dim=1, dtype=torch.int32)
    fvalid = valid.reshape(-1)
    order = torch.sort((~fvalid).to(torch.int8), stable=True).indices
    base = (torch.arange(nb, device=a.device) * bin_size).unsqueeze(1)
    gidx = (ti + base).reshape(-1)[order]
    rel = ti.reshape(-1)[order]
    vmask = fvalid[order]
    count = fvalid.sum(dtype=torch.int32).reshape(1)
    gidx = torch.where(vmask, gidx, torch.zeros_like(gidx))
    rel = torch.where(vmask, rel, torch.zeros_like(rel))   # padding slots: 0 on the wire
    return gidx, binned_rel(rel, bin_size), vmask, count, bin_counts, padded


def binned_rel(rel: torch.Tensor, bin_size: int) -> torch.Tensor:
    """int64 bin-relative indices in the wire dtype: uint8 for bins <= 256, else int16
    holding the uint16 bits."""
    if bin_size <= 256:
        return rel.to(torch.uint8)
    return torch.where(rel >= 32768, rel - 65536, rel).to(torch.int16)


def trim_to_quota(gidx: torch.Tensor, vmask: torch.Tensor, bin_counts: torch.Tensor,
                  quota: torch.Tensor, bin_size: int, capacity: int):
    """The slots of a :func:`binned_topc` layout (valid slots first, by bin, largest
    first within a bin; ``bin_counts`` per bin) cut to ``quota[b] <= bin_counts[b]`` per
    bin: each bin keeps its first ``quota[b]`` slots, packed into ``capacity`` slots in
    the same layout. Returns ``(gidx int64, rel int64, vmask, count int32[1])`` of
    ``capacity`` slots (unused ones index 0). Device ops of fixed shapes, no host
    synchronisation."""
    dev = gidx.device
    nb = bin_counts.numel()
    cnt = bin_counts.to(torch.int64)
    q = quota.to(torch.int64)
    cum = torch.cumsum(cnt, 0)
    qcum = torch.cumsum(q, 0)
    s = torch.arange(gidx.numel(), device=dev)
    b = torch.searchsorted(cum, s, right=True).clamp_max(max(nb - 1, 0))
    j = s - (cum[b] - cnt[b])                         # slot within its bin
    keep = vmask & (j < q[b])
    pos = torch.where(keep, qcum[b] - q[b] + j, torch.full_like(s, capacity))
    out = torch.zeros(capacity + 1, dtype=torch.int64, device=dev)
    out.scatter_(0, pos, torch.where(keep, gidx, torch.zeros_like(gidx)))
    rel = torch.zeros(capacity + 1, dtype=torch.int64, device=dev)
    rel.scatter_(0, pos, torch.where(keep, gidx - b * int(bin_size), torch.zeros_like(gidx)))
    count = qcum[-1:].to(torch.int32) if nb else torch.zeros(1, dtype=torch.int32,
                                                              device=dev)
    vm = torch.arange(capacity, device=dev) < count.to(torch.int64)
    return out[:capacity], rel[:capacity], vm, count
