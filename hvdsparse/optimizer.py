"""``hvdsparse.DistributedOptimizer``: Horovod's DistributedOptimizer with sparse /
quantised gradient exchange, and the routing hook for ``hvd.DistributedOptimizer``.

Like Horovod, :func:`DistributedOptimizer` builds a subclass of the wrapped optimizer's
class on the fly (so ``isinstance(opt, torch.optim.SGD)`` still holds and the wrapped
``step`` runs the update) whose instance shares the wrapped optimizer's
``param_groups``. Gradients are compressed layer by layer in backward hooks and
exchanged in buckets (:mod:`hvdsparse.scheduler`, :mod:`hvdsparse.exchange`);
``step()`` = ``synchronize()`` + the wrapped optimizer's step (+ the periodic parameter
average of the local-gradient modes, :mod:`hvdsparse.local`).

Options shared with ``hvd.DistributedOptimizer`` keep Horovod's names, meanings and
errors: ``named_parameters`` (unique names, ``(name, tensor)`` tuples, every optimised
parameter named), ``backward_passes_per_step`` (> 0; gradients accumulate locally and
are exchanged once), ``op`` (``hvd.Average`` or ``hvd.Sum``; ``hvd.Adasum`` is refused:
sparse payloads are summed), ``gradient_predivide_factor`` (only with ``op=Average``),
``synchronize()`` / ``skip_synchronize()``, ``zero_grad()`` refused between backward and
step, ``set_backward_passes_per_step``. ``groups`` / ``num_groups`` /
``sparse_as_dense`` / non-global ``process_set`` are refused with an error (buckets
come from ``fusion_threshold``).

Routing
-------
``import hvdsparse`` calls :func:`install_routing`, which replaces the attribute
``horovod.torch.DistributedOptimizer`` (on the module object, at runtime -- Horovod's
files are never edited) by :func:`routed_distributed_optimizer`: a call whose
``compression`` is an hvdsparse :class:`~hvdsparse.compressors.Compressor` goes to
:func:`DistributedOptimizer`, every other call goes to Horovod's original function
with its arguments untouched (``hvd.Compression.none`` / ``fp16`` keep working).
Code that imported ``DistributedOptimizer`` by name from ``horovod.torch`` *before*
``import hvdsparse`` holds Horovod's original. :func:`uninstall_routing` restores it.
"""
from __future__ import annotations

import itertools
import os
import warnings
from contextlib import contextmanager

import torch

from .exchange import check_exchange
from .local import LocalGradient, check_mode, sync_parameters
from .scheduler import LayerScheduler

DEFAULT_FUSION_THRESHOLD = 1 << 20     # bytes of encoded payload per bucket
_instance_counter = itertools.count()


