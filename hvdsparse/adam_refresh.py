"""The Adam recipe's variance refresh (:class:`VarianceRefresh`, a mixin of
:class:`hvdsparse.adam.AdamRecipe`): its schedule, the per-rank window statistics and the
refresh of the frozen ``v``. The notation is :mod:`hvdsparse.adam`'s.

The variance refresh (``refresh=R``, ``R >= 2``, from step ``S = refresh_start >=
T_w``; the front doors' defaults: ``R = 50``, ``S = 3 T_w``): the steps ``k = s + 1 =
S + R, S + 2R, ...`` advance the frozen ``v`` by the ``W`` steps since the last
refresh (``W = R``; for the first, the ``S + R - T_w`` steps since the warm-up), from
statistics the ranks gather over those steps (``refresh_from="local"``). Over the
window (reset after each refresh) every rank keeps
``A_i = beta2 * A_i + (1 - beta2) * g_i^2`` of its own gradient (weights summing to
``1 - beta2^W`` at the refresh) and every rank the same ``B = sum X * D`` (the
exchanged average gradient, what the momentum received). The refresh step sends,
dense and exact (fp32, no residual), instead of its gradient,
``a_i = beta2 * A_i + (1 - beta2) * g_i^2``; with ``M = (1/P) sum_i a_i`` and
``mu = B / W`` every rank applies

    D_old = D of this step
    v <- beta2^W * v + M / P + (1 - 1/P) * min((1 - beta2^W) * mu^2, M)
    m <- beta1 * m;   p <- p - lr / bc1 * m / D_new
    r_i <- r_i * D_old / D_new          (the residual holds g / D units: same mass)
    c_i <- g_i                           (sent with the next step: x_i = (g_i' + c_i) / D)

Why: dense Adam averages ``G^2`` of the averaged gradient ``G = (1/P) sum_i g_i``;
over independent batches ``E[G^2] = mu^2 + (E[g_i^2] - mu^2) / P`` -- a rank's own
``g_i^2`` carries its batch's noise, ``P`` times ``G``'s, hence ``M / P`` -- and the
signal part ``mu^2`` is taken from what was applied, the exchanged gradient, capped
by the squares it is part of. With compression, ``B`` counts only the mass that was
sent (the rest waits in the residuals), so this ``v`` is lower than dense Adam's for
coordinates whose mean dominates. Estimating ``mu^2`` from the ranks' own gradients
instead, without that bias (the products of consecutive gradients), measured worse
on text-lm at 900 steps; the window mean's square matched this one on the seed it
ran. ``v`` stays an average with weights summing
to ``1 - beta2^(c + W)`` (in expectation), so ``bc2`` follows ``c``.
The step's own gradient is not lost: it travels with the next step (``c_i``, so also
without a residual: QSGD). Cost: one dense fp32 step in ``R`` (the statistics instead
of the gradient; ``exchange="auto"`` sends it by allreduce) and, per compressed
layer, ``A_i``, ``B`` and the pending ``g_i^2`` on every rank (``c_i`` between a
refresh and the next step). The front doors' default (``adam_refresh=None``) refreshes
every 50 steps from step ``3 T_w``, for every compressor but AdaComp (off: no gain
measured, and it costs AdaComp 28% of its byte saving); ``adam_refresh=0`` freezes
``v`` for good. Measured on text-lm (P = 4): at 900 steps the
refresh lowers TopK's / Threshold's loss gap to dense Adam by about one point, from
step ``T_w`` or from ``3 T_w`` alike; refreshes from ``T_w`` cost 300-step runs
0.6-1.2 points, and from ``3 T_w`` such runs never refresh (bitwise the frozen
recipe).

``refresh_from="sample"`` (0/1 Adam's idea on a fixed period, a study variant,
measured worse with compression): the refresh step travels dense and
exact as a warm-up step does, and ``v <- beta2^R v + (1 - beta2^R) G^2`` with that one
step's averaged gradient standing for ``R`` steps; ``m <- beta1 m + (1 - beta1) G``.

The mixin's contract with :class:`~hvdsparse.adam.AdamRecipe`, whose attributes it
reads: ``warmup`` (``T_w``), ``refresh`` (``R``, None: off), ``refresh_start`` (``S``,
None: ``T_w``), ``refresh_from``, ``world_size``, ``precondition``,
``rescale_residual``, ``_steps`` (Adam's step per layer, host copy), ``_residual(name)``,
``frozen(name)`` and ``_denom(st, group, s)``; it owns the dicts ``_acc`` (``A``),
``_gsum`` (``B``), ``_pend`` (this step's pending square or deferred gradient) and
``_carry`` (``c``), which the recipe creates empty.
"""
from __future__ import annotations

