"""Convergence with simulated data-parallel workers (single process, CPU).

An MLP 64-256-10 on scikit-learn's bundled digits data set (``load_digits``, no
download) is trained by 4 simulated workers: each worker owns its own compressor
instance (``bind(rank, 4)``) and a quarter of the training set; every step each worker
computes the gradient of its mini-batch, compresses every layer, all 4 payloads are
decoded (``codec.payload_to_dense``), averaged, handed back through
``after_exchange`` (Slim-DP's core input) and applied with the same SGD-momentum update
on the single shared model -- exactly what the distributed optimizer does.

The two weight matrices (256x64 = 16384 and 10x256 = 2560 elements) are above the
1024-element size floor and are compressed; the two biases (1-D) travel dense by the
default policy. The test asserts that compression really happens on the weights.

Pass criterion: test accuracy within ``BOUND_PP`` = 2 percentage points of the dense
baseline trained in the same process with the same seed, data split, batches and
schedule (SGD, momentum 0.9, lr 0.1 with cosine decay, 60 epochs of 4 x 32 samples per
step, ~540 steps). The "within 1 pp of dense" claim is about the mean over seeds (the
convergence benchmark, scripts/bench_convergence.py, 3-6 seeds per row); one seed's
difference spreads around that mean: the paired standard deviation over seeds is 0.2-0.6
pp for these compressors at P = 2 and up to ~1 pp at P = 4 with a constant rate, on the
digits workloads (the benchmark's JSON under docs/bench/convergence); here Threshold
gives -0.93 pp on seed 1234 and 0.00 pp on seed 0. A single-seed bound at 1 pp would
therefore fail a compressor that meets the claim, and its verdict hinges on one test
sample (0.19 pp of the 540): a last-bit change in the arithmetic (another CPU's BLAS
kernels, another code path with the same contract) changes the final parameters and
can move the accuracy by a sample or two (Threshold on seed 1234 gave -1.11 pp on
another 2-core machine). 2 pp leaves the 1 pp claim two standard deviations (at 0.5 pp)
for one seed's spread, and still fails a compressor that really costs accuracy.

The simulation is deterministic: one process, one intra-op thread, seeded data, model
and batches, counter-based compressor randomness. The same accuracies and final
parameters (the printed digest) come out under any machine load.

SlimDP uses ``core_period=100`` (the paper's q = 20k-50k is for runs of 10^5+ steps; a
core that is never re-selected in a 540-step run would test nothing); Threshold uses
the paper's default life-span L = 1000, i.e. its threshold is computed once at step 0
and kept (raised by the overflow guard) for the whole run.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

from hvdsparse.codec import payload_to_dense
from hvdsparse.compressors import AdaComp, NoCompression, QSGD, SlimDP, Threshold, TopK

SEED = 1234
HIDDEN = 256
WORKERS = 4
BATCH = 32          # per worker
EPOCHS = 60
LR = 0.1
MOMENTUM = 0.9
BOUND_PP = 2.0      # the 1 pp mean claim + one seed's spread (module docstring)


def _data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=SEED, stratify=y)
    return (torch.from_numpy(Xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(Xte), torch.from_numpy(yte).long())


def _model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 10))


def digest(model) -> str:
    """SHA-256 (first 16 hex digits) of the model's parameters' bytes, in order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(make_compressor, data):
    Xtr, ytr, Xte, yte = data
    model = _model()
    params = dict(model.named_parameters())
    # simulated ranks call after_exchange in rank order: rank 0's broadcast tensor (the
    # Slim-DP core) is handed to the others, as hvd.broadcast would
    sent = {}

    def broadcast(rank):
        def f(t, name):
            if rank == 0:
                sent[name] = t.clone()
            return sent[name].clone()
        return f
    comps = [make_compressor().bind(r, WORKERS, broadcast=broadcast(r))
             for r in range(WORKERS)]
    shards = [torch.arange(r, Xtr.shape[0], WORKERS) for r in range(WORKERS)]
    per_epoch = min(len(s) for s in shards) // BATCH
    total = EPOCHS * per_epoch
    mom = {n: torch.zeros_like(p) for n, p in params.items()}
    g = torch.Generator().manual_seed(SEED)
    step = 0
    for epoch in range(EPOCHS):
        perms = [s[torch.randperm(len(s), generator=g)] for s in shards]
        for b in range(per_epoch):
            lr = LR * 0.5 * (1 + np.cos(np.pi * step / total))     # cosine decay
            summed = {n: torch.zeros_like(p) for n, p in params.items()}
            for r in range(WORKERS):
                idx = perms[r][b * BATCH:(b + 1) * BATCH]
                model.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx])
                loss.backward()
                for n, p in params.items():
                    payload = comps[r].compress(n, p.grad, step, param=p.detach())
                    summed[n] += payload_to_dense(payload)
            with torch.no_grad():
                for n, p in params.items():
                    avg = summed[n] / WORKERS
                    for c in comps:
                        c.after_exchange(n, avg, step, param=p.detach())
                    mom[n].mul_(MOMENTUM).add_(avg)
                    p.sub_(lr * mom[n])
            step += 1
    with torch.no_grad():
        acc = (model(Xte).argmax(1) == yte).float().mean().item()
    return acc, comps[0], digest(model)


CASES = [
    ("TopK(0.01)", lambda: TopK(0.01)),
    ("Threshold(0.99)", lambda: Threshold(0.99)),
    ("AdaComp()", lambda: AdaComp()),
    ("SlimDP(0.3, 0.15)", lambda: SlimDP(0.3, 0.15, core_period=100)),
    ("QSGD(4)", lambda: QSGD(4)),
]

_cache = {}


def _baseline(data):
    if "dense" not in _cache:
        t0 = time.time()
        acc, _, dig = train(NoCompression, data)
        _cache["dense"] = acc
        print(f"\n[convergence] seed={SEED} dense baseline test accuracy "
              f"{100 * acc:.2f}% params {dig} ({time.time() - t0:.1f} s)")
    return _cache["dense"]


@pytest.fixture(scope="module")
def data():
    # tiny tensors: intra-op threading only adds overhead (and collapses on a loaded
    # 2-core machine); restore the caller's setting afterwards
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _data()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("label,make", CASES, ids=[c[0] for c in CASES])
def test_converges_within_bound_of_dense(label, make, data):
    base = _baseline(data)
    t0 = time.time()
    acc, comp, dig = train(make, data)
    st = comp.stats()
    tot = comp.stats_totals()
    w = [n for n in st if n.endswith("weight")]
    rates = {n: st[n]["mean_compression_rate"] for n in w}
    eff = {n: st[n]["mean_effective_rate"] for n in w}
    print(f"[convergence] {label:18s} acc {100 * acc:.2f}% (dense {100 * base:.2f}%, "
          f"diff {100 * (acc - base):+.2f} pp) params {dig} | whole-model rate "
          f"{tot['compression_rate']:.1f}x (effective {tot['effective_rate']:.1f}x) | per weight: "
          + ", ".join(f"{n} {rates[n]:.1f}x/eff {eff[n]:.1f}x" for n in w)
          + f" | {time.time() - t0:.1f} s")
    for n in w:   # the big layers really are compressed
        assert st[n]["segments"] >= 1 and rates[n] > 1.5, (n, st[n])
        assert st[n]["index_encodings"] != ["DENSE"] or label.startswith("QSGD"), st[n]
    assert 100 * (acc - base) >= -BOUND_PP, \
        f"{label}: {100 * acc:.2f}% vs dense {100 * base:.2f}% (bound -{BOUND_PP} pp)"
