"""The exchange settings shared by every front door (``hvdsparse.DistributedOptimizer``
today), validated in one place, and the fingerprint that ranks compare at step 1.

Every field must be identical on every rank: the bucket plan, the collective names and
the message lengths follow from them, so a rank with a different fusion threshold or
exchange would issue collectives that never match (a hang). :func:`fingerprint`
turns the settings plus the compressor's configuration and the library / wire versions
into plain Python data that the scheduler gathers from every rank at the first
``synchronize()`` and compares key by key against rank 0 (an error on every rank naming
the setting and the ranks, never a hang).

``nonfinite`` -- what a step does when some rank's gradient holds NaN/Inf (such values
are never absorbed into a residual and never sent, see :mod:`hvdsparse.compressors`):

* ``"raise"`` (default): every rank raises ``FloatingPointError`` naming the layers and
  the ranks (on CUDA one step late, where the flag is read without stalling; the
  affected layers' gradients carry a NaN on every rank meanwhile, as a dense allreduce
  would);
* ``"skip"``: the step is skipped on every rank, as ``torch.amp.GradScaler`` skips an
  overflow step: ``optimizer.step()`` does not update, residuals return to their state
  before the step (costs one host read per step on CUDA, like GradScaler);
* ``"propagate"``: the affected layers' gradients carry a NaN on every rank and the
  caller decides (default when a ``grad_scaler`` is given: the scaler sees the overflow
  and skips the step; residuals are then rolled back).

``compress_at_size_one`` -- benchmark-only (default off; environment variable
``HVDSPARSE_COMPRESS_AT_SIZE_ONE=1``): at world size 1 the scheduler normally skips
compression, as Horovod skips its allreduce; with this set it runs the full path
(compress, exchange with itself through Horovod's size-1 collectives, decode), so the
compression overhead can be measured without a network (``scripts/bench_overhead.py``).

``cuda_graphs`` -- replay each bucket group's compress launches on CUDA as one CUDA graph,
and an allgathered bucket's encode and decode as one each (:mod:`hvdsparse.device_graphs`;
default off, or ``HVDSPARSE_CUDA_GRAPHS=1``): a segment's launches are captured at their second identical step and replayed after; warm-up,
refresh and other changed steps run eagerly. Off by default until it is measured faster
on a GPU (``scripts/gpu_check.sh`` runs both).
"""
from __future__ import annotations

import enum
import inspect
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from .exchange import check_exchange
from .version import __version__

