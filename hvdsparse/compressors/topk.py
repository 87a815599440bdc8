"""Top-k sparsification with error feedback (TopK SGD; SparCML's quantised top-k).

Per layer and step, with ``acc = residual + grad`` (fp32) and ``d_t`` the density of
the step (``ratio``, or the warm-up schedule's value):

    k   = ceil(d_t * n)
    S   = {i : |acc_i| >= tau}      with tau ~ the k-th largest |acc|
    sent_i = deq(Q(acc_i)) for i in S (at most ``capacity`` of them), residual = acc - sent

Three selection modes:

``exact=True``
    a true top-k of ``|acc|``; capacity ``k``; exactly ``min(k, #nonzero)`` elements
    are sent (exact zeros never are). Ties at the k-th value go to the lower index (one
    ``torch.topk`` over an int64 key of value and index, so the choice does not depend
    on the kernel: an oracle can reproduce it). For tests and small layers.

default: sampled threshold estimate + fused select (no sort of the whole layer)
    capacity ``C = min(n, ceil(slack * k))`` (``slack=1.5``). Aim: a count in
    ``[k, C]``, target ``m = (k + C) / 2``. On the exact route (step 2: the sample
    would be the whole layer) the capacity is ``k`` itself: the threshold is the k-th
    largest, so the slack would only travel as padding (ties at the threshold beyond
    ``k`` stay in the residual).

    1. ``acc = residual + grad`` with ``ops.residual_add_binmax`` (one fused pass).
    2. Strided sample of ``s = min(n, max(4096, ceil(256 n / m)))`` elements
       (``acc[o::n//s][:s]``, offset ``o`` from the step's seed, identical across
       ranks is not required), so ~256 sampled elements lie above the target
       threshold. If ``s > n/2`` the sample is the whole layer and the threshold is the
       exact k-th largest ``|acc|`` (small layers: no estimate at all).
    3. ``v = topk(|sample|, min(s, 4 r0 + 16))`` sorted descending, with sample rank
       ``r0 = round(m s / n)``; first estimate ``tau = v[r0]``.
    4. ``rounds`` (default 2) refinement rounds, each one counting pass over the layer:
       ``c = #{|acc| >= tau}``; if ``k <= c <= C`` keep ``tau``; else move along the
       sample's empirical CDF, ``r <- clamp(round(r * m / c), 1, len(v))``,
       ``tau = v[r]``. All on the device, no host synchronisation: on the Triton path
       one launch per round plus one for the result (``kernels/refine.py``), on the CPU
       path one fused chunked counting pass per round.
    5. ``tau = max(tau, TINY)``; ``ops.select_compact(acc, tau, C)`` writes indices,
       values, ``count = [sent, selected]`` and the residual in the same pass.

    How far the count may miss k: ``sent <= C = ceil(1.5 k)`` always (``selected``
    elements beyond ``C`` are not sent and stay in the residual; which ones is the
    kernel's slot order: ascending index on CPU). ``selected`` itself is not bounded
    below by construction: with ~256 sampled elements expected above the target the
    first estimate has a relative count error of ~1/sqrt(256) = 6% (plus the
    sample-rank rounding), and each refinement round re-reads the count. Measured on
    i.i.d. normal, Laplace, log-normal and Student-t(2) magnitudes, n = 2e4 .. 4e6,
    density 1e-3 .. 0.1: ``selected`` in ``[1.0 k, 1.4 k]`` (target 1.25 k);
    tests/test_compressors.py asserts ``[0.9 k, C]`` on fresh data every run.
    Not covered: heavy ties at the threshold (``selected`` can then exceed ``C`` by
    far; exactly ``C`` are sent), data whose large values are periodic with the
    sampling stride, or gaps in the magnitude distribution (``selected`` may fall
    below ``k``); error feedback keeps whatever was not sent. Small layers
    (``2 s > n``, e.g. below ~50k elements at 1% density) get the exact k-th largest
    value instead.

``fresh_weight=w`` (AdaComp's emphasis on the newest gradient, in top-k form)
    with ``x`` this step's input (the cleaned gradient, or the Adam recipe's update):
    the exact ``k`` largest of the *score* ``|acc + w x|`` (ties to the lower index, as
    ``exact``) are sent, their ``acc`` values as above, capacity ``k``; the residual is
    ``acc - sent`` as always. ``w = 0``: the modes above. ``w > 0`` always selects
    exactly (a sampled estimate would rank ``|acc|``, not the score), not with
    ``per_bucket``; on the bucket path (Triton) only as the Adam recipe's update wire
    (``hvdsparse/adam_bucket.py``), by a radix select of the score (of the scores equal
    to the k-th, those a GPU's blocks reserve first). Default (``None``):
    ``UPDATE_WIRE_FRESH_WEIGHT`` (2) on the Adam recipe's update wire
    (:mod:`hvdsparse.adam`; where an annealed learning rate makes ``acc`` mostly old,
    large updates, ranking them against the newest one keeps the selection current: on
    the GPT-style LM, P = 2, 3 seeds, the same bytes, warm-up + cosine: -1.4% of dense's
    loss with ``w = 2``, +0.0% with 1, +19.4% with 0; constant rate: -6.9%, -4.75%, +4.0%
    (sampled); BENCHMARKS "Transformer LM under AdamW"), ``0`` otherwise.

``per_bucket=B`` (SparCML's per-bucket top-k, e.g. k = 4 .. 16 of every 512)
    the layer is split into buckets of ``B`` consecutive elements (last one partial)
    and the exact ``kb = ceil(d_t * B)`` largest ``|acc|`` of every bucket are sent
    (exact zeros excepted), capacity ``ceil(n/B) * kb``. Indices travel bucket-relative
    (BIN_U8 for ``B <= 256``, BIN_U16 otherwise) with per-bucket counts. Uses
    ``torch.topk`` along the bucket dimension (no global sort).

Values (``values=``; ``None``, the default: bf16 on the Adam recipe's update wire,
:data:`UPDATE_WIRE_VALUES`, fp32 elsewhere): fp32 (sent exactly, residual 0), fp16 / bf16
(cast by the fused select, residual = cast error; a value beyond the format's largest
finite one, e.g. |acc| > 65504 for fp16, is sent saturated and its excess stays in the
residual: ``payload.to_wire_float``), int8 / int4 / int2 (SparCML's quantised top-k: the
selected values are stochastically rounded with ``ops.quantize_pack``, one fp32 scale
per ``quant_bucket`` slots). Residual fix-up for quantised values: the select writes
``residual_i = 0`` for the sent elements, then ``residual_i += v_i - deq(Q(v_i))`` is
scattered back on exactly those ``count`` slots, so ``sent + residual == acc`` up to
one fp32 rounding and ``|residual_i| <= scale_b / (2^(bits-1) - 1)``. (Deviation:
SparCML's Algorithm 1 keeps ``acc - TopK(acc)`` as the error, i.e. drops the
quantisation error; we keep it.)

``error_feedback=False`` drops what is not sent (plain top-k, biased).

On the Adam recipe's update wire with fp16 / bf16 values the layers the size / 1-D rule
keeps dense (biases, norms, small layers) travel *whole* (``adam_small_layers_whole``,
``policy.is_whole``): every element of ``acc`` in the value encoding, the rounding kept
in the residual, under every rank's own Adam moments (:mod:`hvdsparse.adam`).

The output layer (``output_ratio``, default 0.1): the model's last compressed parameter
in the optimizer's order (``model.named_parameters()``: the classifier / LM head of
almost every model) is sent at ``max(ratio, output_ratio)``. Its gradient is dense --
every example moves every class row -- so at 1% each of its coordinates waits ~100
steps in the residual and then lands as one large, stale step; the curves oscillate.
Measured with SGD momentum + momentum correction, the head at 10% instead of 1%
narrowed the accuracy gap to dense and cut the steps to 95% on every workload tried
(digits MLP and CNN, the network benchmark's 4.35 M MLP; P = 2 and 4), for 4-14% more
bytes. The layer is chosen once, from the
names and shapes the optimizer registers (:meth:`register_layers`), identically on
every rank; an ``overrides`` entry that sets ``ratio`` for it wins (as does one that
sends it dense: then no layer gets the rule), and
``output_ratio=None`` turns the rule off (e.g. for a model whose last registered
weight is not its output layer, such as one with a head tied to its embedding).

If the fixed-capacity sparse payload would not be smaller than the dense layer in the
same value encoding (e.g. densities > ~0.5 during warm-up), the layer goes dense
(DENSE segment in the value encoding, the residual flushed to its quantisation error).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import ops
from ..codec import cached_arange
from ..payload import FLOAT_DTYPES, QUANT_BITS, IndexEncoding, LayerPayload, Segment, \
    ValueEncoding, bin_count_width
from .base import (PURPOSE_QUANT, PURPOSE_SAMPLE, TINY, Compressor, binned_topc, ceil_div,
                   check_values, k_of)
from .checks import check_bool, check_density, check_fresh_weight, check_quant_bucket, prefixed
from .encoding import value_name
from .warmup import make_warmup

__all__ = ["TopK", "estimate_topk_threshold", "UPDATE_WIRE_FRESH_WEIGHT",
           "UPDATE_WIRE_VALUES"]

#: ``fresh_weight``'s default on the Adam recipe's update wire (TopK and Threshold; 0
#: elsewhere): the weight ``w`` of the newest update in the score ``|acc + w x|``
UPDATE_WIRE_FRESH_WEIGHT = 2.0

#: TopK's and Threshold's ``values`` default on the Adam recipe's update wire (fp32
#: elsewhere): bf16, its rounding error kept in the residual. On the GPT-style LM (3 seeds,
#: the same selection) TopK ended -8.3% / -1.3% of dense's loss at P = 2 (constant rate /
#: warm-up + cosine; fp32: -6.9% / -1.4%) and -3.0% / +3.3% at P = 4 (fp32: -2.7% /
#: +3.6%), at 38x / 20x fewer bytes than dense where fp32 values are at 29x / 15x;
#: Threshold (its tau following the rate) +0.6% / +2.5% under warm-up + cosine at P = 2 /
#: 4 (fp32: +0.7% / +2.7%) at 11.2x / 7.8x over the run (fp32: 9.6x / 6.3x)
#: (BENCHMARKS "Transformer LM under AdamW")
UPDATE_WIRE_VALUES = "bf16"


def sample_layout(n: int, k: int, capacity: int, offset: int = 0, sample_min: int = 4096,
                  sample_above: int = 256):
    """The strided sample of :func:`estimate_topk_threshold` (module docstring, step 2):
    ``None`` when it would be the whole layer (``2 s > n``: the exact route), else
    ``(s, stride, off, r0, m)`` -- sample size, stride, first index, first sample rank,
    number of sorted sample magnitudes kept. Host integers only (the bucket path,
    compressors/topk_bucket.py, lays out its table from the same rule)."""
    target = 0.5 * (k + capacity)
    s = min(n, max(sample_min, math.ceil(sample_above * n / target)))
    if 2 * s > n:
        return None
    stride = n // s
    r0 = max(1, min(s, round(target * s / n)))
    return s, stride, offset % stride, r0, min(s, 4 * r0 + 16)


def estimate_topk_threshold(acc: torch.Tensor, k: int, capacity: int, offset: int = 0,
                            rounds: int = 2, sample_min: int = 4096,
                            sample_above: int = 256, abs_out: Optional[torch.Tensor] = None,
                            counts: Optional[torch.Tensor] = None,
                            first_count=None) -> torch.Tensor:
    """Sampled estimate of a threshold ``tau`` with ``k <= #{|acc| >= tau} <= capacity``
    (see the module docstring for the algorithm and its guarantees). Returns a 0-d fp32
    device tensor ``>= TINY``; never synchronises with the host.

    ``abs_out`` (fp32[n]): optional reused buffer for ``|acc|`` when the whole layer is
    the sample; ``counts`` (int32[>= rounds]): optional reused scratch for the Triton
    path's per-round counts (the compressors pass their scratch buffers).

    ``first_count``: CPU path only, optional callable ``t -> count`` used for the first
    refinement round's count of the sampled estimate instead of a counting pass (TopK
    passes its select, which counts while it selects; see ``TopK._compress``); it
    must return exactly ``#{|acc| >= t}`` and leave ``acc`` as it found it."""
    lay = sample_layout(acc.numel(), k, capacity, offset, sample_min, sample_above)
    if lay is None:
        a = torch.abs(acc, out=abs_out) if abs_out is not None else acc.abs()
        t = torch.topk(a, k, sorted=False).values.min()
        return t.clamp_min(TINY)
    s, stride, off, r0, m = lay
    sample = acc[off::stride][:s].abs()
    v = torch.topk(sample, m, sorted=True).values       # descending
    # the refinement: on the CPU each count is one fused chunked pass, skipped when tau
    # did not move; on the Triton path one launch per round and one for the result
    return ops.refine_topk_threshold(acc, v, k, capacity, r0, rounds, counts=counts,
                                     first_count=first_count)


