"""Momentum-factor masking (DGC): ``flat[positions[j]] = 0`` for the sent slots
``j < count[0]`` of one of this rank's own payload segments, in one launch.

Program ``b`` handles slots ``[b*BLOCK, (b+1)*BLOCK)``; ``count`` is read on the device
(no host sync). The positions come from this rank's own compressor, so they are in
range; a position ``< 0`` or ``>= n`` would be a bug upstream and is skipped rather than
written out of bounds (``hvdsparse.cpu.zero_slots`` raises on it instead). Repeated
positions write the same zero: order does not matter.
"""
import triton
import triton.language as tl


@triton.jit
def _zero_slots_kernel(flat_ptr, pos_ptr, count_ptr, C, n, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cnt = tl.load(count_ptr).to(tl.int64)
    m = (j < C) & (j < cnt)
    p = tl.load(pos_ptr + j, mask=m, other=0).to(tl.int64)
    m = m & (p >= 0) & (p < n)
    tl.store(flat_ptr + p, tl.zeros([BLOCK], dtype=flat_ptr.dtype.element_ty), mask=m)


def zero_slots(flat, positions, count, *, block=1024, num_warps=4):
    """Triton version of ``hvdsparse.cpu.zero_slots`` (validated by ``hvdsparse.ops``)."""
    C = positions.numel()
    if C == 0 or flat.numel() == 0:
        return
    _zero_slots_kernel[(triton.cdiv(C, block),)](flat, positions, count, C, flat.numel(),
                                                  BLOCK=block, num_warps=num_warps)