def _compressor_base():
    from .compressors import Compressor
    return Compressor


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 op, gradient_predivide_factor, fusion_threshold, exchange, local_gradient,
                 sync_period, dense_dtype, split_dense_bits, quant_bucket, validate,
                 alpha_bytes):
        import horovod.torch as hvd
        super(self.__class__, self).__init__(params)
        self._compression = compression

        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f'allreduce.noname.{i}.{j}', v)
                                for i, param_group in enumerate(self.param_groups)
                                for j, v in enumerate(param_group['params'])]
        if any([not isinstance(p, tuple) for p in named_parameters]):
            raise ValueError('named_parameters should be a sequence of '
                             'tuples (name, parameter), usually produced by '
                             'model.named_parameters().')
        dups = _find_duplicates([k for k, _ in named_parameters])
        if len(dups) > 0:
            raise ValueError('Parameter names in named_parameters must be unique. '
                             'Found duplicates: %s' % ', '.join(sorted(dups)))
        all_param_ids = {id(v) for param_group in self.param_groups
                         for v in param_group['params']}
        named_param_ids = {id(v) for k, v in named_parameters}
        unnamed_param_ids = all_param_ids - named_param_ids
        if len(unnamed_param_ids):
            raise ValueError('named_parameters was specified, but one or more model '
                             'parameters were not named. Python object ids: '
                             '%s' % ', '.join(str(id) for id in unnamed_param_ids))

        optimised = [(k, v) for k, v in named_parameters if id(v) in all_param_ids]
        # the optimiser's own parameter order (deterministic, same code on every rank)
        pos = {id(v): i for i, v in enumerate(v for g in self.param_groups for v in g['params'])}
        optimised.sort(key=lambda kv: pos[id(kv[1])])
        self._parameter_names = {v: k for k, v in optimised}
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._synchronized = False
        self._should_synchronize = True
        self._steps_done = 0
        self._local = LocalGradient(local_gradient, sync_period) if local_gradient else None
        self.sync_period = sync_period

        rank, size = hvd.rank(), hvd.size()
        compression.bind(rank, size)
        self._hvdsparse = LayerScheduler(
            optimised, compression, rank=rank, world_size=size,
            prefix=f"hvdsparse.o{next(_instance_counter)}", exchange=exchange,
            fusion_threshold=fusion_threshold, average=(op == hvd.Average),
            gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step, dense_dtype=dense_dtype,
            split_dense_bits=split_dense_bits, quant_bucket=quant_bucket,
            validate=validate, alpha_bytes=alpha_bytes, local=self._local)
        self._hvdsparse.register_hooks()

    # -------------------------------------------------------------- Horovod API
    @property
    def scheduler(self) -> LayerScheduler:
        """The layer scheduler (bucket plan, event log, statistics)."""
        return self._hvdsparse

    @property
    def compression(self):
        return self._compression

    def load_state_dict(self, *args, **kwargs):
        self._hvdsparse.reset()
        self._synchronized = False
        self._should_synchronize = True
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self._hvdsparse.set_backward_passes_per_step(passes)

    def synchronize(self):
        """Flush the last bucket, wait for every exchange, write the averaged (or
        locally combined) gradients into ``p.grad``."""
        self._hvdsparse.synchronize()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without "
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        loss = super(self.__class__, self).step(closure)
        self._steps_done += 1
        if self._local is not None and self._local.should_sync(self._steps_done):
            sync_parameters([p for g in self.param_groups for p in g['params']],
                            name=f"{self._hvdsparse.prefix}.sync")
            self._hvdsparse.events.append(("param_sync", self._steps_done))
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._hvdsparse.pending():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # -------------------------------------------------------------- hvdsparse API
    def stats(self) -> dict:
        """``last``: the last step's bytes sent/received per strategy (per-rank ring
        link bytes), strategy and bytes per bucket, the fp32 dense allreduce bytes the
        same gradients would have cost, compress / wait / decode seconds; ``totals``:
        the same summed over steps; ``compressor``: the compressor's totals."""
        comp = getattr(self._compression, "stats_totals", None)
        return dict(last=dict(self._hvdsparse.last_stats),
                    totals=dict(self._hvdsparse.totals),
                    compressor=comp() if callable(comp) else None)

    def compression_state_dict(self) -> dict:
        """This rank's compressor state (residuals, thresholds, cores...) plus the step
        counters that key the compressor's seeds, warm-up and the local-gradient sync
        period, so a resumed run continues exactly where it stopped. Residuals are per
        rank: save one per rank."""
        sd = self._compression.state_dict()
        sd["scheduler_step"] = self._hvdsparse.step
        sd["optimizer_steps"] = self._steps_done
        return sd

    def load_compression_state_dict(self, sd: dict):
        self._compression.load_state_dict(sd)
        if "scheduler_step" in sd:
            self._hvdsparse.step = int(sd["scheduler_step"])
        if "optimizer_steps" in sd:
            self._steps_done = int(sd["optimizer_steps"])