class TopK(Compressor):
    """``TopK(ratio, exact=False, values=None, per_bucket=None, slack=1.5, rounds=2,
    quant_bucket=512, warmup=None, error_feedback=True, output_ratio=0.1,
    fresh_weight=None, **policy)``.

    ``ratio`` in (0, 1]: target density k/n. ``warmup``: a schedule from
    :mod:`.warmup` (``RtWarmup(T)``, ``ExponentialWarmup(T, stages)``) or
    ``("rt", T)`` / ``("exp", T, stages)``. ``output_ratio`` (default 0.1, ``None``:
    off): density floor of the output layer (module docstring). ``values=None``:
    :data:`UPDATE_WIRE_VALUES` (bf16) on the Adam recipe's update wire without
    ``per_bucket``, fp32 otherwise. Policy keywords:
    ``min_numel``, ``compress_1d``, ``overrides``, ``seed``. See the module docstring
    for the math.
    """

    _settings = ("ratio", "exact", "values", "per_bucket", "slack", "rounds",
                 "quant_bucket", "error_feedback", "fresh_weight")
    _extra_args = ("output_ratio",)
    #: the layer ``output_ratio`` applies to (set by :meth:`register_layers`)
    output_layer = None
    #: on the update wire with fp16 / bf16 values the biases and norms travel whole
    #: (``policy.is_whole``): on the GPT-style LM the same loss as fp32 with exact Adam
    #: (within 0.55 point either way, P = 2 and 4, constant and warm-up + cosine, 3
    #: seeds) at 15-17% fewer bytes (BENCHMARKS "Transformer LM under AdamW")
    adam_small_layers_whole = True

    def __init__(self, ratio: float, exact: bool = False, values=None, per_bucket=None,
                 slack: float = 1.5, rounds: int = 2, quant_bucket: int = 512,
                 warmup=None, error_feedback: bool = True, output_ratio=0.1,
                 fresh_weight=None, **kw):
        super().__init__(**kw)
        self._set_output_ratio(output_ratio)
        cfg = self._validate_cfg(dict(ratio=ratio, exact=exact, values=values,
                                      per_bucket=per_bucket, slack=slack, rounds=rounds,
                                      quant_bucket=quant_bucket,
                                      error_feedback=error_feedback,
                                      fresh_weight=fresh_weight))
        for key, v in cfg.items():
            setattr(self, key, v)
        self.warmup = make_warmup(warmup)
        self._validate_overrides()

    def _validate_cfg(self, cfg, where=""):
        cfg = dict(cfg)
        cfg["ratio"] = check_density(cfg["ratio"], where + "ratio")
        check_bool(cfg["exact"], "exact", where)
        if cfg["values"] is not None:           # None: follows the wire (values_of)
            cfg["values"] = check_values(cfg["values"]) if not where else \
                prefixed(check_values, cfg["values"], where)
        pb = cfg["per_bucket"]
        if pb is not None and (not isinstance(pb, int) or isinstance(pb, bool)
                               or not 1 <= pb <= 65536):
            raise ValueError(f"{where}per_bucket must be None or an int in [1, 65536], "
                             f"got {pb!r}")
        sl = cfg["slack"]
        if not isinstance(sl, (int, float)) or isinstance(sl, bool) or not 1.0 <= sl < 1e6:
            raise ValueError(f"{where}slack must be a number >= 1, got {sl!r}")
        r = cfg["rounds"]
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r <= 16:
            raise ValueError(f"{where}rounds must be an int in [0, 16], got {r!r}")
        check_quant_bucket(cfg["quant_bucket"], where)
        check_bool(cfg["error_feedback"], "error_feedback", where)
        w = cfg["fresh_weight"] = check_fresh_weight(cfg.get("fresh_weight"), where)
        if w is not None:
            if w and pb is not None:
                raise ValueError(f"{where}fresh_weight={w!r} cannot be combined with "
                                 f"per_bucket={pb!r} (it ranks the whole layer)")
        return cfg

    def fresh_weight_of(self, cfg: dict) -> float:
        """The layer's ``fresh_weight`` in force: its setting, or with ``None``
        :data:`UPDATE_WIRE_FRESH_WEIGHT` on the Adam recipe's update wire
        (``adam_update_wire``, set by the front door) without ``per_bucket``, and 0
        otherwise."""
        w = cfg.get("fresh_weight")
        if w is None:
            return UPDATE_WIRE_FRESH_WEIGHT if self.adam_update_wire and \
                not cfg.get("per_bucket") else 0.0
        return w

    def values_of(self, cfg: dict) -> ValueEncoding:
        """The value encoding in force for ``values=None``: :data:`UPDATE_WIRE_VALUES` on
        the Adam recipe's update wire (``adam_update_wire``) without ``per_bucket``, fp32
        otherwise."""
        if self.adam_update_wire and not cfg.get("per_bucket"):
            return check_values(UPDATE_WIRE_VALUES)
        return ValueEncoding.FP32

    def layer_cfg_values(self) -> ValueEncoding:
        base = self._base_cfg()
        return self.values_of(base) if base["values"] is None else check_values(base["values"])

    def comparable_settings(self, settings: dict) -> dict:
        """``settings`` (plain data, as :meth:`config` gives them) with ``values=None``
        read as the encoding in force, so a checkpoint saved with the encoding now in
        force loads."""
        if settings.get("values") is None:
            settings = dict(settings, values=value_name(self.values_of(settings)))
        return settings

    def _set_output_ratio(self, output_ratio) -> None:
        """Validate and keep ``output_ratio`` (None, or a density in (0, 1])."""
        if output_ratio is not None:
            output_ratio = check_density(output_ratio, "output_ratio")
        self.output_ratio = output_ratio

    def _register_layers(self, named_shapes):
        """The output layer: the last registered layer the size rule would compress
        (biases and small layers after it are skipped), unless an override sets its
        ``ratio`` or sends it dense: then no layer gets the rule, rather than the one
        before the head (an MLP projection) getting 10x its density."""
        self.output_layer = None
        if self.output_ratio is None:
            return
        for name, shape in reversed(named_shapes):
            if self.policy.dense_by_shape(name, shape):
                continue
            if not (self.policy.is_dense(name, shape)
                    or self._density_key in self.policy.match(name)):
                self.output_layer = name
            break
        self._cfg_cache.clear()

    #: the setting that sets a layer's density (an override of it disables the rule)
    _density_key = "ratio"
    #: the scheduler may compress this compressor's layers a bucket at a time on the
    #: device path (compressors/topk_bucket.py)
    bucket_path = True

    def error_feedback_density(self) -> Optional[float]:
        return self.ratio if self.error_feedback else None

    def _output_cfg(self, cfg: dict) -> dict:
        """The output layer's settings: density at least ``output_ratio``."""
        return dict(cfg, ratio=max(cfg["ratio"], self.output_ratio))

    def layer_cfg(self, name: str) -> dict:
        cfg = self._cfg_cache.get(name)
        if cfg is None:
            cfg = super().layer_cfg(name)
            if name == self.output_layer:
                cfg = self._output_cfg(cfg)
            if "fresh_weight" in self._settings:
                cfg = dict(cfg, fresh_weight_in_force=self.fresh_weight_of(cfg))
            if cfg["values"] is None:
                cfg = dict(cfg, values=self.values_of(cfg))
            self._cfg_cache[name] = cfg
        return cfg

    def _target_density(self, name: str) -> float:
        return self.layer_cfg(name)["ratio"]

    def density(self, step: int, ratio=None) -> float:
        """Target density at ``step`` (warm-up applied)."""
        ratio = self.ratio if ratio is None else ratio
        return self.warmup(step, ratio) if self.warmup is not None else ratio

    def capacity(self, numel: int, step: int, name: str = "") -> int:
        """Slots of the (first) segment for a layer of ``numel`` elements at ``step``
        (depends on nothing else)."""
        cfg = self.layer_cfg(name) if name else self._base_cfg()
        d = self.density(step, cfg["ratio"])
        if cfg["per_bucket"]:
            B = cfg["per_bucket"]
            return ceil_div(numel, B) * k_of(d, min(B, numel))
        return self._k_and_capacity(numel, d, cfg)[1]

    @staticmethod
    def _k_and_capacity(n: int, d: float, cfg: dict):
        """``(k, capacity)`` of a layer of ``n`` elements at density ``d`` (not
        ``per_bucket``): ``capacity = k`` with ``exact``, and on the sampled estimate's
        exact route (:func:`sample_layout` is ``None``: the threshold is the k-th largest
        ``|acc|``, so exactly k pass it unless values tie there); else ``min(n, ceil(slack
        k))``, the room the estimate's count needs. Slack on the exact route would only
        travel as padding (the capacity is what the fixed-size messages carry)."""
        k = k_of(d, n)
        if cfg["exact"] or cfg.get("fresh_weight_in_force"):
            return k, k
        cap = min(n, math.ceil(cfg["slack"] * k))
        return k, (k if sample_layout(n, k, cap) is None else cap)

    # ------------------------------------------------------------------
    def _exact_top(self, a: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the ``k`` largest of ``a = |acc|``, largest first, ties to the lower
        index: one ``torch.topk`` over the int64 key ``bits(a) * 2^32 + (2^32 - 1 - i)``
        (a non-negative float's bits order as its value, NaN above +inf as torch.topk
        puts it; ``torch.topk`` itself leaves the order of equal values unspecified).
        The key lives in a reused scratch buffer, the indices in the codec's cached
        arange."""
        n = a.numel()
        key = self._scratch_buf("exact_key", n, torch.int64, a.device)
        key.copy_(a.view(torch.int32))
        idx = cached_arange(n, torch.int64, a.device)
        key.bitwise_left_shift_(32).sub_(idx).add_(0xFFFFFFFF)
        return torch.topk(key, k, sorted=True).indices

    def _abs_buf(self, acc):
        """``|acc|`` into the reused fp32 scratch buffer (no per-step allocation)."""
        return torch.abs(acc, out=self._scratch_buf("abs", acc.numel(), torch.float32,
                                                    acc.device))

    def _score_buf(self, acc, x, w: float):
        """The score ``|acc + w x|`` (``fresh_weight``; ``x`` the input as the residual saw
        it) into the same scratch buffer: ``w * x`` rounded, then the sum -- the bucket
        path's MODE_SCORE rows and ``select_compact``'s ``|h|``, bit for bit."""
        a = self._scratch_buf("abs", acc.numel(), torch.float32, acc.device)
        return torch.mul(x, w, out=a).add_(acc).abs_()

    def _compress(self, name, flat, shape, step, cfg, param):
        n = flat.numel()
        enc = cfg["values"]
        ef = cfg["error_feedback"]
        qb = cfg["quant_bucket"]
        d = self.density(step, cfg["ratio"])
        qseed = self._seed(name, step, PURPOSE_QUANT)
        if cfg["per_bucket"]:
            return self._per_bucket(name, flat, shape, step, cfg, d, qseed)
        k, cap = self._k_and_capacity(n, d, cfg)
        if not self._sparse_is_worth_it(n, cap, enc):
            return self._send_all(name, flat, shape, enc, qseed, qb, ef), dict(density=d)
        acc, _ = self._acc(name, flat, None, ef)
        w = cfg.get("fresh_weight_in_force", 0.0)
        if cfg["exact"] or w:
            a = self._score_buf(acc, self._clean_grad(flat), w) if w else self._abs_buf(acc)
            ti = self._exact_top(a, k)
            tv = a[ti]
            valid = tv >= TINY                       # a prefix: sorted descending
            count = valid.sum(dtype=torch.int32).reshape(1)
            idx = torch.where(valid, ti, torch.zeros_like(ti))
            values, scales = self._take(acc, idx, valid, count, enc, qseed, qb, ef)
            seg = Segment(numel=n, capacity=k, index_encoding=IndexEncoding.INT32,
                          value_encoding=enc, count=count, values=values,
                          indices=idx.to(torch.int32), scales=scales, quant_bucket=qb,
                          narrow_indices=True)
            thr = tv[k - 1].clamp_min(TINY)
            return LayerPayload(name, shape, [seg]), dict(selected=count, threshold=thr,
                                                          density=d)
        kept = []
        first = None
        if enc == ValueEncoding.FP32 and ops.has_cpu_path(acc):
            def select_first(t):
                """Count the first estimate by selecting with it (CPU): the select is
                kept when the refinement will keep ``t`` (count in [k, cap]: then no
                later round moves it), else undone -- one pass fewer in the common
                case, the same bits (tests/test_compressors.py)."""
                out, c = ops.select_if_in_range(acc, t, k, cap)
                if out is not None:
                    kept.append(out)
                return c
            first = select_first
        thr = estimate_topk_threshold(
            acc, k, cap, offset=self._seed(name, step, PURPOSE_SAMPLE), rounds=cfg["rounds"],
            abs_out=self._scratch_buf("abs", n, torch.float32, acc.device),
            counts=self._scratch_buf("rounds", max(1, cfg["rounds"]), torch.int32, acc.device),
            first_count=first)
        seg, cnt = self._select(acc, thr, cap, enc, qseed, qb, ef,
                                done=kept[0] if kept else None)
        return LayerPayload(name, shape, [seg]), dict(selected=cnt[1:2], threshold=thr,
                                                      density=d)

    def _select(self, acc, thr, cap, enc, qseed, qb, ef, done=None, **kw):
        """Fused select + compaction + residual update (``ops.select_compact``), then
        quantisation and residual fix-up for int values. Returns (Segment, count[2]).
        ``done``: the ``(indices, values, count)`` of that select, already made."""
        n = acc.numel()
        sel_enc = enc if enc in FLOAT_DTYPES else ValueEncoding.FP32
        idx, vals, cnt = done if done is not None else \
            ops.select_compact(acc, thr, cap, value_encoding=sel_enc, **kw)
        count = cnt[:1]
        scales = None
        if enc in QUANT_BITS:
            values, scales, deq = self._encode(vals, enc, qseed, qb, count=count, want_deq=ef)
            if ef:
                valid = torch.arange(cap, device=acc.device) < count
                delta = torch.where(valid, vals - deq, torch.zeros((), device=acc.device))
                safe = torch.where(valid, idx.to(torch.long), torch.zeros((), dtype=torch.long,
                                                                          device=acc.device))
                acc.index_add_(0, safe, delta)
        else:
            values = vals
        seg = Segment(numel=n, capacity=cap, index_encoding=IndexEncoding.INT32,
                      value_encoding=enc, count=count, values=values, indices=idx,
                      scales=scales, quant_bucket=qb, narrow_indices=True)
        return seg, cnt

    def _per_bucket(self, name, flat, shape, step, cfg, d, qseed):
        n = flat.numel()
        enc = cfg["values"]
        ef = cfg["error_feedback"]
        qb = cfg["quant_bucket"]
        B = min(cfg["per_bucket"], n)
        kb = k_of(d, B)
        nb = ceil_div(n, B)
        cap = nb * kb
        ienc = IndexEncoding.BIN_U8 if B <= 256 else IndexEncoding.BIN_U16
        ibytes = (1.0 if B <= 256 else 2.0) + bin_count_width(B) / kb
        if not self._sparse_is_worth_it(n, cap, enc, ibytes):
            return self._send_all(name, flat, shape, enc, qseed, qb, ef), dict(density=d)
        acc, _ = self._acc(name, flat, None, ef)
        # |acc| zero-padded to whole buckets in the scratch buffer (binned_topc would
        # otherwise concatenate a padded copy every step)
        a = self._scratch_buf("abs", nb * B, torch.float32, acc.device)
        torch.abs(acc, out=a[:n])
        a[n:].zero_()
        gidx, rel, vmask, count, bin_counts, _ = binned_topc(a, B, kb, TINY)
        values, scales = self._take(acc, gidx, vmask, count, enc, qseed, qb, ef)
        seg = Segment(numel=n, capacity=cap, index_encoding=ienc, value_encoding=enc,
                      count=count, values=values, indices=rel, scales=scales,
                      bin_counts=bin_counts, bin_size=B, quant_bucket=qb)
        return LayerPayload(name, shape, [seg]), dict(selected=count, density=d)


