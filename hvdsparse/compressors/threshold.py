"""DCT-DP: hard thresholding with a threshold recomputed only every ``life_span`` steps
(dct-dynamic-communication-thresholding.txt, Algorithm 1).

Per layer, with sparsity factor ``eta`` (``sparsity``), life-span ``L`` and step ``t``:

    acc = residual + grad                                   (Alg. 1 line 2, error feedback)
    if t % L == 0 (or no tau yet, or k changed): tau = k-th largest |acc|   (lines 3-5)
    else: reuse tau                                          (line 7)
    M = I(|acc| >= tau); sent = acc * M; residual = acc - sent   (lines 9-11)

with ``k = max(1, ceil((1 - eta) n))``: the paper writes ``tau = w_floor(N eta)`` of the
ascending sort, i.e. the element with ``N - floor(N eta)`` elements at or above it --
``k`` up to an off-by-one, which we resolve so that exactly ``k`` elements are at or
above ``tau`` (ties aside). ``tau`` is clamped to ``TINY`` so exact zeros are never
sent. The refresh uses ``torch.topk(|acc|, k)`` (the paper sorts; topk is the same
value without a full sort) -- on the device, no host synchronisation.

Deviations, all forced by fixed-size messages:

* **Capacity.** The paper sends every element above the (stale) threshold, a count that
  varies from step to step. Here ``capacity = min(n, ceil(slack * k))`` (``slack=2``)
  is fixed; if more than ``capacity`` elements pass the stale threshold, the first
  ``capacity`` in the kernel's slot order are sent (ascending index on CPU) and the rest
  stay in the residual -- error feedback keeps them, nothing is lost. The capacity is
  what ``allgather`` moves whatever the count (``capacity`` slots per message: with
  ``slack=2`` twice TopK's ``k`` on its exact route); only ``split`` (which ``auto`` takes
  on the CPU path, never on CUDA) sends what was selected. On the GPT-style LM under
  AdamW that is 24.2x fewer bytes than dense at P = 2 and 12.1x at P = 4 (BENCHMARKS).
* **Overflow guard** (``overflow_guard=True``). Error feedback makes ``|acc|`` grow
  well above the raw gradient a threshold computed at step 0 was taken from, so a
  stale ``tau`` can let half the layer pass. The paper then simply sends half the
  layer (and the residual empties); with a fixed capacity the same elements (lowest
  slots) would be sent every step and the others would starve. Two parts:

  - *This step: the largest go first (the overflow ladder).* Between refreshes the
    count is taken at 32 rungs ``t_j = tau * 2^(j/8)`` (``LADDER``, fp32 products;
    ``c_j = #{|acc| >= t_j}``, one counting pass) and the selection uses the lowest
    rung that fits, ``t* = t_r``, ``r = min(#{j : c_j > capacity}, 31)`` (``c_j``
    never grows with ``j``; ``r = 0`` when nothing overflows, so such steps are
    Algorithm 1 exactly). An overflow past the top rung (``tau`` too low by more than
    14.7x) is cut as before. Without the ladder an overflowing step sends the lowest
    slots whatever their size, and the starved elements' accumulations grow until they
    go out at once: on the digits CNN with momentum correction that made training
    diverge for tens of steps in 2 of 3 seeds. Over 6 seeds the accuracy gap to dense went from -2.18 pp to -0.69 pp with these rungs
    (-0.93 pp with 16 rungs of 2^(1/4), -0.28 pp sending exactly the ``capacity``
    largest, which a host-synchronising top-k would cost).
  - *The next steps: tau is raised.* With ``selected = c_0`` (the count at ``tau``,
    reported as the layer's ``selected``), when ``selected > capacity`` the threshold
    used from the next step on is ``tau * min(2, sqrt(selected / capacity))``, until
    the count fits again; ``tau`` is never lowered between refreshes (a too-high
    ``tau`` only delays elements, which error feedback then accumulates until they
    pass; a rule that also lowered it, tracking a target count, lost 5 pp on the
    digits MLP).

  All device ops, no host synchronisation. ``overflow_guard=False`` keeps ``tau`` fixed
  between refreshes and cuts an overflow in slot order (the paper's rule with a fixed
  capacity).
* **The score** (``fresh_weight=w``, TopK's setting, the same default: 2 on the Adam
  recipe's update wire, 0 otherwise). With ``x`` this step's input (the cleaned gradient
  or the recipe's update), everything above ranks ``s = |acc + w x|`` (``w x`` rounded,
  then the sum) instead of ``|acc|``: the refresh's ``tau`` is the k-th largest ``s``, the
  ladder counts ``s``, and ``M = I(s >= t)``; the values sent are still ``acc``'s, so
  error feedback stays exact. Under an annealed learning rate ``acc`` is mostly old,
  large updates, and a threshold on ``|acc|`` keeps sending them; counting the newest
  update more keeps the selection current. On the GPT-style LM under AdamW, P = 2, 3
  seeds, the same bytes (BENCHMARKS "Transformer LM under AdamW"): warm-up + cosine
  +3.7% of dense's loss with ``w = 2``, +5.4% with 1, +15.9% with 0; constant rate
  -4.5%, -5.4%, +1.9%.
* **The rate** (``tau_follows_rate=True``, the default; the Adam recipe's update wire
  only). The input there is ``x = lr u`` (the rank's Adam step times the rate), so a tau
  in parameter units goes stale as the rate anneals: under warm-up + cosine a tau taken
  at the peak passes ever fewer elements (35-69% of ``k`` on the GPT-style LM at P = 4).
  A tau kept at rate ``lr_0`` is used at ``lr`` as ``max(fp32(tau * fp32(lr / lr_0)),
  TINY)`` (``rate_factor``; the bucket kernels read the factor from the row), a refresh
  keeps its tau at its step's rate, and the guard's next tau is kept at the rate it was
  used at. A constant rate changes no bit; a tensor rate is not read (no host sync) and
  keeps tau as it is. On that LM under warm-up + cosine (3 seeds; BENCHMARKS "Transformer
  LM under AdamW") it ended +2.7% of dense's loss at P = 4 where the kept tau ended +5.0%
  (fp32 values both), sending what the capacity allows for the whole run instead of ever
  less (6.3x fewer bytes than dense over the run instead of 8.6x); with the update wire's
  bf16 values (the default there) +2.5% at 7.8x, and +0.6% at 11.2x at P = 2.
* **Warm-up.** With a warm-up schedule ``k`` changes with the step; ``tau`` is
  recomputed on every step whose ``k`` differs from the ``k`` of the last refresh (and
  on every ``L``-th step as usual), so during warm-up the threshold is fresh each step.

Threshold history (the paper's Figure 2): every refresh appends ``(step, tau)`` (tau a
0-d device tensor) to the layer's history; ``record_true_threshold=True`` also appends
``(step, exact k-th largest |acc|)`` on every step (costs a topk per step, for
inspection only). Read it with :meth:`Threshold.threshold_history` (host floats).
"""
from __future__ import annotations

