"""Triton kernels of hvdsparse (installed as ``hvdsparse.kernels``; see ``setup.cfg``).

Importing this package imports triton. It imports nothing of hvdsparse; argument
validation happens in ``hvdsparse.ops``, which dispatches here for CUDA tensors (or under
``HVDSPARSE_FORCE_TRITON=1``). Each function has the contract of the same-named function
in ``hvdsparse.cpu`` (plain definitions: ``hvdsparse.oracle``); the modules document
launch layouts and slot order.
"""
from .residual import residual_add_binmax
from .select import select_compact
from .quantize import quantize_pack, dequantize_unpack, sign_unpack, philox_uniform
from .scatter import scatter_add_decode
from . import rowthreshold
from .refine import refine_topk_threshold
from .clean import clean_grad
from .masking import zero_slots
from .binned import binned_pack
from . import bucket_topk
from . import segment_mean
from . import bin_quota
from . import split_ranges

__all__ = ["residual_add_binmax", "select_compact", "quantize_pack", "dequantize_unpack",
           "sign_unpack", "philox_uniform", "scatter_add_decode", "rowthreshold",
           "refine_topk_threshold", "clean_grad", "zero_slots",
           "binned_pack", "bucket_topk", "segment_mean", "bin_quota", "split_ranges"]
