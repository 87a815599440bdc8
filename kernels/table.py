"""Reading a segment table: the int64 ``tab[L, W]`` with which the whole-bucket kernels
(``bucket_topk.py``, ``bucket_binned.py``, ``bucket_dense.py``) describe the layers of
a bucket, one row per layer (segment). A cell holds a tensor address, a host integer
or an fp32 as its bit pattern; each module names its own columns and passes them here
as constexprs. A cached int32 ``blk[nprograms]`` maps each program of a streaming
launch to its row; the row's first program is the cell ``BLK0``.

Inlined ``@triton.jit`` helpers: they add no instruction of their own (a kernel that
calls them compiles to what it would with the same lines written in place).
"""
import triton
import triton.language as tl


@triton.jit
def f32(row, col: tl.constexpr):
    """An fp32 stored as its bits in an int64 table cell."""
    return tl.load(row + col).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def fptr(row, col: tl.constexpr):
    """The fp32 tensor whose address is in cell ``col``."""
    return tl.load(row + col).to(tl.pointer_type(tl.float32))


@triton.jit
def gptr(row, col: tl.constexpr, GDT: tl.constexpr):
    """The gradient / parameter tensor whose address is in cell ``col``, of dtype code
    ``GDT`` (0 fp32, 1 fp16, 2 bf16)."""
    a = tl.load(row + col)
    if GDT == 0:
        p = a.to(tl.pointer_type(tl.float32))
    elif GDT == 1:
        p = a.to(tl.pointer_type(tl.float16))
    else:
        p = a.to(tl.pointer_type(tl.bfloat16))
    return p


@triton.jit
def program_row(tab_ptr, blk_ptr, W: tl.constexpr, N: tl.constexpr, BLK0: tl.constexpr):
    """(row index ``j`` (int64), row pointer, segment size ``tab[j, N]``, the program's
    block index within its segment ``pid - tab[j, BLK0]`` (int64)) of this program,
    ``j = blk[pid]``."""
    pid = tl.program_id(0)
    j = tl.load(blk_ptr + pid).to(tl.int64)
    row = tab_ptr + j * W
    n = tl.load(row + N)
    lb = pid - tl.load(row + BLK0)
    return j, row, n, lb


@triton.jit
def add_nonfinite(row, col: tl.constexpr, nbad):
    """``*tab[j, col] += nbad`` (the int32 non-finite counter; relaxed, skipped at 0)."""
    tl.atomic_add(tl.load(row + col).to(tl.pointer_type(tl.int32)), nbad, mask=nbad > 0,
                  sem="relaxed")


@triton.jit
def scaled(gp, offs, mask, scale_ptr, HAS_SCALE: tl.constexpr):
    """(d, fin) of the elements ``offs``: ``d = fp32(grad) * s`` (``s = *scale_ptr``
    with ``HAS_SCALE``, else none), ``fin = |d| < inf``."""
    d = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        d = d * tl.load(scale_ptr)
    return d, tl.abs(d) < float("inf")