import math

import torch

from ..payload import LayerPayload
from .base import PURPOSE_QUANT, TINY, check_values, k_of
from .checks import check_bool, check_fresh_weight, check_quant_bucket, prefixed
from .topk import TopK
from .warmup import make_warmup

__all__ = ["Threshold", "LADDER", "ladder_threshold"]

#: the overflow ladder's rung factors: rung ``j`` selects at ``fp32(tau * LADDER[j])``
#: (``2^(j/8)`` rounded to fp32, 32 rungs up to 14.7x; the bucket kernels get them as
#: a tensor)
LADDER = tuple(float(torch.tensor(2.0 ** (j / 8), dtype=torch.float32)) for j in range(32))
_LADDER_T = {}


def ladder_factors(device, ladder=LADDER) -> torch.Tensor:
    """``ladder`` (rung factors, ascending, ``ladder[0] == 1``) as an fp32 tensor on
    ``device`` (cached)."""
    key = (str(device), tuple(ladder))
    t = _LADDER_T.get(key)
    if t is None:
        t = _LADDER_T[key] = torch.tensor(ladder, dtype=torch.float32, device=device)
    return t


def ladder_threshold(a: torch.Tensor, tau: torch.Tensor, cap: int, ladder=LADDER,
                     out: torch.Tensor = None):
    """The overflow ladder (module docstring): ``(t*, c_0)`` for magnitudes ``a`` (fp32,
    ``>= 0``, no NaN), the reused ``tau`` (0-d fp32, ``>= TINY``) and ``cap``: ``t* =
    t_r`` with ``t_j = tau * ladder[j]``, ``c_j = #{a >= t_j}``, ``r = min(#{j : c_j >
    cap}, J - 1)`` (the lowest rung that fits); ``c_0`` int32[1]. Device ops only (a
    bucketize and an index-add histogram of how many rungs each element reaches; no
    host synchronisation). ``out``: an int32 scratch buffer of ``a.numel()`` elements
    (else one is allocated)."""
    J = len(ladder)
    rungs = tau.reshape(1) * ladder_factors(a.device, ladder)  # ascending
    reached = torch.bucketize(a, rungs, right=True, out_int32=True,
                              out=out)                         # #{j : t_j <= a_i}
    hist = torch.zeros(J + 1, dtype=torch.int32, device=a.device)
    hist.index_add_(0, reached, torch.ones((), dtype=torch.int32,
                                           device=a.device).expand(a.numel()))
    c = hist.flip(0).cumsum(0).flip(0)[1:]                     # c_j = #{reached > j}
    r = (c > cap).sum().clamp_max(J - 1)
    return rungs.gather(0, r.reshape(1)).reshape(()), c[:1].to(torch.int32)