def _find_duplicates(lst):
    seen, dups = set(), set()
    for el in lst:
        if el in seen:
            dups.add(el)
        seen.add(el)
    return dups


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, torch.float32: torch.float32,
           "fp16": torch.float16, "float16": torch.float16, torch.float16: torch.float16}


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         fusion_threshold=None, exchange="auto", local_gradient=None,
                         sync_period=500, dense_dtype="fp32", split_dense_bits=0,
                         quant_bucket=512, validate=None, alpha_bytes=0.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None):
    """Wrap ``optimizer`` so that gradients are compressed and exchanged sparsely.

    Arguments (Horovod's meaning where the name is Horovod's):
        optimizer: the torch optimizer to wrap (SGD, Adam, AdamW, ...).
        named_parameters: ``model.named_parameters()``; names the collectives and the
            compressor's per-layer state.
        compression: an hvdsparse compressor instance (``hvdsparse.TopK(0.01)``, ...);
            default ``NoCompression()``.
        backward_passes_per_step: backward passes accumulated locally before one
            exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, gradients are scaled by ``1/f`` before
            and ``f/size`` after the sum.
        fusion_threshold: bytes of encoded payload per bucket (default 1 MiB, or
            ``HVDSPARSE_FUSION_THRESHOLD``); 0 = one bucket per layer.
        exchange: ``"auto"`` (per bucket by the cost model), ``"allgather"``,
            ``"split"`` or ``"dense"`` (see :mod:`hvdsparse.exchange`).
        local_gradient: None, ``"sum"``, ``"partial"`` or ``"error"``
            (:mod:`hvdsparse.local`); parameters are averaged every ``sync_period``
            steps.
        dense_dtype: ``"fp32"`` or ``"fp16"`` for the dense strategy's allreduce.
        split_dense_bits: 0 (fp32) or 8/4/2: quantise split's dense reduced ranges.
        quant_bucket: elements per scale of that quantisation.
        validate: host-validate received messages (default: on CPU yes, CUDA no).
        alpha_bytes: per-message latency charge of the auto cost model (bytes).
    """
    import horovod.torch as hvd
    if op is None:
        op = hvd.Average
    if compression is None:
        from .compressors import NoCompression
        compression = NoCompression()
    Compressor = _compressor_base()
    if isinstance(compression, type) and issubclass(compression, Compressor):
        raise TypeError(f"compression must be an hvdsparse compressor instance, got the class "
                        f"{compression.__name__}; write {compression.__name__}(...)")
    if not isinstance(compression, Compressor):
        raise TypeError(f"compression must be an hvdsparse compressor (hvdsparse.TopK(...), "
                        f"hvdsparse.AdaComp(...), ...), got {compression!r} "
                        f"({type(compression).__name__}); Horovod's own compressors "
                        f"(hvd.Compression.none / fp16) go to hvd.DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if gradient_predivide_factor != 1.0:
        if op != hvd.Average:
            raise ValueError('gradient_predivide_factor not supported with op != Average')
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got "
                             f"{gradient_predivide_factor!r}")
    if num_groups != 0 or groups is not None:
        raise ValueError("groups / num_groups are not supported with hvdsparse compressors: "
                         "buckets are formed by fusion_threshold (bytes of encoded payload)")
    if sparse_as_dense:
        raise ValueError("sparse_as_dense is not supported with hvdsparse compressors "
                         "(torch sparse gradients are not handled)")
    if process_set is not None and process_set is not hvd.global_process_set:
        raise NotImplementedError("hvdsparse supports only the global process set")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == hvd.Adasum:
        raise ValueError("op=hvd.Adasum is not supported by hvdsparse: sparse payloads are "
                         "summed (use hvd.Average or hvd.Sum)")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    check_exchange(exchange)
    check_mode(local_gradient)
    if not isinstance(sync_period, int) or isinstance(sync_period, bool) or sync_period < 1:
        raise ValueError(f"sync_period must be an int >= 1, got {sync_period!r}")
    if fusion_threshold is None:
        fusion_threshold = int(os.environ.get("HVDSPARSE_FUSION_THRESHOLD",
                                              DEFAULT_FUSION_THRESHOLD))
    if not isinstance(fusion_threshold, int) or isinstance(fusion_threshold, bool) \
            or fusion_threshold < 0:
        raise ValueError(f"fusion_threshold must be an int >= 0 (bytes), got "
                         f"{fusion_threshold!r}")
    if dense_dtype not in _DTYPES:
        raise ValueError(f"dense_dtype must be 'fp32' or 'fp16', got {dense_dtype!r}")
    if split_dense_bits not in (0, 2, 4, 8):
        raise ValueError(f"split_dense_bits must be 0 (fp32), 8, 4 or 2, got "
                         f"{split_dense_bits!r}")
    if not isinstance(quant_bucket, int) or quant_bucket < 1:
        raise ValueError(f"quant_bucket must be an int >= 1, got {quant_bucket!r}")

    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state initialises a fresh optimizer's state with the
    # *wrapped* optimizer's step when ``optimizer.__module__`` is Horovod's optimizer
    # module (it does so for its own DistributedOptimizer, to avoid an exchange that
    # not every rank would join); claim that module so it does the same for ours.
    cls.__module__ = "horovod.torch.optimizer"
    cls.__qualname__ = f"hvdsparse.DistributedOptimizer[{optimizer.__class__.__name__}]"
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step, op, gradient_predivide_factor, fusion_threshold,
               exchange, local_gradient, sync_period, _DTYPES[dense_dtype],
               split_dense_bits, quant_bucket, validate, alpha_bytes)


