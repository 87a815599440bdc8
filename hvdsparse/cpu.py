"""The CPU path of the compression operations (what :mod:`hvdsparse.ops` runs for CPU
tensors), written for memory bandwidth: one name space gathered from its parts.

Same functions and signatures as the Triton kernels in ``kernels/`` (dispatched by
:mod:`hvdsparse.ops`) and the same results bit for bit, except the slot order of
``select_compact`` (ascending here; see docs/design.md). The math of every operation is
stated once, plainly, in :mod:`hvdsparse.oracle`; the tests check this path and the
kernels against it. The CPU path (this module and its parts, the ``cpu_*.py`` modules)
imports nothing of hvdsparse but :mod:`hvdsparse.philox`, ``native/`` and
:mod:`hvdsparse.payload` (dependency floor). All tensors are 1-D and contiguous unless
stated. Gradients may be fp32, fp16 or bf16; residuals / accumulators are fp32.

Operations (see ``docs/design.md``), by part:

1. :mod:`hvdsparse.cpu_residual` -- :func:`residual_add_binmax`: ``residual += grad *
   grad_scale`` in place (non-finite addends skipped and counted) and the per-bin abs
   max; :func:`clean_grad`, :func:`zero_slots`.
2. :mod:`hvdsparse.cpu_select` -- :func:`select_compact`: threshold selection,
   compaction into fixed-capacity buffers and the residual update, in ascending index
   order; :func:`count_abs_ge`, :func:`binned_select`.
3. :mod:`hvdsparse.cpu_quantize` -- :func:`quantize_pack` / :func:`dequantize_unpack` /
   :func:`sign_unpack`: stochastic rounding to 8/4/2-bit codes with one fp32 scale per
   bucket, bit packing, and the inverse maps; :func:`pack_bits` / :func:`unpack_bits`
   are the one bit packer of the project (also used for sign bits and bitmasks).
4. :mod:`hvdsparse.cpu_decode` -- :func:`scatter_add_decode`: bounds-checked
   scatter-add of a batch of payloads, rows added in row order (deterministic);
   :func:`dense_add_decode`.

The argument checks, shared with :mod:`hvdsparse.ops`, are :mod:`hvdsparse.cpu_checks`.

How it is fast: (1) and (2) walk the tensors in cache-sized chunks
(:data:`hvdsparse.cpu_chunking.CHUNK` elements, rounded to whole bins) and reuse scratch
buffers, so each element is read from DRAM once per operation and no full-size
temporary is allocated; on the CPU they run in numpy, contiguous ranges of whole chunks
split across up to ``torch.get_num_threads()`` threads (inputs under
``cpu_chunking.CHUNK_PAR_MIN`` elements per thread stay on one), with (2) in two phases
(count / collect per range, prefix over ranges, then write) so the output order is
unchanged. Philox (:mod:`hvdsparse.philox`) and (3) run in numpy on the CPU (blocks of
whole buckets, split across threads); the torch code is kept for other devices and
gives identical bits.
"""
from __future__ import annotations

from .cpu_checks import (FLOAT_INPUT_DTYPES, QUANT_BITS_ALLOWED,  # noqa: F401
                         VE_BF16, VE_FP16, VE_FP32, VE_SIGN1, alloc_select_out, check_1d,
                         check_bits, check_clean_args, check_grad_scale, check_residual_args,
                         check_scatter_args, check_select_args, check_zero_slots_args,
                         scalar_tensor)
from .cpu_decode import dense_add_decode, scatter_add_decode  # noqa: F401
from .cpu_quantize import (dequantize_unpack, pack_bits, quantize_pack,  # noqa: F401
                           sign_unpack, unpack_bits)
from .cpu_residual import (clean_grad, residual_add, residual_add_binmax,  # noqa: F401
                           segment_mean, zero_slots)
from .cpu_select import (bin_quota, binned_select, count_abs_ge,  # noqa: F401
                         select_compact, select_if_in_range)
from .philox import (check_pos_int, check_seed, par_ranges, par_run,  # noqa: F401
                     philox_parallel, philox_scratch, PHILOX_CHUNK, PHILOX_PAR_MIN,
                     philox_uint32, philox_uniform, uniform_block)

__all__ = [
    "residual_add_binmax", "select_compact", "quantize_pack", "dequantize_unpack",
    "sign_unpack", "scatter_add_decode", "dense_add_decode", "philox_uniform",
    "philox_uint32", "pack_bits", "unpack_bits", "count_abs_ge", "binned_select", "bin_quota",
    "VE_FP32", "VE_FP16", "VE_BF16", "VE_SIGN1", "QUANT_BITS_ALLOWED",
]

_pack_bits, _unpack_bits = pack_bits, unpack_bits   # old private names