class Threshold(TopK):
    """``Threshold(sparsity, life_span=1000, values=None, slack=2.0, quant_bucket=512,
    warmup=None, error_feedback=True, record_true_threshold=False, max_history=10000,
    overflow_guard=True, output_ratio=0.1, fresh_weight=None, tau_follows_rate=True,
    **policy)`` -- DCT-DP; see the module docstring. ``output_ratio``: as TopK's, the output
    layer (the last compressed parameter) runs at sparsity ``min(sparsity, 1 -
    output_ratio)``; ``None``: off. ``values=None``: as TopK's, bf16 on the Adam recipe's
    update wire (the rounding error kept in the residual), fp32 elsewhere.
    ``tau_follows_rate`` acts on the update wire only (module docstring)."""

    bucket_path = True       # between refreshes (topk_bucket.layer_plan: ROUTE_GIVEN)
    #: tau lives life_span steps, and one taken while the rate rises sits on a tie
    adam_dense_while_rate_rises = True
    adam_small_layers_whole = False     # not measured
    ladder = LADDER          # the overflow ladder's rung factors (module docstring)

    def error_feedback_density(self):
        return 1.0 - self.sparsity if self.error_feedback else None

    _settings = ("sparsity", "life_span", "values", "slack", "quant_bucket",
                 "error_feedback", "fresh_weight")
    _extra_args = ("record_true_threshold", "max_history", "overflow_guard", "output_ratio",
                   "tau_follows_rate")
    _density_key = "sparsity"

    def __init__(self, sparsity: float, life_span: int = 1000, values=None,
                 slack: float = 2.0, quant_bucket: int = 512, warmup=None,
                 error_feedback: bool = True, record_true_threshold: bool = False,
                 max_history: int = 10000, overflow_guard: bool = True, output_ratio=0.1,
                 fresh_weight=None, tau_follows_rate=True, **kw):
        # bypass TopK.__init__ (different settings), keep its helpers
        super(TopK, self).__init__(**kw)
        self._set_output_ratio(output_ratio)
        cfg = self._validate_cfg(dict(sparsity=sparsity, life_span=life_span, values=values,
                                      slack=slack, quant_bucket=quant_bucket,
                                      error_feedback=error_feedback,
                                      fresh_weight=fresh_weight))
        for key, v in cfg.items():
            setattr(self, key, v)
        check_bool(record_true_threshold, "record_true_threshold")
        if not isinstance(max_history, int) or isinstance(max_history, bool) or max_history < 1:
            raise ValueError(f"max_history must be an int >= 1, got {max_history!r}")
        check_bool(overflow_guard, "overflow_guard")
        self.overflow_guard = overflow_guard
        check_bool(tau_follows_rate, "tau_follows_rate")
        self.tau_follows_rate = tau_follows_rate
        self.record_true_threshold = record_true_threshold
        self.max_history = max_history
        self.warmup = make_warmup(warmup)
        self._validate_overrides()

    def _validate_cfg(self, cfg, where=""):
        cfg = dict(cfg)
        s = cfg["sparsity"]
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) \
                or not 0.0 <= s < 1.0:
            raise ValueError(f"{where}sparsity must be a number in [0, 1), got {s!r}")
        cfg["sparsity"] = float(s)
        L = cfg["life_span"]
        if not isinstance(L, int) or isinstance(L, bool) or L < 1:
            raise ValueError(f"{where}life_span must be an int >= 1, got {L!r}")
        if cfg["values"] is not None:           # None: follows the wire (values_of)
            cfg["values"] = prefixed(check_values, cfg["values"], where)
        sl = cfg["slack"]
        if not isinstance(sl, (int, float)) or isinstance(sl, bool) or not 1.0 <= sl < 1e6:
            raise ValueError(f"{where}slack must be a number >= 1, got {sl!r}")
        check_quant_bucket(cfg["quant_bucket"], where)
        check_bool(cfg["error_feedback"], "error_feedback", where)
        cfg["fresh_weight"] = check_fresh_weight(cfg.get("fresh_weight"), where)
        return cfg

    def _output_cfg(self, cfg: dict) -> dict:
        return dict(cfg, sparsity=min(cfg["sparsity"], 1.0 - self.output_ratio))

    def _target_density(self, name: str) -> float:
        return 1.0 - self.layer_cfg(name)["sparsity"]

    def density(self, step: int, sparsity=None) -> float:
        d = 1.0 - (self.sparsity if sparsity is None else sparsity)
        return self.warmup(step, d) if self.warmup is not None else d

    def capacity(self, numel: int, step: int, name: str = "") -> int:
        cfg = self.layer_cfg(name) if name else self._base_cfg()
        return self._k_and_capacity(numel, self.density(step, cfg["sparsity"]), cfg)[1]

    @staticmethod
    def _k_and_capacity(n: int, d: float, cfg: dict):
        """``(k, capacity)`` of a layer of ``n`` elements at density ``d``: ``k =
        max(1, ceil(d n))``, ``capacity = min(n, ceil(slack k))`` (the module docstring)."""
        k = k_of(d, n)
        return k, min(n, math.ceil(cfg["slack"] * k))

    @staticmethod
    def _refresh_due(st, step: int, cfg: dict, k: int) -> bool:
        """Whether layer state ``st`` (None before the first step) recomputes tau at
        ``step``: no tau yet, every ``life_span``-th step, or ``k`` changed (warm-up)."""
        return st is None or st["tau"] is None or step % cfg["life_span"] == 0 or \
            st["k"] != k

    def threshold_history(self, name: str, true: bool = False) -> list:
        """[(step, tau)] of the layer's refreshes (``true=True``: the per-step exact
        k-th largest values recorded with ``record_true_threshold``). Host floats."""
        st = self._layers.get(name)
        if st is None:
            return []
        hist = st["true_history"] if true else st["history"]
        return [(s, float(t)) for s, t in hist]

    def current_threshold(self, name: str):
        """The tau the layer's next step will use (0-d device tensor) or None."""
        st = self._layers.get(name)
        return None if st is None else st["tau"]

    def layer_state(self, name: str) -> dict:
        """Layer ``name``'s algorithm state (made on first use): its tau, the ``k`` and step
        of its last refresh, the rate its tau is kept at, the refresh histories."""
        st = self._layers.get(name)
        if st is None:
            st = self._layers[name] = dict(tau=None, k=None, last_refresh=None, rate=None,
                                           history=[], true_history=[])
        return st

    def record_refresh(self, name: str, step: int, tau, k: int) -> dict:
        """A refresh of layer ``name`` at ``step``: ``tau`` (0-d device tensor, the k-th
        largest ranked value) becomes its threshold, kept at this step's rate, and joins
        the refresh history. Returns the layer state."""
        st = self.layer_state(name)
        st["tau"], st["k"], st["last_refresh"] = tau, k, step
        st["rate"] = self.followed_rate(name)
        st["history"].append((step, tau))
        del st["history"][:-self.max_history]
        return st

    def rate_factor(self, name: str, st) -> tuple:
        """``(f, rate)`` for layer state ``st`` at this step: the reused tau is used as
        ``max(fp32(tau * fp32(f)), TINY)`` (``f = 1.0`` unless it follows the rate) and
        ``rate`` (host float or None) is the rate a tau derived from it is kept at
        (:meth:`keep_rate`). With ``tau_follows_rate`` on the Adam recipe's update wire
        (``layer_rate``: the layer's host learning rate), a tau kept at rate ``lr_0`` is
        used at ``lr`` with ``f = lr / lr_0``: the update ``x = lr u`` it is compared with
        scales with the rate, so a tau taken at the peak of a schedule still passes about
        as many elements after the rate has fallen. A rate that is not > 0 (or unknown)
        keeps ``f = 1`` and the kept rate; a tau kept at no known rate (a state saved
        without it) is kept at this step's from now on. Host arithmetic only."""
        last = st.get("rate") if st is not None else None
        rate = self.followed_rate(name)
        if rate is None:
            return 1.0, last
        if last is None:
            return 1.0, rate
        return rate / last, rate

    def followed_rate(self, name: str):
        """Layer ``name``'s rate this step when its tau follows the rate (a host float >
        0), else None."""
        rate = self.layer_rate(name) if self.tau_follows_rate and self.layer_rate else None
        return rate if rate is not None and rate > 0.0 else None

    @staticmethod
    def keep_rate(st: dict, rate, guarded: bool) -> None:
        """After a reuse step: the guard's next tau (derived from the one used) is kept at
        ``rate``; without the guard the tau is unchanged, so is its rate, unless it had
        none."""
        if guarded or st.get("rate") is None:
            st["rate"] = rate

    @staticmethod
    def _next_tau(tau, selected, k: int, cap: int):
        """The overflow guard: raise tau for the next steps when more than ``cap`` passed
        it (device scalar ops only; see the module docstring). The sqrt goes through
        float64: correctly rounded on every device (torch's fp32 CPU sqrt is not, in ~14%
        of inputs), so the bucket path's kernels (div_rn, sqrt_rn / sqrtf) give the same
        bits."""
        num = selected.to(torch.float32)
        # tensor / tensor: IEEE division on every device (CUDA divides a tensor by a
        # Python scalar as a multiply by its reciprocal, which can differ in the last bit)
        ratio = num / torch.full_like(num, float(cap))
        up = ratio.double().sqrt().float().clamp_max(2.0)
        return torch.where(ratio > 1.0, tau * up, tau)

    def _compress(self, name, flat, shape, step, cfg, param):
        n = flat.numel()
        enc = cfg["values"]
        ef = cfg["error_feedback"]
        qb = cfg["quant_bucket"]
        d = self.density(step, cfg["sparsity"])
        k, cap = self._k_and_capacity(n, d, cfg)
        qseed = self._seed(name, step, PURPOSE_QUANT)
        if not self._sparse_is_worth_it(n, cap, enc):
            return self._send_all(name, flat, shape, enc, qseed, qb, ef), dict(density=d)
        acc, _ = self._acc(name, flat, None, ef)
        st = self.layer_state(name)
        refresh = self._refresh_due(st, step, cfg, k)
        # what is ranked, made where it is used: |acc|, or the score |acc + w x|, which
        # the select recomputes from x (its h = acc + (h_scale - 1) x)
        w = cfg.get("fresh_weight_in_force", 0.0)
        score = {}
        if w:
            x = self._clean_grad(flat)
            score = dict(grad=x, h_scale=1.0 + w)
            ranked = lambda: self._score_buf(acc, x, w)     # noqa: E731
        else:
            ranked = lambda: self._abs_buf(acc)              # noqa: E731
        true_tau = None
        if refresh or self.record_true_threshold:
            true_tau = torch.topk(ranked(), k, sorted=False).values.min().clamp_min(TINY)
        if refresh:
            self.record_refresh(name, step, true_tau, k)
        if self.record_true_threshold:
            st["true_history"].append((step, true_tau))
            del st["true_history"][:-self.max_history]
        tau = st["tau"]
        if not refresh:
            f, rate = self.rate_factor(name, st)
            if f != 1.0:
                tau = (tau * torch.full_like(tau, f)).clamp_min(TINY)
        if self.overflow_guard and not refresh:
            t_sel, c0 = ladder_threshold(
                ranked(), tau, cap, self.ladder,
                out=self._scratch_buf("ladder", n, torch.int32, acc.device))
            seg, cnt = self._select(acc, t_sel, cap, enc, qseed, qb, ef, **score)
            cnt = torch.cat([cnt[:1], c0])                # selected: the count at tau
        else:
            seg, cnt = self._select(acc, tau, cap, enc, qseed, qb, ef, **score)
        if self.overflow_guard:
            st["tau"] = self._next_tau(tau, cnt[1], k, cap)
        if not refresh:
            self.keep_rate(st, rate, self.overflow_guard)
        return LayerPayload(name, shape, [seg]), dict(selected=cnt[1:2], threshold=tau,
                                                      density=d,
                                                      extra=dict(refreshed=refresh))
