"""Threshold selection + compaction + residual update (operation 2 of docs/design.md).

One launch; program ``p`` owns elements ``[p*BLOCK, (p+1)*BLOCK)`` (int64 offsets; every
block but the last reads acc/grad unmasked, so 128-bit loads for any ``n``):

1. criterion ``|h| >= thr`` with ``h = acc + fp32(fp32(grad) * grad_scale) * (h_scale-1)``
   (or ``h = acc``; scalar threshold, or ``thr[i // bin_size]``), from one read of acc
   (and grad). Every product and sum is its own fp32 rounding: the kernel is compiled
   with ``enable_fp_fusion=False``, so no ``fma.rn.f32`` is formed, exactly like the
   numpy / torch CPU path and the oracle (which never contract). NaN is never selected
   (an IEEE comparison with NaN is false on every path);
2. an exclusive ``tl.cumsum`` of the mask gives each selected element its rank inside
   the block; ONE relaxed ``tl.atomic_add(count[1], k)`` per program with ``k > 0``
   reserves ``k`` consecutive slots starting at ``base`` (the old value). After the
   launch a one-element device op sets ``count[0] = min(count[1], capacity)``, so
   ``count = [sent, selected]``;
3. element with slot ``base + rank < capacity`` writes ``indices[slot]`` and its value
   (fp32/fp16/bf16 cast of acc; SIGN1: one relaxed ``tl.atomic_or`` of its sign bit
   into the int32 word ``slot // 32`` of a zeroed word buffer, little-endian so bit
   ``j % 8`` of byte ``j // 8``) and the new residual ``acc - dequant(value)``;
   everything else keeps acc (selected elements beyond capacity stay in the residual).

Relaxed atomics: nothing is published through them inside the launch (the slot
reservation only has to be unique; consumers read after the kernel), so no fence.

Slot order: ascending index within a block; blocks take slots in whatever order their
atomics land, so *which* selected elements overflow the capacity depends on scheduling.
Consumers must not depend on slot order. The only extra writes are the zeroing of
``count`` (8 bytes) and, for SIGN1, of the sign words (capacity/8 bytes).
"""
import torch
import triton
import triton.language as tl

VE_FP32, VE_FP16, VE_BF16, VE_SIGN1 = 0, 1, 2, 6
_VE_DTYPE = {VE_FP32: torch.float32, VE_FP16: torch.float16, VE_BF16: torch.bfloat16}


@triton.jit
def _ld(ptr, offs, mask, FULL: tl.constexpr):
    """Unmasked for a full block (provable 16-byte contiguity: 128-bit loads for any n)."""
    if FULL:
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def reserve_slots(sel, count_ptr, capacity):
    """Step 2: each selected element's slot (its exclusive rank in the block plus the
    block's base, reserved with ONE relaxed ``atomic_add`` into ``count_ptr``) and the
    mask of those that fit below ``capacity``."""
    seli = sel.to(tl.int32)
    k = tl.sum(seli, axis=0)
    rank = tl.cumsum(seli, axis=0) - seli
    base = tl.atomic_add(count_ptr, k, mask=k > 0, sem="relaxed")
    slot = (base + rank).to(tl.int64)
    return slot, sel & (slot < capacity)


