"""An independent plain-torch replay of the Adam recipe (1-bit Adam's frozen variance and
compressed momentum after a dense warm-up) for P simulated ranks, written from the
definition in the README / hvdsparse.adam's docstring, not from the code under test.

Per layer with ``t`` its Adam step count before this step:

* dense layers (fewer than ``dense_below`` elements, or 1-D) and warm-up (``t < T_w``):
  exact Adam on ``G = (sum_r g_r) / P``:  (AdamW: ``w *= 1 - lr wd``; Adam: ``G += wd w``)
  ``m = b1 m + (1 - b1) G``, ``v = b2 v + (1 - b2) G^2``, ``t += 1``,
  ``w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``;
* after: per rank ``m_r = b1 m + (1 - b1) (g_r [+ wd w for Adam])``, with
  ``D = max(s, floor * mean(s)) + eps``, ``s = sqrt(v) / sqrt(1 - b2^T_w)`` (v frozen) ``x_r = m_r / D`` (``precondition``,
  the default) or ``x_r = m_r``; ``acc = e_r + x_r``, ``sent = select(acc)``,
  ``e_r = acc - sent``; ``X = (sum_r sent_r) / P``; (AdamW: ``w *= 1 - lr wd``)
  ``t += 1``, ``v`` unchanged; precondition: ``m = X * D``, ``w -= lr / (1 - b1^t) * X``;
  else ``m = X``, ``w -= lr / (1 - b1^t) * X / D``.
* after, ``wire="gradient"``: the same with ``x_r = (g_r [+ wd w]) / D`` (or ``g_r``
  without ``precondition``), and then ``m = b1 m + (1 - b1) X D`` (or ``... + (1 - b1) X``),
  ``w -= lr / (1 - b1^t) * m / D``: the momentum is applied after the exchange.
* after, ``wire="update"``: every rank ``r`` keeps its own ``m_r``, ``v_r`` (the
  warm-up's ``m``, ``v`` at its end): ``g = g_r [+ wd w]``, ``m_r = b1 m_r + (1 - b1) g``,
  ``v_r = b2 v_r + (1 - b2) g^2``, ``t += 1``, ``u_r = m_r / (sqrt(v_r) / sqrt(1 - b2^t)
  + eps) / (1 - b1^t)``, ``acc = e_r + u_r``, ``sent = select(acc)``, ``e_r = acc - sent``;
  ``X = (sum_r sent_r) / P``; (AdamW: ``w *= 1 - lr wd``) ``w -= lr * X``.
  ``whole="bf16"`` (TopK's default on this wire): the dense layers too, after the
  warm-up, with ``sent = bf16(acc)`` (every element, rounded to nearest even; the
  rounding stays in ``e_r``).
* ``refresh=R`` (``refresh_start=S``, ``T_w`` when None): the steps whose count
  ``k = t + 1`` is ``S + R``, ``S + 2R``, ... are refreshes; ``W`` = ``k`` minus the
  step of the last refresh (``T_w`` before the first), the steps it stands for. The
  sample refresh: exact dense steps, ``G`` as in warm-up (residuals untouched and not
  sent), ``D_old`` = ``D`` of this step, ``v = b2^W v + (1 - b2^W) G^2``,
  ``m = b1 m + (1 - b1) G``, ``t += 1``, ``D_new`` from the new ``v`` with
  ``s = sqrt(v) / sqrt(1 - b2^t)``, ``w -= lr / (1 - b1^t) * m / D_new``, every
  ``e_r *= D_old / D_new`` (precondition). Between refreshes ``D`` uses
  ``s = sqrt(v) / sqrt(1 - b2^c)`` with ``c`` the step of the last refresh (``T_w``
  before the first), the number of steps the frozen ``v`` stands for.

* ``refresh_from="local"`` (gradient wire, ``R >= 2``): every rank keeps ``A_r``
  (zero at the warm-up's end and after each refresh) and a carried gradient ``c_r``
  (zero but after a refresh), the ranks share ``B`` (zero likewise). A compressed step
  sends ``x_r = (g_r + c_r) / D`` as above, then ``A_r = b2 A_r + (1 - b2) g_r^2``,
  ``B = B + X D``, ``c_r = 0``. A refresh step sends nothing of the gradient:
  ``a_r = b2 A_r + (1 - b2) g_r^2``, ``M = mean_r a_r``, ``mu = B / W``,
  ``v = b2^W v + M / P + (1 - 1/P) min((1 - b2^W) mu^2, M)``, ``m = b1 m``, ``t += 1``,
  ``w -= lr / (1 - b1^t) * m / D_new``, ``e_r *= D / D_new``, ``c_r = g_r + c_r``,
  ``A_r = B = 0``.

``select``: :func:`topk_exact` (TopK(ratio, exact=True)) or :func:`adacomp` (AdaComp's
pack(), Algorithm 2 of the AdaComp paper with this project's fixed per-bin capacity).
"""
import math

