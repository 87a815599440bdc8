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

import dataclasses
import itertools
import warnings
from contextlib import contextmanager
from typing import Optional

import torch

from .local import LocalGradient, sync_parameters
from .door import (bind_compressor, check_compressor, local_fingerprint, make_local_update,
                   resolve_local_update)
from .scheduler import LayerScheduler
from .settings import ExchangeSettings, fingerprint
from .transport import horovod as horovod_transport
_instance_counter = itertools.count()


def _compressor_base():
    from .compressors import Compressor
    return Compressor


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, settings, grad_scaler,
                 momentum_correction, adam):
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
        self.backward_passes_per_step = settings.backward_passes_per_step
        self.op = hvd.Average if settings.average else hvd.Sum
        self.gradient_predivide_factor = settings.gradient_predivide_factor
        self._synchronized = False
        self._should_synchronize = True
        self._steps_done = 0
        self._local = (LocalGradient(settings.local_gradient, settings.sync_period)
                       if settings.local_gradient else None)
        self.sync_period = settings.sync_period
        self._settings = settings
        self._compression_state_loaded = False

        transport = horovod_transport()
        rank, size = transport.rank(), transport.size()
        prefix = f"hvdsparse.o{next(_instance_counter)}"
        bind_compressor(compression, transport, prefix, prefix)
        compression.register_layers([(k, v.shape) for k, v in optimised])
        self._local_update = make_local_update(
            self, dict(optimised), size, compression, adam=adam,
            momentum_correction=momentum_correction, clip_grad_norm=settings.clip_grad_norm,
            masking=settings.momentum_masking)
        self._fingerprint = fingerprint(settings, compression)
        self._fingerprint.update(local_fingerprint(momentum_correction, adam, settings))
        self._hvdsparse = LayerScheduler(
            optimised, compression, settings, rank=rank, world_size=size, prefix=prefix,
            local=self._local, fingerprint=self._fingerprint, grad_scaler=grad_scaler,
            local_update=self._local_update, transport=transport)
        self._hvdsparse.register_hooks()

    # -------------------------------------------------------------- Horovod API
    @property
    def scheduler(self) -> LayerScheduler:
        """The layer scheduler (bucket plan, event log, statistics)."""
        return self._hvdsparse

    @property
    def compression(self):
        return self._compression

    def state_dict(self):
        """The wrapped optimizer's state plus an ``"hvdsparse"`` entry: the step counters
        (warm-up, seeds, local-gradient sync period continue from them) and the settings
        fingerprint. Residuals are per rank and NOT in here: save
        :meth:`compression_state_dict` on every rank (README: checkpoints)."""
        sd = super(self.__class__, self).state_dict()
        sd["hvdsparse"] = dict(scheduler_step=self._hvdsparse.step,
                               optimizer_steps=self._steps_done,
                               world_size=self._hvdsparse.world_size,
                               fingerprint=self._fingerprint)
        return sd

    def load_state_dict(self, state_dict):
        self._hvdsparse.reset()
        self._synchronized = False
        self._should_synchronize = True
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvdsparse", None)
        super(self.__class__, self).load_state_dict(state_dict)
        forget = getattr(self._local_update, "forget", None)
        if forget is not None:
            forget()                        # the Adam recipe's phases follow the loaded steps
        if extra is not None:
            self._hvdsparse.step = int(extra["scheduler_step"])
            self._steps_done = int(extra["optimizer_steps"])
            saved = extra.get("fingerprint", {}).get("compressor")
            if saved is not None and saved != self._fingerprint["compressor"]:
                warnings.warn("hvdsparse: the loaded optimizer state was saved with a "
                              f"different compressor configuration ({saved}); this run "
                              f"uses {self._fingerprint['compressor']}")
        if not self._compression_state_loaded:
            # said at the next step unless load_compression_state_dict comes first
            self._hvdsparse.pending_warning = (
                "hvdsparse: optimizer.load_state_dict() restored the optimizer without "
                "this rank's compression state: the residuals (error-feedback memory) of "
                "every compressed layer restart from zero and what they held is lost. "
                "Save optimizer.compression_state_dict() on every rank and load it with "
                "optimizer.load_compression_state_dict() (README: checkpoints)")

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
                # Horovod exchanges again here (only time is lost); with compression a
                # second exchange would re-compress the averaged gradient and advance
                # warm-up twice, so the gradients already synchronized are used as they are.
                warnings.warn("optimizer.step() called without "
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). hvdsparse does not exchange the "
                              "gradients a second time; use the "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            else:
                self.synchronize()
        self._synchronized = False
        if self._hvdsparse.skip_update:
            # nonfinite="skip": every rank skips this step (residuals were rolled back)
            self._hvdsparse.skip_update = False
            return None
        if self._local_update is not None and self._hvdsparse.active:
            with self._local_update.neutralised():   # momentum / wd applied before
                loss = super(self.__class__, self).step(closure)
        else:
            loss = super(self.__class__, self).step(closure)
        self._hvdsparse.step_applied()
        self._steps_done += 1
        if self._local is not None and self._local.should_sync(self._steps_done):
            sync_parameters([p for g in self.param_groups for p in g['params']],
                            self._hvdsparse.transport, name=f"{self._hvdsparse.prefix}.sync")
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
        if self._local_update is not None:
            sd[_state_key(self._local_update)] = self._local_update.state_dict()
        sd["scheduler_step"] = self._hvdsparse.step
        sd["optimizer_steps"] = self._steps_done
        sd["cost_history"] = self._hvdsparse.engine.history_state()
        return sd

    def load_compression_state_dict(self, sd: dict):
        self._compression.load_state_dict(sd)
        if self._local_update is not None and _state_key(self._local_update) in sd:
            self._local_update.load_state_dict(sd[_state_key(self._local_update)])
        self._compression_state_loaded = True
        self._hvdsparse.pending_warning = None
        if "scheduler_step" in sd:
            self._hvdsparse.step = int(sd["scheduler_step"])
        if "optimizer_steps" in sd:
            self._steps_done = int(sd["optimizer_steps"])
        if "cost_history" in sd:
            self._hvdsparse.engine.load_history_state(sd["cost_history"])