@triton.jit
def store_float_values(a, val_ptr, at, w, VE: tl.constexpr):
    """Step 3 for fp32 / fp16 / bf16 values: ``val[at] = cast(a)`` where ``w``; returns
    the new residual of those elements (0 for fp32, the cast error otherwise).

    The narrow casts saturate first (fp16 overflows to inf above 65504, bf16 just below
    fp32's max: ``hvdsparse.payload.FLOAT_MAX``; the excess stays in the residual) and
    round to nearest even, as torch does. bf16 is rounded here with integer operations:
    the GPU's fptrunc rounds to nearest even, but Triton's interpreter truncates (and its
    "rtne" rounds ties up), so a plain cast would hide a different result from every
    CPU test (tests/test_wire_float.py)."""
    if VE == 0:
        tl.store(val_ptr + at, a, mask=w)
        newa = tl.zeros_like(a)
    elif VE == 1:
        vc = tl.minimum(tl.maximum(a, -65504.0), 65504.0).to(tl.float16)
        tl.store(val_ptr + at, vc, mask=w)
        newa = a - vc.to(tl.float32)
    else:
        m = 3.3895313892515355e38
        bits = tl.minimum(tl.maximum(a, -m), m).to(tl.uint32, bitcast=True)
        # |x| <= bf16's max, so adding at most 0x8000 cannot carry out of the magnitude
        r = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        tl.store(val_ptr + at, (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=w)
        newa = a - r.to(tl.float32, bitcast=True)
    return newa


@triton.jit
def _select_block(acc_ptr, grad_ptr, thr_ptr, idx_ptr, val_ptr, sign_ptr, count_ptr,
                  sscale_ptr, gscale_ptr, start, n, capacity, L, hm1,
                  HAS_GRAD: tl.constexpr, HAS_GSCALE: tl.constexpr, PER_BIN: tl.constexpr,
                  VE: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    inb = offs < n
    a = _ld(acc_ptr, offs, inb, FULL)
    if HAS_GRAD:
        g = _ld(grad_ptr, offs, inb, FULL).to(tl.float32)
        if HAS_GSCALE:
            g = g * tl.load(gscale_ptr)
        h = a + g * hm1          # two roundings: compiled with enable_fp_fusion=False
    else:
        h = a
    if PER_BIN:
        thr = tl.load(thr_ptr + offs // L, mask=inb, other=float("inf"))
    else:
        thr = tl.load(thr_ptr)
    sel = (tl.abs(h) >= thr) & inb
    slot, w = reserve_slots(sel, count_ptr + 1, capacity)
    tl.store(idx_ptr + slot, offs.to(tl.int32), mask=w)
    if VE == 6:  # SIGN1
        ss = tl.load(sscale_ptr)
        neg = a < 0
        newa = a - tl.where(neg, -ss, ss)
        bit = tl.full([BLOCK], 1, tl.int32) << (slot & 31).to(tl.int32)
        tl.atomic_or(sign_ptr + (slot >> 5), bit, mask=w & neg, sem="relaxed")
    else:
        newa = store_float_values(a, val_ptr, slot, w, VE)
    tl.store(acc_ptr + offs, newa, mask=w)


@triton.jit
def _select_compact_kernel(acc_ptr, grad_ptr, thr_ptr, idx_ptr, val_ptr, sign_ptr,
                           count_ptr, sscale_ptr, gscale_ptr, n, capacity, L, hm1,
                           HAS_GRAD: tl.constexpr, HAS_GSCALE: tl.constexpr,
                           PER_BIN: tl.constexpr, VE: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start + BLOCK <= n:       # every block but the last: unmasked, 128-bit loads
        _select_block(acc_ptr, grad_ptr, thr_ptr, idx_ptr, val_ptr, sign_ptr, count_ptr,
                      sscale_ptr, gscale_ptr, start, n, capacity, L, hm1, HAS_GRAD,
                      HAS_GSCALE, PER_BIN, VE, BLOCK, True)
    else:
        _select_block(acc_ptr, grad_ptr, thr_ptr, idx_ptr, val_ptr, sign_ptr, count_ptr,
                      sscale_ptr, gscale_ptr, start, n, capacity, L, hm1, HAS_GRAD,
                      HAS_GSCALE, PER_BIN, VE, BLOCK, False)


def select_compact(acc, threshold, capacity, *, bin_size=0, grad=None, h_scale=1.0,
                   value_encoding=VE_FP32, sign_scale=None, out=None, grad_scale=None,
                   block=1024, num_warps=4):
    """Triton version of ``hvdsparse.cpu.select_compact`` (arguments already
    validated by ``hvdsparse.ops``: ``threshold`` an fp32 tensor, 0-d or [nbins] with
    ``bin_size > 0``; ``sign_scale`` an fp32 1-element tensor for SIGN1; ``grad_scale``
    None or an fp32 1-element tensor).

    Returns ``(indices int32[capacity], values, count int32[2])`` as the CPU path, slot
    order as described in the module docstring. ``out`` = optional preallocated
    ``(indices, values, count)``; count is zeroed here (and SIGN1 values rewritten).
    ``block`` / ``num_warps``: 1024 / 4 streamed fastest at 25 M fp32 elements on an
    H100 and an H200 (``scripts/gpu_sweep.py``: 0.67 and 0.48 of a device copy, against
    0.52 and 0.35 at 4096 / 8); any power of two gives the same selection.
    """
    n = acc.numel()
    dev = acc.device
    ve = int(value_encoding)
    capacity = int(capacity)
    nbytes = -(-capacity // 8)
    if out is None:
        indices = torch.empty(capacity, dtype=torch.int32, device=dev)
        count = torch.zeros(2, dtype=torch.int32, device=dev)
        values = None if ve == VE_SIGN1 else torch.empty(capacity, dtype=_VE_DTYPE[ve], device=dev)
    else:
        indices, values, count = out
        count.zero_()
    words = None
    if ve == VE_SIGN1:
        words = torch.zeros(max(1, -(-capacity // 32)), dtype=torch.int32, device=dev)
        sign_bytes = words.view(torch.uint8)[:nbytes]
        if values is None:
            values = sign_bytes
    per_bin = threshold.dim() > 0 and bin_size > 0
    thr = threshold if per_bin else threshold.reshape(1)
    hm1 = float(h_scale) - 1.0
    has_grad = grad is not None and hm1 != 0.0
    has_gs = has_grad and grad_scale is not None
    if n:
        dummy = acc
        grid = (triton.cdiv(n, block),)
        _select_compact_kernel[grid](
            acc, grad if has_grad else dummy, thr, indices,
            values if ve != VE_SIGN1 else dummy, words if words is not None else indices,
            count, sign_scale.reshape(1) if ve == VE_SIGN1 else dummy,
            grad_scale.reshape(1) if has_gs else dummy,
            n, capacity, max(int(bin_size), 1), hm1,
            HAS_GRAD=has_grad, HAS_GSCALE=has_gs, PER_BIN=per_bin, VE=ve, BLOCK=block,
            num_warps=num_warps, enable_fp_fusion=False)
        # sent = min(selected, capacity): a one-element device op, no host sync
        torch.clamp_max(count[1:2], capacity, out=count[0:1])
    if ve == VE_SIGN1 and values.data_ptr() != sign_bytes.data_ptr():
        values.copy_(sign_bytes)
    return indices, values, count
