"""An independent plain-torch replay of DGC's update rule (Lin et al., ICLR'18) for every
rank, shared by the Horovod and DDP momentum-correction checks.

Per compressed layer and rank r: g <- clip(g, c/sqrt(P)) + wd*w; u <- m*u + g (Nesterov:
x = g + m*u, else x = u); v <- v + x; send the exact top-k of |v|; v[S] = 0; u[S] = 0;
G = (sum of sent) / P; w <- w - lr*G. Layers under ``dense_below`` elements (sent dense by
the compressor's size policy) are clipped too and keep ordinary SGD momentum on G.
TopK's output-layer rule: the last compressed layer (in ``weights`` order) takes
``max(ratio, output_ratio)``. ``warmup=(T, S)``: DGC's exponential density warm-up in
``S`` stages over ``T`` steps (density ``r^((s+1)/(S+1))`` at stage ``s = floor(t S / T)``
for a layer of target density ``r``, then ``r``); while it holds a layer above both ``r``
and ``(1 - m) / 2`` that layer's velocity is not masked. ``masking=False``: never masked
(``momentum_masking=False``).
"""
import math

import torch

from tests.workers.topk_oracle import topk_indices


class DGCReplay:
    def __init__(self, weights, P, *, lr, m, wd, nesterov, clip, ratio, dense_below=1024,
                 output_ratio=0.1, warmup=None, masking=True):
        self.W = {n: w.detach().clone() for n, w in weights.items()}
        self.P, self.lr, self.m, self.wd = P, lr, m, wd
        self.nesterov, self.clip, self.ratio, self.dense_below = nesterov, clip, ratio, \
            dense_below
        self.u = [{n: torch.zeros_like(w) for n, w in self.W.items()} for _ in range(P)]
        self.v = [{n: torch.zeros_like(w) for n, w in self.W.items()} for _ in range(P)]
        self.buf = {}
        self.warmup, self.t = warmup, 0
        self.masking = masking
        compressed = [n for n, w in self.W.items() if w.numel() >= dense_below]
        self.layer_ratio = {n: ratio for n in compressed}
        if compressed and output_ratio is not None:
            self.layer_ratio[compressed[-1]] = max(ratio, output_ratio)

    def _clipped(self, g):
        if self.clip is None:
            return g
        c = self.clip / math.sqrt(self.P)
        return g * torch.clamp(c / (torch.linalg.vector_norm(g) + 1e-6), max=1.0)

    def _density(self, r):
        """(density at this step, whether masking applies) for target density ``r``."""
        if self.warmup is None or self.t >= self.warmup[0]:
            return r, True
        T, S = self.warmup
        d = max(r, min(1.0, r ** ((self.t * S // T + 1) / (S + 1))))
        return d, not (d > r and d > (1.0 - self.m) / 2)

    def step(self, everyone):
        """``everyone``: every rank's raw local gradients ``{name: tensor}``, in rank order."""
        P, m, wd, lr = self.P, self.m, self.wd, self.lr
        for n, W in self.W.items():
            if W.numel() < self.dense_below:
                G = sum(self._clipped(everyone[r][n].float()) for r in range(P)) * (1.0 / P)
                d = G + wd * W
                self.buf[n] = d.clone() if n not in self.buf else self.buf[n] * m + d
                upd = d + m * self.buf[n] if self.nesterov else self.buf[n]
                self.W[n] = W - lr * upd
                continue
            sent_sum = torch.zeros_like(W)
            for r in range(P):
                u, v = self.u[r], self.v[r]
                g = self._clipped(everyone[r][n].float()) + wd * W
                u[n] = u[n] * m + g
                v[n] = v[n] + (g + m * u[n] if self.nesterov else u[n])
                d, masked = self._density(self.layer_ratio[n])
                k = max(1, math.ceil(d * W.numel() - 1e-9))
                S = topk_indices(v[n], k)
                sent = torch.zeros(W.numel())
                sent[S] = v[n].reshape(-1)[S]
                v[n].view(-1)[S] = 0
                if masked and self.masking:
                    u[n].view(-1)[S] = 0
                sent_sum = sent_sum + sent.view_as(W)
            self.W[n] = W - lr * (sent_sum * (1.0 / P))
        self.t += 1