import torch

from tests.workers.topk_oracle import topk_indices


def out_layer(model, min_numel=1024):
    """TopK's output layer under the default policy: the last registered parameter
    with >= ``min_numel`` elements and more than one dimension."""
    return [n for n, p in model.named_parameters() if p.numel() >= min_numel
            and p.dim() > 1][-1]


def topk_exact(ratio, output=None, output_ratio=0.1, fresh=0.0, values="fp32"):
    """TopK(ratio, exact=True); the layer called ``output`` (TopK's output layer: the
    last compressed one) at ``max(ratio, output_ratio)``. ``fresh``: TopK's
    ``fresh_weight`` (the k largest ``|acc + fresh x|`` are sent, ``x`` the step's input;
    the update wire's default: ``topk.UPDATE_WIRE_FRESH_WEIGHT``). ``values``: "fp32" or
    "bf16" (the sent values rounded to bf16, the rounding left in the residual; the
    update wire's default: ``topk.UPDATE_WIRE_VALUES``)."""
    def select(acc, name=None, x=None):
        flat = acc.reshape(-1)
        r = max(ratio, output_ratio) if name is not None and name == output else ratio
        k = max(1, min(flat.numel(), math.ceil(r * flat.numel() - 1e-9)))
        score = flat if not fresh else flat + fresh * x.reshape(-1)
        idx = topk_indices(score, k)             # ties to the lower index, as TopK's
        idx = idx[flat[idx] != 0]
        sent = torch.zeros_like(flat)
        v = flat[idx]
        sent[idx] = v.to(torch.bfloat16).float() if values == "bf16" else v
        return sent.view_as(acc)
    return select