DEFAULT_FUSION_THRESHOLD = 1 << 20     # bytes of encoded payload per bucket
LOCAL_MODES = ("sum", "partial", "error")
NONFINITE_POLICIES = ("raise", "skip", "propagate")
#: the settings fields the local update reads (resolved against the optimizer by a door)
LOCAL_UPDATE_OPTIONS = ("momentum_correction", "momentum_masking", "clip_grad_norm",
                        "adam_recipe", "adam_warmup", "adam_refresh", "adam_refresh_start",
                        "adam_wire")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, torch.float32: torch.float32,
           "fp16": torch.float16, "float16": torch.float16, torch.float16: torch.float16}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class ExchangeSettings:
    """Every option of a front door besides the compressor and the objects it is handed
    (optimizer, scaler, transport): how gradients travel and what the local update does
    before they are compressed. Both doors take one (``settings=``) or fill one from
    keyword options (:meth:`from_options`); see the module docstring and
    :func:`hvdsparse.DistributedOptimizer` for each field's meaning. The local-update
    fields (:data:`LOCAL_UPDATE_OPTIONS`) are resolved against the optimizer by the
    door (:func:`hvdsparse.door.resolve_local_update`)."""

    exchange: str = "auto"
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    average: bool = True
    gradient_predivide_factor: float = 1.0
    backward_passes_per_step: int = 1
    dense_dtype: torch.dtype = torch.float32
    split_dense_bits: int = 0
    quant_bucket: int = 512
    validate: Optional[bool] = None
    alpha_bytes: float = 0.0
    local_gradient: Optional[str] = None
    sync_period: int = 500
    nonfinite: str = "raise"
    sparse_as_dense: bool = False
    compress_at_size_one: bool = False
    momentum_correction: Optional[bool] = None
    momentum_masking: bool = False
    clip_grad_norm: Optional[float] = None
    adam_recipe: Optional[bool] = None
    adam_warmup: Optional[int] = None
    adam_refresh: object = None
    adam_refresh_start: Optional[int] = None
    adam_wire: Optional[str] = None
    cuda_graphs: bool = False

    @classmethod
    def from_args(cls, *, exchange="auto", fusion_threshold=None, average=True,
                  gradient_predivide_factor=1.0, backward_passes_per_step=1,
                  dense_dtype="fp32", split_dense_bits=0, quant_bucket=512, validate=None,
                  alpha_bytes=0.0, local_gradient=None, sync_period=500,
                  nonfinite="raise", sparse_as_dense=False,
                  compress_at_size_one=None, momentum_correction=None,
                  momentum_masking=False, clip_grad_norm=None, adam_recipe=None,
                  adam_warmup=None, adam_refresh=None,
                  adam_refresh_start=None, adam_wire=None,
                  cuda_graphs=None) -> "ExchangeSettings":
        """Validate user arguments (clear errors naming the argument) and normalise.
        The local-update options are checked here as far as they can be without the
        optimizer (the rest when a door resolves them)."""
        check_exchange(exchange)
        if fusion_threshold is None:
            env = os.environ.get("HVDSPARSE_FUSION_THRESHOLD")
            try:
                fusion_threshold = DEFAULT_FUSION_THRESHOLD if env is None else int(env)
            except ValueError:
                raise ValueError(f"HVDSPARSE_FUSION_THRESHOLD must be an int (bytes), got "
                                 f"{env!r}") from None
        if not _is_int(fusion_threshold) or fusion_threshold < 0:
            raise ValueError(f"fusion_threshold must be an int >= 0 (bytes), got "
                             f"{fusion_threshold!r}")
        if not _is_int(backward_passes_per_step) or backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        if not isinstance(gradient_predivide_factor, (int, float)) \
                or not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got "
                             f"{gradient_predivide_factor!r}")
        if dense_dtype not in _DTYPES:
            raise ValueError(f"dense_dtype must be 'fp32' or 'fp16', got {dense_dtype!r}")
        if split_dense_bits not in (0, 2, 4, 8) or isinstance(split_dense_bits, bool):
            raise ValueError(f"split_dense_bits must be 0 (fp32), 8, 4 or 2, got "
                             f"{split_dense_bits!r}")
        if not _is_int(quant_bucket) or quant_bucket < 1:
            raise ValueError(f"quant_bucket must be an int >= 1, got {quant_bucket!r}")
        if validate not in (None, True, False):
            raise ValueError(f"validate must be None, True or False, got {validate!r}")
        if not isinstance(alpha_bytes, (int, float)) or alpha_bytes < 0:
            raise ValueError(f"alpha_bytes must be a number >= 0, got {alpha_bytes!r}")
        if local_gradient is not None and (not isinstance(local_gradient, str)
                                           or local_gradient not in LOCAL_MODES):
            raise ValueError(f"local_gradient must be None or one of "
                             f"{', '.join(map(repr, LOCAL_MODES))}, got {local_gradient!r}")
        if not _is_int(sync_period) or sync_period < 1:
            raise ValueError(f"sync_period must be an int >= 1, got {sync_period!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of "
                             f"{', '.join(map(repr, NONFINITE_POLICIES))}, got {nonfinite!r}")
        if sparse_as_dense not in (True, False):
            raise ValueError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
        if compress_at_size_one is None:
            compress_at_size_one = os.environ.get("HVDSPARSE_COMPRESS_AT_SIZE_ONE", "0") == "1"
        if compress_at_size_one not in (True, False):
            raise ValueError(f"compress_at_size_one must be True or False, got "
                             f"{compress_at_size_one!r}")
        if clip_grad_norm is not None and (not isinstance(clip_grad_norm, (int, float)) or
                                           isinstance(clip_grad_norm, bool) or
                                           not clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be None or a number > 0, got "
                             f"{clip_grad_norm!r}")
        if cuda_graphs is None:
            env = os.environ.get("HVDSPARSE_CUDA_GRAPHS", "0")
            if env not in ("0", "1"):
                raise ValueError(f"HVDSPARSE_CUDA_GRAPHS must be 0 or 1, got {env!r}")
            cuda_graphs = env == "1"
        if cuda_graphs not in (True, False):
            raise ValueError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        return cls(exchange=exchange, fusion_threshold=int(fusion_threshold),
                   average=bool(average),
                   gradient_predivide_factor=float(gradient_predivide_factor),
                   backward_passes_per_step=int(backward_passes_per_step),
                   dense_dtype=_DTYPES[dense_dtype], split_dense_bits=int(split_dense_bits),
                   quant_bucket=int(quant_bucket), validate=validate,
                   alpha_bytes=float(alpha_bytes), local_gradient=local_gradient,
                   sync_period=int(sync_period), nonfinite=nonfinite,
                   sparse_as_dense=bool(sparse_as_dense),
                   compress_at_size_one=bool(compress_at_size_one),
                   momentum_correction=momentum_correction,
                   momentum_masking=momentum_masking, clip_grad_norm=clip_grad_norm,
                   adam_recipe=adam_recipe, adam_warmup=adam_warmup,
                   adam_refresh=adam_refresh, adam_refresh_start=adam_refresh_start,
                   adam_wire=adam_wire, cuda_graphs=bool(cuda_graphs))

    @classmethod
    def from_options(cls, settings: Optional["ExchangeSettings"], options: dict, who: str,
                     **defaults) -> "ExchangeSettings":
        """A door's settings: ``settings`` as given, or filled from keyword ``options``
        (``defaults``: the door's own defaults for options not given). An unknown
        option, a non-settings ``settings=``, or both ``settings=`` and options raise an
        error naming them."""
        known = set(inspect.signature(cls.from_args).parameters)
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{who}: unknown option(s) {', '.join(map(repr, unknown))}; "
                            f"the options are {', '.join(sorted(known))}")
        if settings is None:
            return cls.from_args(**{**defaults, **options})
        if not isinstance(settings, cls):
            raise TypeError(f"{who}: settings must be an hvdsparse.ExchangeSettings, got "
                            f"{type(settings).__name__}")
        if options:
            raise ValueError(f"{who}: pass settings= or the options "
                             f"{', '.join(map(repr, sorted(options)))}, not both "
                             f"(ExchangeSettings.from_args(...) builds one from options)")
        return settings

    def plain(self) -> dict:
        d = asdict(self)
        d["dense_dtype"] = str(self.dense_dtype).replace("torch.", "")
        return d


