"""Layer-by-layer fusion scheduler: compress each layer as soon as its gradient is ready,
fill fixed buckets, launch one named collective per bucket while backward continues.

Per step
--------
1. Backward: a post-accumulate-grad hook per parameter (on the gradient accumulator, as
   Horovod does) counts down ``backward_passes_per_step``; at zero it compresses the
   (locally accumulated) ``p.grad`` into a :class:`LayerPayload` and marks the layer
   ready. When every layer of bucket ``b`` is ready, bucket ``b`` is launched (one named
   async collective, see :mod:`hvdsparse.exchange`). A layer that arrives out of order
   simply waits for the rest of its bucket, so buckets are identical on every rank
   whatever the hook order.
2. ``synchronize()``: layers without a gradient this step get ``p.grad = 0`` (as in
   Horovod: another rank may have one) and are compressed; unlaunched buckets are
   launched; then every bucket is waited for, decoded and summed, averaged
   (``op=Average``: ``G = sum / P``; ``gradient_predivide_factor`` f splits this into
   ``/f`` before and ``*f/P`` after the sum, which is exact in fp32 and used as Horovod's
   pre/post scale for the fp16 dense allreduce), optionally combined with the local
   gradient (:mod:`hvdsparse.local`), written to ``p.grad`` and passed to
   ``compressor.after_exchange``.

First step: the bucket plan
---------------------------
Buckets must be identical on all ranks. At the first ``synchronize()`` every rank
contributes, through one ``hvd.allgather_object``, the order in which its layers became
ready, each layer's numel and encoded payload size. The plan is computed on every rank
from **rank 0's** order and sizes (greedy: append layers in that order, close a bucket
once its encoded size reaches ``fusion_threshold`` bytes); the gathered sets, numels and
sizes are checked against rank 0's, and a mismatch raises the same error on every rank
naming the layer and the rank (no hang). From the second step on buckets are launched
from the hooks; during the first step they are launched in ``synchronize()``.

Payload capacities depend only on layer size, compressor settings and the step, so a
bucket's message length is equal on all ranks at every step.

Instrumentation
---------------
``events``: the current step's log -- ``("ready", name)``, ``("launch", bucket,
strategy)``, ``("backward_done",)`` (queued on the autograd engine by the first hook of
a backward pass, so it is logged when that backward pass finishes), ``("synchronize",)``,
``("finish", bucket)``. Cleared by the first hook after a ``synchronize()``.
``last_stats`` / ``totals``: bytes sent / received per strategy, strategy per bucket,
time spent compressing, waiting and decoding (host wall time, cheap).

Host synchronisation: the hooks never read device values (except the split strategy's
launch, which needs its per-range pair counts on the host for the alltoall splits);
``synchronize()`` waits on the handles, which is where Horovod synchronises too, and
with ``exchange="auto"`` reads one integer per bucket (the counts the cost model uses
at the next step) after the wait.
"""
from __future__ import annotations

import inspect
import time
from collections import defaultdict
from typing import Dict, List, Optional

import torch

from . import codec
from .exchange import ExchangeContext, BucketSpec, check_exchange, launch as launch_exchange
from .exchange import cost_model
from .exchange.split import pair_dtype

_HOROVOD_DELAY_MSG = ("Gradients were computed more than backward_passes_per_step times "
                      "before call to step(). Increase backward_passes_per_step to "
                      "accumulate gradients locally.")


def plan_buckets(order, sizes, fusion_threshold: int) -> List[List[str]]:
    """Greedy bucketing: layers in ``order``; a bucket closes once the sum of its
    encoded sizes reaches ``fusion_threshold`` bytes (so ``fusion_threshold=0`` puts
    every layer in its own bucket)."""
    buckets, cur, cur_bytes = [], [], 0
    for name in order:
        cur.append(name)
        cur_bytes += int(sizes[name])
        if cur_bytes >= fusion_threshold:
            buckets.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(cur)
    return buckets


class _BucketHistory:
    __slots__ = ("pairs", "reduced")

    def __init__(self):
        self.pairs: Optional[float] = None
        self.reduced: Optional[int] = None