# ---------------------------------------------------------------------- routing
_original = None
#: hvd.DistributedOptimizer's positional parameters after ``optimizer`` (0.28.1)
_HOROVOD_POSITIONAL = ("named_parameters", "compression", "backward_passes_per_step", "op",
                       "gradient_predivide_factor", "num_groups", "groups",
                       "sparse_as_dense", "process_set")


def routed_distributed_optimizer(optimizer, *args, **kwargs):
    """Installed as ``horovod.torch.DistributedOptimizer`` by ``import hvdsparse``.

    ``compression`` (keyword, or Horovod's third positional argument) that is an
    hvdsparse compressor -> :func:`hvdsparse.DistributedOptimizer` with the same
    arguments; anything else -> Horovod's original ``DistributedOptimizer``, untouched.
    """
    comp = kwargs.get("compression", args[1] if len(args) > 1 else None)
    try:
        Compressor = _compressor_base()
    except ImportError:  # pragma: no cover
        Compressor = ()
    if Compressor and (isinstance(comp, Compressor) or
                       (isinstance(comp, type) and issubclass(comp, Compressor))):
        if len(args) > len(_HOROVOD_POSITIONAL):
            raise TypeError(f"DistributedOptimizer() takes at most "
                            f"{len(_HOROVOD_POSITIONAL) + 1} positional arguments "
                            f"({len(args) + 1} given)")
        merged = dict(kwargs)
        for key, value in zip(_HOROVOD_POSITIONAL, args):   # Horovod's positional order
            if key in merged:
                raise TypeError(f"DistributedOptimizer() got multiple values for argument "
                                f"{key!r}")
            merged[key] = value
        return DistributedOptimizer(optimizer, **merged)
    return _original(optimizer, *args, **kwargs)


routed_distributed_optimizer.hvdsparse_routing = True


def install_routing() -> bool:
    """Wrap ``horovod.torch.DistributedOptimizer`` (idempotent). Returns False when
    Horovod's torch module cannot be imported (nothing to route)."""
    global _original
    try:
        import horovod.torch as hvd_torch
    except Exception:  # Horovod missing or built without torch
        return False
    current = hvd_torch.DistributedOptimizer
    if getattr(current, "hvdsparse_routing", False):
        return True
    _original = current
    routed_distributed_optimizer.__doc__ = (routed_distributed_optimizer.__doc__ or "") + \
        "\n\nHorovod's original documentation:\n" + (current.__doc__ or "")
    hvd_torch.DistributedOptimizer = routed_distributed_optimizer
    return True


def uninstall_routing():
    """Put Horovod's original ``DistributedOptimizer`` back."""
    try:
        import horovod.torch as hvd_torch
    except Exception:
        return
    if _original is not None and getattr(hvd_torch.DistributedOptimizer,
                                         "hvdsparse_routing", False):
        hvd_torch.DistributedOptimizer = _original


def horovod_original():
    """Horovod's own ``DistributedOptimizer`` (before routing)."""
    if _original is not None:
        return _original
    import horovod.torch as hvd_torch
    return hvd_torch.DistributedOptimizer