def adacomp(bin_size=500, scale=4.0, max_per_bin=None):
    """AdaComp: G = acc (residue + dW), H = G + (scale - 1) dW, gmax per bin, send
    |H| >= gmax (at most ``max_per_bin`` largest |H| per bin, ties to the lower index)
    as sign(G) * s with
    s = mean of the bin maxima."""
    cap = max_per_bin or max(4, math.ceil(bin_size / 50))

    def select(acc, dW):
        G, d = acc.reshape(-1), dW.reshape(-1)
        n = G.numel()
        nb = -(-n // bin_size)
        pad = nb * bin_size - n
        Gp = torch.cat([G, G.new_zeros(pad)]).view(nb, bin_size)
        Hp = torch.cat([G + (scale - 1.0) * d, G.new_zeros(pad)]).view(nb, bin_size)
        gmax = Gp.abs().max(dim=1).values.clamp_min(torch.finfo(torch.float32).tiny)
        s = gmax.mean()
        # the largest |H| of each bin, ties to the lower index (AdaComp's stated rule; a
        # stable descending sort keeps equal values in index order)
        vals, order = torch.sort(Hp.abs(), dim=1, descending=True, stable=True)
        c = min(cap, bin_size)
        ok = vals[:, :c] >= gmax.unsqueeze(1)
        mask = torch.zeros(nb, bin_size, dtype=torch.bool)
        mask.scatter_(1, order[:, :c], ok)
        mask = mask.reshape(-1)[:n]
        sign = torch.where(G < 0, -1.0, 1.0)
        sent = torch.where(mask, sign * s, torch.zeros(()))
        return sent.view_as(acc)
    return select


class AdamReplay:
    def __init__(self, weights, P, *, lr, betas, eps, wd, decoupled, warmup, select,
                 dense_below=1024, needs_dw=False, precondition=True, floor=0.1,
                 wire="gradient", refresh=None, refresh_from="sample", refresh_start=None,
                 whole=None):
        self.wire, self.refresh, self.refresh_from = wire, refresh, refresh_from
        self.whole = whole
        self.start = warmup if refresh_start is None else refresh_start
        self.W = {n: w.detach().clone().float() for n, w in weights.items()}
        self.P, self.lr, self.eps, self.wd = P, lr, eps, wd
        self.b1, self.b2 = betas
        self.decoupled, self.warmup, self.select = decoupled, warmup, select
        self.dense_below, self.needs_dw = dense_below, needs_dw
        self.precondition, self.floor = precondition, floor
        self.m = {n: torch.zeros_like(w) for n, w in self.W.items()}
        self.v = {n: torch.zeros_like(w) for n, w in self.W.items()}
        self.t = {n: 0 for n in self.W}
        self.e = [{n: torch.zeros_like(w) for n, w in self.W.items()} for _ in range(P)]
        self.A = [{n: torch.zeros_like(w) for n, w in self.W.items()} for _ in range(P)]
        self.c = [{n: torch.zeros_like(w) for n, w in self.W.items()} for _ in range(P)]
        self.B = {n: torch.zeros_like(w) for n, w in self.W.items()}
        self.last = {n: warmup for n in self.W}     # step of the last refresh (or T_w)
        self.mr = [{} for _ in range(P)]           # wire="update": every rank's own m, v
        self.vr = [{} for _ in range(P)]

    def _own_steps(self, n, W, everyone):
        """``wire="update"``: rank r's moments start from the warm-up's shared ones and
        then follow its own gradient; it sends its own bias-corrected Adam step times the
        learning rate, ``x_r = lr * u_r``, with error feedback; ``w -= X``."""
        P, lr, wd, b1, b2, eps = self.P, self.lr, self.wd, self.b1, self.b2, self.eps
        t = self.t[n] + 1
        X = torch.zeros_like(W)
        for r in range(P):
            g = everyone[r][n].float()
            if wd and not self.decoupled:
                g = g + wd * W
            m = self.mr[r].get(n, self.m[n])
            v = self.vr[r].get(n, self.v[n])
            self.mr[r][n] = m = b1 * m + (1 - b1) * g
            self.vr[r][n] = v = b2 * v + (1 - b2) * (g * g)
            # the wire's stated roundings (hvdsparse/adam.py, kernels/bucket_adam.py): a
            # correctly rounded sqrt, the constant divisions as products with their fp32
            # reciprocals (the first compressed steps' |x| cluster: rounding decides ties)
            sq = v.double().sqrt().float()
            x = m / (sq * (1 / math.sqrt(1 - b2 ** t)) + eps) * (1 / (1 - b1 ** t)) * lr
            acc = self.e[r][n] + x
            if self.dense(n):              # sent whole (``whole``)
                sent = acc.to(torch.bfloat16).float() if self.whole == "bf16" else acc
            elif self.needs_dw:
                sent = self.select(acc, x)
            else:
                sent = self.select(acc, name=n, x=x)
            self.e[r][n] = acc - sent
            X = X + sent
        X = X * (1.0 / P)
        if self.decoupled:
            W = W * (1 - lr * wd)
        self.t[n] = t
        self.W[n] = W - X

    def _D(self, n, count):
        s = self.v[n].sqrt() / math.sqrt(1 - self.b2 ** count)
        return torch.clamp(s, min=float(self.floor * s.mean())) + self.eps

    def dense(self, n):
        W = self.W[n]
        return W.numel() < self.dense_below or W.dim() <= 1

    def step(self, everyone):
        """``everyone``: every rank's raw local gradients ``{name: tensor}``, rank order."""
        P, lr, wd, b1, b2, eps = self.P, self.lr, self.wd, self.b1, self.b2, self.eps
        for n, W in self.W.items():
            if (self.dense(n) and not (self.whole and self.wire == "update")) or \
                    self.t[n] < self.warmup:
                G = sum(everyone[r][n].float() for r in range(P)) * (1.0 / P)
                if self.decoupled:
                    W = W * (1 - lr * wd)
                elif wd:
                    # torch's Adam itself runs this step; it folds L2 decay in one rounding
                    # (grad.add(param, alpha=wd)). Where G ~ -wd W the sum cancels to ~eps,
                    # Adam's G / (|G| + eps) magnifies a one-ulp difference of the two-rounding
                    # G + wd * W ~1000x, past the test's tolerance (seed 1262791818).
                    G = G.add(W, alpha=wd)
                self.m[n] = b1 * self.m[n] + (1 - b1) * G
                self.v[n] = b2 * self.v[n] + (1 - b2) * G * G
                self.t[n] += 1
                t = self.t[n]
                denom = self.v[n].sqrt() / math.sqrt(1 - b2 ** t) + eps
                self.W[n] = W - lr / (1 - b1 ** t) * self.m[n] / denom
                continue
            t0, R = self.t[n], self.refresh
            D = self._D(n, self.last[n])
            local = self.refresh_from == "local" and R is not None
            k = t0 + 1
            refresh = R is not None and k > self.start and (k - self.start) % R == 0
            Wn = k - self.last[n]                    # steps this refresh stands for
            if refresh:
                self.last[n] = k
            if local and refresh:
                gs = [everyone[r][n].float() + (0 if self.decoupled else wd * W)
                      for r in range(P)]
                M = sum(b2 * self.A[r][n] + (1 - b2) * gs[r] ** 2 for r in range(P)) / P
                mu = self.B[n] / Wn
                est = M / P + (1 - 1 / P) * torch.minimum((1 - b2 ** Wn) * mu ** 2, M)
                self.v[n] = b2 ** Wn * self.v[n] + est
                if self.decoupled:
                    W = W * (1 - lr * wd)
                self.m[n] = b1 * self.m[n]
                self.t[n] = t = t0 + 1
                D_new = self._D(n, t)
                self.W[n] = W - lr / (1 - b1 ** t) * self.m[n] / D_new
                for r in range(P):
                    self.e[r][n] = self.e[r][n] * (D / D_new)
                    self.c[r][n] = self.c[r][n] + gs[r]
                    self.A[r][n] = torch.zeros_like(W)
                self.B[n] = torch.zeros_like(W)
                continue
            if refresh and not local:
                G = sum(everyone[r][n].float() for r in range(P)) * (1.0 / P)
                if self.decoupled:
                    W = W * (1 - lr * wd)
                elif wd:
                    G = G + wd * W
                self.v[n] = b2 ** Wn * self.v[n] + (1 - b2 ** Wn) * G * G
                self.m[n] = b1 * self.m[n] + (1 - b1) * G
                self.t[n] = t = t0 + 1
                D_new = self._D(n, t)
                self.W[n] = W - lr / (1 - b1 ** t) * self.m[n] / D_new
                if self.precondition:
                    for r in range(P):
                        self.e[r][n] = self.e[r][n] * (D / D_new)
                continue
            if self.wire == "update":
                self._own_steps(n, W, everyone)
                continue
            X = torch.zeros_like(W)
            for r in range(P):
                g = everyone[r][n].float()
                if wd and not self.decoupled:
                    g = g + wd * W
                xr = g if self.wire == "gradient" else b1 * self.m[n] + (1 - b1) * g
                if local:
                    self.A[r][n] = b2 * self.A[r][n] + (1 - b2) * g ** 2
                    xr = g + self.c[r][n]
                    self.c[r][n] = torch.zeros_like(W)
                if self.precondition:
                    xr = xr / D
                acc = self.e[r][n] + xr
                sent = self.select(acc, xr) if self.needs_dw else \
                    self.select(acc, name=n, x=xr)
                self.e[r][n] = acc - sent
                X = X + sent
            X = X * (1.0 / P)
            if self.decoupled:
                W = W * (1 - lr * wd)
            self.t[n] += 1
            t = self.t[n]
            if local:
                self.B[n] = self.B[n] + X * D
            if self.wire == "gradient":
                self.m[n] = b1 * self.m[n] + (1 - b1) * (X * D if self.precondition else X)
                self.W[n] = W - lr / (1 - b1 ** t) * self.m[n] / D
            elif self.precondition:
                self.m[n] = X * D
                self.W[n] = W - lr / (1 - b1 ** t) * X
            else:
                self.m[n] = X
                self.W[n] = W - lr / (1 - b1 ** t) * X / D