import torch


def host_value(t) -> float:
    """A hyper-parameter or Adam's ``state["step"]`` as a host number. torch's Adam keeps
    ``step`` as a CPU tensor (read through numpy: host memory, no device sync); with
    ``fused=True`` / ``capturable=True`` it lives on the device and reading it is a
    host sync -- done by :meth:`AdamRecipe.frozen` once per layer and step during the
    warm-up only (after it the phase is cached; the update itself uses ``torch.pow`` on
    the device step)."""
    if not isinstance(t, torch.Tensor):
        return float(t)
    if t.device.type == "cpu":
        return float(t.detach().numpy())
    return float(t.item())


class VarianceRefresh:
    """The refresh schedule and statistics of :class:`hvdsparse.adam.AdamRecipe` (see the
    module docstring)."""

    def _first_refresh(self) -> int:
        """The Adam step (1-based) of the first refresh: ``S + R`` (``S`` =
        ``refresh_start``, ``T_w`` when None)."""
        start = self.warmup if self.refresh_start is None else self.refresh_start
        return start + self.refresh

    def refreshing(self, name: str) -> bool:
        """This step of the recipe layer ``name`` refreshes its variance: its Adam step
        ``k = s + 1`` is ``S + R``, ``S + 2R``, ... (``S`` = ``refresh_start``, ``T_w``
        by default)."""
        if self.refresh is None or not self.frozen(name):
            return False
        k = self._steps[name] + 1
        first = self._first_refresh()
        return k >= first and (k - first) % self.refresh == 0

    def _window(self, k: int) -> int:
        """The steps refresh step ``k`` advances ``v`` by: the steps since the last
        refresh, or since the warm-up for the first one (``S + R - T_w``)."""
        first = self._first_refresh()
        return first - self.warmup if k == first else self.refresh

    def _v_count(self, s: int) -> int:
        """How many steps the frozen ``v`` stands for before step ``s``: ``T_w``, or the
        step of the last refresh done (its bias correction is ``1 - beta2^count``)."""
        if self.refresh is None:
            return self.warmup
        first = self._first_refresh()
        if s < first:
            return self.warmup
        return first + self.refresh * ((s - first) // self.refresh)

    def _local(self) -> bool:
        """Refreshes on, from the ranks' local statistics."""
        return self.refresh is not None and self.refresh_from == "local"

    def _local_x(self, name, g, st, group):
        """``refresh_from="local"`` (nothing stored here; :meth:`_update` commits): a
        compressed step sends ``(g + c) / D`` (``c``: the gradient the last refresh step
        deferred) and keeps ``g^2`` pending; a refresh step sends this rank's window
        average ``b2 A + (1 - b2) g^2`` (dense) and keeps ``g + c`` pending, to be sent
        with the next step."""
        c = self._carry.get(name)
        sent = g if c is None else g + c
        if self.refreshing(name):
            b2 = host_value(group["betas"][1])
            # a copy: ``g`` may be the gradient buffer itself, which the exchange's
            # result overwrites before the commit (``p.grad``, DDP's bucket)
            self._pend[name] = sent.clone() if c is None else sent
            x = g * g * (1 - b2)
            A = self._acc.get(name)
            return x if A is None else x.add_(A, alpha=b2)
        self._pend[name] = g * g
        return sent / self._denom(st, group, self._steps[name])

    def _refresh(self, name, st, group, G, d_old, s, step_size, p):
        """A variance refresh (the averaged gradient ``G`` arrived dense):
        ``v <- beta2^R v + (1 - beta2^R) G^2`` (R steps of ``G``, so ``v`` stays Adam's
        average with bias correction ``1 - beta2^(c + R)``), ``m <- beta1 m + (1 - beta1)
        G``, ``p <- p - lr / bc1 * m / D_new``: exact Adam with the refreshed ``v``. The
        residual holds ``g / D_old`` units: it is rescaled by ``D_old / D_new``, so the
        gradient mass it carries is unchanged."""
        b1 = host_value(group["betas"][0])
        b2R = host_value(group["betas"][1]) ** self._window(s + 1)
        st["exp_avg_sq"].mul_(b2R).addcmul_(G, G, value=1 - b2R)
        st["exp_avg"].mul_(b1).add_(G, alpha=1 - b1)
        self._step_refreshed(name, st, group, d_old, s, step_size, p)

    def _step_refreshed(self, name, st, group, d_old, s, step_size, p):
        """After a refresh changed ``v`` (and ``m``): ``p <- p - lr / bc1 * m / D_new``,
        and the residual, in ``g / D`` units, rescaled by ``D_old / D_new`` (the gradient
        mass it carries unchanged)."""
        d_new = self._denom(st, group, s + 1)
        m = st["exp_avg"]
        if isinstance(step_size, torch.Tensor):
            p.sub_(m / d_new * step_size.to(p.device))
        else:
            p.addcdiv_(m, d_new, value=-step_size)
        r = self._residual(name)
        if r is not None and self.precondition and self.rescale_residual:
            r.mul_((d_old / d_new).reshape(r.shape))

    def _accumulate(self, name, group, XD):
        """Commit a compressed step's local statistics: ``A <- b2 A + (1 - b2) g_i^2``
        (this rank's), ``B <- B + X D`` (the exchanged gradient: the same on every
        rank)."""
        b2 = host_value(group["betas"][1])
        pend = self._pend.pop(name)
        self._carry.pop(name, None)          # the deferred gradient went out with X
        A = self._acc.get(name)
        if A is None:
            self._acc[name] = pend.mul_(1 - b2)
            self._gsum[name] = XD.detach().float().clone()
            return
        A.mul_(b2).add_(pend, alpha=1 - b2)
        self._gsum[name].add_(XD)

    def _refresh_local(self, name, st, group, M, d_old, s, step_size, p):
        """A local refresh: ``M`` = the ranks' average of their window averages of
        ``g_i^2`` (weights summing to ``1 - b2^R``), ``mu = B / R`` the window's mean
        exchanged gradient: ``v <- b2^R v + M / P + (1 - 1/P) min((1 - b2^R) mu^2, M)``.
        The step's gradient was not sent: ``m <- b1 m``, ``p <- p - lr / bc1 * m /
        D_new``, it is added to the next step's gradient (``c``); the residual, in
        ``g / D`` units, is rescaled: ``r <- r * D_old / D_new``."""
        b1 = host_value(group["betas"][0])
        W = self._window(s + 1)
        b2R = host_value(group["betas"][1]) ** W
        P = self.world_size
        B = self._gsum.pop(name, None)
        self._acc.pop(name, None)
        self._carry[name] = self._pend.pop(name)     # sent with the next step
        mu2 = torch.zeros_like(M) if B is None else (B / W).square_()
        est = torch.minimum(mu2.mul_(1 - b2R), M).mul_(1 - 1 / P).add_(M, alpha=1 / P)
        st["exp_avg_sq"].mul_(b2R).add_(est)
        st["exp_avg"].mul_(b1)
        self._step_refreshed(name, st, group, d_old, s, step_size, p)