def plain(x):
    """Nested plain data (dicts, lists, numbers, strings) for cross-rank comparison:
    anything else becomes its type name plus its ``config()`` or ``repr``."""
    if isinstance(x, enum.Enum):          # e.g. ValueEncoding: a name, loadable anywhere
        return x.name.lower()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x)
    cfg = getattr(x, "config", None)
    if callable(cfg):
        return {"type": type(x).__name__, "config": plain(cfg())}
    return f"{type(x).__name__}:{x!r}"


def fingerprint(settings: ExchangeSettings, compressor) -> dict:
    """Everything that must agree across ranks, as plain data (see module docstring)."""
    from . import codec, payload
    return {"hvdsparse version": __version__, "wire format version": int(codec.VERSION),
            "narrowed indices (HVDSPARSE_NARROW_INDICES)": bool(payload.NARROW_INDICES),
            "compressor": plain(compressor.config()), **{
                k: v for k, v in settings.plain().items()
                # validate changes only how a rank checks what it receives,
                # cuda_graphs only how it issues its launches; compress_at_size_one
                # only acts at world size 1
                if k not in ("validate", "cuda_graphs", "compress_at_size_one")}}


def differences(mine: dict, ref: dict, prefix: str = ""):
    """Yield ``(key path, mine, ref)`` for every leaf where two fingerprints differ."""
    for k in sorted(set(mine) | set(ref)):
        a, b = mine.get(k, "<missing>"), ref.get(k, "<missing>")
        path = f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            yield from differences(a, b, path + ".")
        elif a != b:
            yield path, a, b