def _state_key(local_update) -> str:
    return getattr(local_update, "state_key", "momentum_correction")


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
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         *, settings: Optional[ExchangeSettings] = None, grad_scaler=None,
                         **options):
    """Wrap ``optimizer`` so that gradients are compressed and exchanged sparsely.

    Horovod's arguments (same names, order and meaning as ``hvd.DistributedOptimizer``),
    plus ``compression``, ``grad_scaler`` and hvdsparse's options: either one
    ``settings=`` (:class:`hvdsparse.ExchangeSettings`, e.g.
    ``ExchangeSettings.from_args(exchange="split")``) or the options below as keywords,
    which fill one. An unknown option, or options beside ``settings=``, raise an error
    naming them.

    Arguments (Horovod's meaning where the name is Horovod's):
        optimizer: the torch optimizer to wrap (SGD, Adam, AdamW, ...).
        named_parameters: ``model.named_parameters()``; names the collectives and the
            compressor's per-layer state.
        compression: an hvdsparse compressor instance (``hvdsparse.TopK(0.01)``, ...);
            default ``NoCompression()``. One instance per optimizer.
        backward_passes_per_step: backward passes accumulated locally before one
            exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, gradients are scaled by ``1/f`` before
            and ``f/size`` after the sum.
        fusion_threshold: bytes of encoded payload per bucket (default 1 MiB, or
            ``HVDSPARSE_FUSION_THRESHOLD``); 0 = one bucket per layer. Must be equal on
            every rank (checked at the first step).
        exchange: ``"auto"`` (per bucket by the cost model), ``"allgather"``,
            ``"split"`` or ``"dense"`` (see :mod:`hvdsparse.exchange`).
        local_gradient: None, ``"sum"``, ``"partial"`` or ``"error"``
            (:mod:`hvdsparse.local`); parameters are averaged every ``sync_period``
            steps.
        dense_dtype: ``"fp32"`` or ``"fp16"`` for the dense strategy's allreduce.
        split_dense_bits: 0 (fp32) or 8/4/2: quantise split's dense reduced ranges.
        quant_bucket: elements per scale of that quantisation.
        validate: host-validate received messages (default: on CPU yes, CUDA no).
        cuda_graphs: replay each bucket group's compress launches, and each allgathered
            bucket's encode and decode, as CUDA graphs (:mod:`hvdsparse.device_graphs`;
            default off, ``HVDSPARSE_CUDA_GRAPHS=1``).
        alpha_bytes: per-message latency charge of the auto cost model (bytes).
        nonfinite: ``"raise"`` (default), ``"skip"`` or ``"propagate"``: what a step
            does when a gradient holds NaN/Inf on some rank (:mod:`hvdsparse.settings`).
        sparse_as_dense: as Horovod: sparse gradients are made dense and compressed like
            any other layer (default: they go through Horovod's sparse allreduce).
        grad_scaler: a ``torch.amp.GradScaler``: residuals are kept in unscaled units
            and a step the scaler skips is rolled back (README: mixed precision).
        momentum_correction: DGC's momentum correction and momentum-factor masking for
            ``torch.optim.SGD`` with momentum (:mod:`hvdsparse.momentum`): the velocity is
            accumulated locally and compressed; the wrapped optimizer's momentum and
            weight decay are applied there instead. ``None`` (default): on for SGD with
            momentum around AdaComp, and TopK / Threshold at densities <= 0.25
            (with ``momentum_masking=True``: <= (1 - momentum) / 2), off otherwise
            (:func:`hvdsparse.momentum.resolve_momentum_correction`, measured by
            ``scripts/bench_convergence.py``); ``True`` / ``False``: as given.
        momentum_masking: with momentum correction, DGC's momentum-factor masking
            (``u[sent] = 0`` after each exchange). ``False`` (default, measured better
            on the digits CNN by ``scripts/bench_convergence.py``): the velocity of a sent
            coordinate is kept, so the ranks' sent velocities add up to the momentum SGD
            update, only delayed;
            ``True``: DGC's rule as published (:mod:`hvdsparse.momentum`).
        clip_grad_norm: DGC's local gradient clipping: each layer's local gradient is
            clipped to norm ``clip_grad_norm / sqrt(size)`` before it is accumulated.
        adam_recipe: the Adam / AdamW recipe (:mod:`hvdsparse.adam`, 1-bit Adam's
            frozen variance and compressed, scaled gradient after a dense warm-up). ``None``
            (default): on when ``optimizer`` is ``torch.optim.Adam`` / ``AdamW`` and the
            compressor compresses (not ``NoCompression``); ``True``: on (Adam / AdamW
            only); ``False``: off (the gradient is compressed and Adam applied to the
            exchanged average, as before).
        adam_warmup: dense, exact Adam steps before the compressed phase (per
            parameter, counted by Adam's ``state["step"]``); ``None``: on the update
            wire 1 (:data:`hvdsparse.adam.UPDATE_WARMUP`: the step that creates Adam's
            state), with Threshold or AdaComp (``adam_dense_while_rate_rises``) also
            every step at which the parameter's group's learning rate rises (a
            schedule's warm-up; a tensor ``lr`` is not read),
            :data:`hvdsparse.adam.DEFAULT_WARMUP` on the gradient and momentum
            wires, whose variance is frozen after it (not much under ~30% of a short
            run there: ``scripts/study_adam.py``).
        adam_refresh: the frozen variance's refresh period ``R``: every ``R``-th step
            from ``adam_refresh_start`` on sends each rank's local average of its
            squared gradient since the last refresh (dense) instead of its gradient,
            which goes out with the next step, and the variance advances by those steps
            (:mod:`hvdsparse.adam`; costs one dense step in ``R``). ``None`` (default):
            :data:`hvdsparse.adam.DEFAULT_REFRESH` (50) on the gradient wire, none on
            the others; ``0`` / ``False``: the variance stays frozen after the
            warm-up; an int ``>= 2`` (gradient wire only).
        adam_refresh_start: the Adam step ``S`` after which the refreshes start (the
            first at step ``S + R``); ``None`` (default): 3 x the warm-up, so runs of up
            to ``3 * adam_warmup`` steps keep the frozen variance (refreshing earlier
            measured worse on short runs); an int ``>= adam_warmup``.
        adam_wire: what travels after the warm-up: ``"update"`` (every rank's own Adam
            step from its own moments; nothing frozen, no refresh), ``"gradient"``
            (``g_i / D`` with ``v`` frozen and refreshed) or ``"momentum"`` (1-bit
            Adam's ``m_i / D``, ``v`` frozen for good). ``None`` (default): the
            gradient wire for a model with a recurrent layer (a parameter named
            ``...weight_hh...``, as torch's RNN / LSTM / GRU name theirs), else the
            update wire (:func:`hvdsparse.adam_settings.default_wire`; measured in
            BENCHMARKS "Transformer LM under AdamW").
    """
    import horovod.torch as hvd
    if op is None:
        op = hvd.Average
    compression = check_compressor(compression)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError('gradient_predivide_factor not supported with op != Average')
    if num_groups != 0 or groups is not None:
        raise ValueError("groups / num_groups are not supported with hvdsparse compressors: "
                         "buckets are formed by fusion_threshold (bytes of encoded payload)")
    if process_set is not None and process_set is not hvd.global_process_set:
        raise NotImplementedError("hvdsparse supports only the global process set")
    if op == hvd.Adasum:
        raise ValueError("op=hvd.Adasum is not supported by hvdsparse: sparse payloads are "
                         "summed (use hvd.Average or hvd.Sum)")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    if grad_scaler is not None and not hasattr(grad_scaler, "is_enabled"):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got "
                        f"{type(grad_scaler).__name__}")
    who = "hvdsparse.DistributedOptimizer"
    if "average" in options:
        raise TypeError(f"{who}: unknown option 'average' (Horovod's op= says it)")
    given = settings is not None
    settings = ExchangeSettings.from_options(settings, options, who)
    # Horovod's own arguments, validated as options are; one that is not at its default
    # fills the settings (and must agree with a settings= that sets it too)
    horovod = ExchangeSettings.from_args(
        average=(op == hvd.Average), gradient_predivide_factor=gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step, sparse_as_dense=sparse_as_dense)
    default, merged = ExchangeSettings(), {}
    for k in ("average", "gradient_predivide_factor", "backward_passes_per_step",
              "sparse_as_dense"):
        mine, theirs = getattr(horovod, k), getattr(settings, k)
        if mine != getattr(default, k):
            if given and theirs != getattr(default, k) and theirs != mine:
                raise ValueError(f"{who}: {k} is {mine!r} as an argument but {theirs!r} in "
                                 f"settings=")
            merged[k] = mine
    settings = dataclasses.replace(settings, **merged)
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    momentum_correction, adam = resolve_local_update(
        optimizer, compression, settings,
        [t[0] for t in named_parameters or () if isinstance(t, tuple) and t])

    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state initialises a fresh optimizer's state with the
    # *wrapped* optimizer's step when ``optimizer.__module__`` is Horovod's optimizer
    # module (it does so for its own DistributedOptimizer, to avoid an exchange that
    # not every rank would join); claim that module so it does the same for ours.
    cls.__module__ = "horovod.torch.optimizer"
    cls.__qualname__ = f"hvdsparse.DistributedOptimizer[{optimizer.__class__.__name__}]"
    return cls(optimizer.param_groups, named_parameters, compression, settings, grad_scaler,
               momentum_correction, adam)


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