class LayerScheduler:
    """See the module docstring. Owned by :class:`hvdsparse.DistributedOptimizer`."""

    def __init__(self, named_params, compressor, *, rank: int, world_size: int,
                 prefix: str, exchange: str = "auto", fusion_threshold: int = 1 << 20,
                 average: bool = True, gradient_predivide_factor: float = 1.0,
                 backward_passes_per_step: int = 1, dense_dtype=torch.float32,
                 split_dense_bits: int = 0, quant_bucket: int = 512,
                 validate: Optional[bool] = None, alpha_bytes: float = 0.0, local=None):
        self.exchange = check_exchange(exchange)
        self.compressor = compressor
        self.rank, self.world_size = int(rank), int(world_size)
        self.prefix = prefix
        self.fusion_threshold = int(fusion_threshold)
        self.average = bool(average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.dense_dtype = dense_dtype
        self.split_dense_bits = int(split_dense_bits)
        self.quant_bucket = int(quant_bucket)
        self.validate = validate
        self.alpha_bytes = float(alpha_bytes)
        self.local = local

        self.params: Dict[str, torch.Tensor] = {}
        self.names: Dict[int, str] = {}          # id(param) -> name
        for name, p in named_params:
            if p.requires_grad:
                self.params[name] = p
                self.names[id(p)] = name
        self._reg_order = list(self.params)
        self.step = 0
        self.plan: Optional[List[List[str]]] = None
        self._specs: List[BucketSpec] = []
        self._bucket_of: Dict[str, int] = {}
        self._history: List[_BucketHistory] = []
        self._delay = {n: self.backward_passes_per_step for n in self.params}
        self._payloads: Dict[str, object] = {}
        self._ready_order: List[str] = []
        self._ready_count: List[int] = []
        self._inflight: Dict[int, object] = {}
        self._cb_queued = False
        # Unvalidated (CUDA) decode: the kernels flag bad indices in a device int32[1]
        # instead of raising. Reading it right after decoding would stall the host until
        # the decode kernels finish, so each step's flag is read at the next step's
        # synchronize(), when it is long done (the error surfaces one step late).
        self._error_flag: Optional[torch.Tensor] = None
        self._error_flag_step = -1
        self._dirty = False
        self._clear_events = False
        self.events: List[tuple] = []
        self.last_stats: dict = {}
        self.totals: dict = _empty_totals()
        self._t_compress = 0.0
        self._hook_handles = []
        try:
            sig = inspect.signature(compressor.after_exchange).parameters
            self._after_takes_param = "param" in sig
        except (TypeError, ValueError):
            self._after_takes_param = False

    # ------------------------------------------------------------------ hooks
    def register_hooks(self):
        for name, p in self.params.items():
            if hasattr(p, "register_post_accumulate_grad_hook"):
                h = p.register_post_accumulate_grad_hook(self._make_hook(name))
            else:  # older torch: Horovod's way, a hook on the AccumulateGrad node
                grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                h = grad_acc.register_hook(lambda *a, _n=name: self._on_grad(_n))
                self._grad_accs = getattr(self, "_grad_accs", []) + [grad_acc]
            self._hook_handles.append(h)

    def remove_hooks(self):
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    def _make_hook(self, name):
        def hook(_param):
            self._on_grad(name)
        return hook

    def _backward_done(self):
        self._cb_queued = False
        self.events.append(("backward_done",))

    def _on_grad(self, name: str):
        if self._clear_events:
            self.events.clear()
            self._clear_events = False
        if not self._cb_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                self._cb_queued = True
            except RuntimeError:
                pass
        if name in self._payloads:
            raise AssertionError(_HOROVOD_DELAY_MSG + f" (parameter {name!r})")
        p = self.params[name]
        if p.grad is None or p.grad.requires_grad:
            raise AssertionError(f"hvdsparse: parameter {name!r} has no plain gradient in "
                                 f"its accumulate-grad hook")
        self._dirty = True
        self._delay[name] -= 1
        if self._delay[name] > 0:
            return
        self._compress(name)
        if self.plan is not None:
            b = self._bucket_of[name]
            self._ready_count[b] += 1
            if self._ready_count[b] == len(self._specs[b].names):
                self._launch(b)
        for pend in self._inflight.values():
            pend.advance()

    def _compress(self, name: str):
        p = self.params[name]
        t0 = time.perf_counter()
        with torch.no_grad():
            payload = self.compressor.compress(name, p.grad, self.step, param=p.detach())
        self._t_compress += time.perf_counter() - t0
        self._payloads[name] = payload
        self._ready_order.append(name)
        self.events.append(("ready", name))

    # ------------------------------------------------------------------ buckets
    def _ctx(self, want_figures: bool) -> ExchangeContext:
        validate = self.validate
        if validate is None:
            dev = next(iter(self.params.values())).device if self.params else None
            validate = dev is None or dev.type == "cpu"
        flag = None
        if not validate:
            if self._error_flag_step != self.step:
                self._check_error_flag()
                dev = next(iter(self.params.values())).device
                self._error_flag = torch.zeros(1, dtype=torch.int32, device=dev)
                self._error_flag_step = self.step
            flag = self._error_flag
        return ExchangeContext(rank=self.rank, world_size=self.world_size, prefix=self.prefix,
                               step=self.step, validate=validate, error_flag=flag, dense_dtype=self.dense_dtype,
                               gradient_predivide_factor=self.gradient_predivide_factor,
                               split_dense_bits=self.split_dense_bits,
                               quant_bucket=self.quant_bucket, want_figures=want_figures)

    def figures(self, b: int, payloads) -> cost_model.BucketFigures:
        """The rank-independent figures the auto cost model reads for bucket ``b``."""
        spec, hist = self._specs[b], self._history[b]
        cap = sum(int(s.capacity) for p in payloads for s in p.segments)
        vb = torch.tensor([], dtype=pair_dtype(payloads)).element_size()
        return cost_model.BucketFigures(
            world_size=self.world_size, numel=spec.numel,
            wire_nbytes=codec.encoded_nbytes(payloads), capacity=cap,
            sparse_value_bytes=vb,
            dense_value_bytes=torch.tensor([], dtype=self.dense_dtype).element_size(),
            split_dense_bits=self.split_dense_bits, quant_bucket=self.quant_bucket,
            prev_pairs=hist.pairs, prev_reduced=hist.reduced)

    def strategy_for(self, b: int, payloads) -> str:
        if self.exchange != "auto":
            return self.exchange
        return cost_model.choose(self.figures(b, payloads), alpha_bytes=self.alpha_bytes)

    def _launch(self, b: int):
        spec = self._specs[b]
        payloads = [self._payloads[n] for n in spec.names]
        strategy = self.strategy_for(b, payloads)
        pend = launch_exchange(strategy, spec, payloads, self._ctx(self.exchange == "auto"))
        self._inflight[b] = pend
        self.events.append(("launch", b, strategy))

    def _build_plan(self):
        import horovod.torch as hvd
        sizes = {n: codec.encoded_nbytes([self._payloads[n]]) for n in self._ready_order}
        numels = {n: int(self.params[n].numel()) for n in self._ready_order}
        mine = dict(order=list(self._ready_order), sizes=sizes, numels=numels)
        everyone = hvd.allgather_object(mine, name=f"{self.prefix}.plan")
        ref = everyone[0]
        problems = []
        for r, d in enumerate(everyone):
            missing = sorted(set(ref["order"]) - set(d["order"]))
            extra = sorted(set(d["order"]) - set(ref["order"]))
            if missing or extra:
                problems.append(f"rank {r} has parameters {extra} that rank 0 lacks and lacks "
                                f"{missing}" if extra else
                                f"rank {r} lacks parameters {missing} that rank 0 has")
                continue
            for n in ref["order"]:
                if d["numels"][n] != ref["numels"][n]:
                    problems.append(f"parameter {n!r} has {d['numels'][n]} elements on rank "
                                    f"{r} but {ref['numels'][n]} on rank 0")
                elif d["sizes"][n] != ref["sizes"][n]:
                    problems.append(f"parameter {n!r}: encoded payload is {d['sizes'][n]} "
                                    f"bytes on rank {r} but {ref['sizes'][n]} on rank 0 "
                                    f"(compressor settings differ across ranks?)")
        if problems:
            raise ValueError("hvdsparse: ranks disagree on the model: " + "; ".join(problems))
        self.plan = plan_buckets(ref["order"], ref["sizes"], self.fusion_threshold)
        self._specs = [BucketSpec.build(b, names, [ref["numels"][n] for n in names])
                       for b, names in enumerate(self.plan)]
        self._bucket_of = {n: b for b, names in enumerate(self.plan) for n in names}
        self._history = [_BucketHistory() for _ in self.plan]
        self._ready_count = [0] * len(self.plan)

    # ------------------------------------------------------------------ step
    def pending(self) -> bool:
        return self._dirty or bool(self._payloads) or bool(self._inflight)

    def _check_error_flag(self):
        """Raise if the previous unvalidated decode met an out-of-range index (1) or a
        count outside [0, capacity] (2) in a received message."""
        flag, step = self._error_flag, self._error_flag_step
        self._error_flag = None
        if flag is not None:
            code = int(flag.item())
            if code:
                what = {1: "an index outside its layer", 2: "a count above its capacity"}
                raise RuntimeError(
                    f"hvdsparse: a message received at step {step} carried "
                    f"{what.get(code, f'error code {code}')}; those entries were skipped. "
                    f"The ranks disagree on the bucket layout or a message was corrupted "
                    f"(rerun with validate=True to find the rank and segment)")

    def synchronize(self):
        """Flush, wait, decode, average and write ``p.grad`` for every parameter."""
        self.events.append(("synchronize",))
        order = self.plan_order() if self.plan is not None else reversed(self._reg_order)
        for name in list(order):
            if name not in self._payloads:
                p = self.params[name]
                if p.grad is None:
                    p.grad = p.data.new(p.size()).zero_()
                self._compress(name)
        if self.plan is None:
            self._build_plan()
        for b in range(len(self._specs)):
            if b not in self._inflight:
                self._launch(b)
        P = self.world_size
        scale = 1.0 / P if self.average else 1.0
        buckets, sent, recv = [], defaultdict(int), defaultdict(int)
        t_wait = t_dec = 0.0
        for b, spec in enumerate(self._specs):
            pend = self._inflight[b]
            total = pend.finish()
            t0 = time.perf_counter()
            self.events.append(("finish", b))
            total.mul_(scale)
            for name, view in zip(spec.names, spec.views(total)):
                self._apply(name, view)
            t_dec += pend.decode_s + time.perf_counter() - t0
            t_wait += pend.wait_s
            hist = self._history[b]
            if "pairs" in pend.figures:
                hist.pairs = pend.figures["pairs"]
            if "reduced" in pend.figures:
                hist.reduced = pend.figures["reduced"]
            sent[pend.strategy] += pend.sent_bytes
            recv[pend.strategy] += pend.recv_bytes
            buckets.append(dict(id=b, layers=list(spec.names), numel=spec.numel,
                                strategy=pend.strategy, sent_bytes=pend.sent_bytes,
                                recv_bytes=pend.recv_bytes, figures=dict(pend.figures)))
        n_total = sum(s.numel for s in self._specs)
        self.last_stats = dict(
            step=self.step, world_size=P, buckets=buckets,
            strategies=[bk["strategy"] for bk in buckets],
            bytes_sent=dict(sent), bytes_recv=dict(recv),
            bytes_sent_total=int(sum(sent.values())), bytes_recv_total=int(sum(recv.values())),
            dense_allreduce_bytes=int(cost_model.dense_allreduce_bytes(P, n_total)),
            time_compress_s=self._t_compress, time_wait_s=t_wait, time_decode_s=t_dec)
        _add_totals(self.totals, self.last_stats)
        # reset for the next step
        self.step += 1
        self._payloads.clear()
        self._ready_order.clear()
        self._inflight.clear()
        self._ready_count = [0] * len(self._specs)
        self._delay = {n: self.backward_passes_per_step for n in self.params}
        self._t_compress = 0.0
        self._dirty = False
        self._clear_events = True

    def _apply(self, name: str, g_flat: torch.Tensor):
        p = self.params[name]
        g = g_flat.view(p.shape)
        payload = self._payloads[name]
        if self.local is not None:
            c = self.local.combine(name, g, p.grad, payload, self.compressor,
                                   1.0 / self.world_size if self.average else 1.0)
        else:
            c = g
        with torch.no_grad():
            if p.grad.shape == p.shape and not p.grad.is_sparse:
                p.grad.copy_(c)
            else:
                p.grad = c.to(p.dtype).clone()
        if self._after_takes_param:
            self.compressor.after_exchange(name, g, self.step, param=p.detach())
        else:
            self.compressor.after_exchange(name, g, self.step)

    def plan_order(self) -> List[str]:
        return [n for names in (self.plan or []) for n in names]

    def reset(self):
        """Drop everything in flight-free state (load_state_dict, as Horovod)."""
        self._payloads.clear()
        self._ready_order.clear()
        self._inflight.clear()
        self._dirty = False
        self._ready_count = [0] * len(self._specs)
        self._delay = {n: self.backward_passes_per_step for n in self.params}

    def set_backward_passes_per_step(self, passes: int):
        self.backward_passes_per_step = int(passes)
        self._delay = {n: self.backward_passes_per_step for n in self.params}


def _empty_totals() -> dict:
    return dict(steps=0, bytes_sent={}, bytes_recv={}, bytes_sent_total=0,
                bytes_recv_total=0, dense_allreduce_bytes=0, strategy_counts={},
                time_compress_s=0.0, time_wait_s=0.0, time_decode_s=0.0)


def _add_totals(t: dict, s: dict):
    t["steps"] += 1
    for key in ("bytes_sent", "bytes_recv"):
        for k, v in s[key].items():
            t[key][k] = t[key].get(k, 0) + v
    for key in ("bytes_sent_total", "bytes_recv_total", "dense_allreduce_bytes",
                "time_compress_s", "time_wait_s", "time_decode_s"):
        t[key] += s[key]
    for st in s["strategies"]:
        t["strategy_counts"][st] = t["strategy_counts"].get(st, 0) + 1
