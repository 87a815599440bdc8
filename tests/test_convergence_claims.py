"""Small, fast versions of the convergence benchmark's claims (scripts/bench_convergence.py).

The workloads are the benchmark's own (``scripts/workloads.py``: data, models, optimizer
settings), trained by W simulated data-parallel workers in one process, as
tests/test_convergence.py does: each worker owns a compressor bound to rank r of W and
its own data shard; every step each worker compresses every layer of its gradient, the
W payloads are decoded (``codec.payload_to_dense``) and averaged, handed to every
compressor's ``after_exchange`` (Slim-DP's core input) and applied by the workload's
optimizer on the single shared model -- what the distributed optimizer does. Dense runs
the same loop with the plain average. Fixed seeds, one per test; the quality bound is
tests/test_convergence.py's (``BOUND_PP``, reasoned there): within 2 pp of the same
seed's dense run, since the benchmark's 1 pp claim is about the mean over seeds and one
seed's difference spreads around it (AdaComp below: +0.3 pp on seed 0, -1.7 pp on
seed 1). Deterministic: the printed accuracies and parameter digests are the same under
any machine load.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from hvdsparse.codec import payload_to_dense
from hvdsparse.compressors import AdaComp, NoCompression, QSGD, SlimDP, Threshold, TopK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from workloads import make_workload  # noqa: E402

WORKERS = 2
BOUND_PP = 2.0      # tests/test_convergence.py's bound: the 1 pp mean claim + one seed's spread


def simulate(workload, make_comp, seed, epochs, workers=WORKERS):
    """Train ``workload`` with ``workers`` simulated ranks; returns (final eval dict,
    rank 0's compressor). The eval dict also carries ``params``, a SHA-256 digest (16 hex
    digits) of the final parameters: the run is deterministic (one process, one thread,
    seeded data and batches, counter-based compressor randomness), so the digest is the
    same under any machine load."""
    wls = [make_workload(workload, r, workers) for r in range(workers)]
    model = wls[0].model(seed)
    opt = wls[0].optimizer(model)
    params = dict(model.named_parameters())
    sent = {}

    def broadcast(rank):
        def f(t, name):
            if rank == 0:
                sent[name] = t.clone()
            return sent[name].clone()
        return f
    comps = [make_comp().bind(r, workers, broadcast=broadcast(r)) for r in range(workers)]
    step = 0
    for epoch in range(epochs):
        for batches in zip(*(w.batches(seed, epoch) for w in wls)):
            summed = {n: torch.zeros_like(p) for n, p in params.items()}
            for r, batch in enumerate(batches):
                model.zero_grad(set_to_none=True)
                wls[r].loss(model, batch).backward()
                for n, p in params.items():
                    summed[n] += payload_to_dense(comps[r].compress(n, p.grad, step,
                                                                    param=p.detach()))
            with torch.no_grad():
                for n, p in params.items():
                    avg = summed[n] / workers
                    for c in comps:
                        c.after_exchange(n, avg, step, param=p.detach())
                    p.grad = avg
            opt.step()
            step += 1
    model.eval()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return dict(wls[0].evaluate(model), params=h.hexdigest()[:16]), comps[0]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_dense = {}


def _dense_acc(workload, seed, epochs):
    key = (workload, seed, epochs)
    if key not in _dense:
        ev = simulate(workload, NoCompression, seed, epochs)[0]
        print(f"\n[claims] {workload} seed {seed} dense acc {100 * ev['acc']:.2f}% "
              f"params {ev['params']}")
        _dense[key] = ev["acc"]
    return _dense[key]


def _report(label, ev, base):
    print(f"[claims] {label} acc {100 * ev['acc']:.2f}% (dense {100 * base:.2f}%, diff "
          f"{100 * (ev['acc'] - base):+.2f} pp) params {ev['params']}")


def test_slimdp_default_reselects_and_keeps_quality():
    """Slim-DP at the paper's alpha/beta and the measured default q (core_period=100):
    in a 220-step run the core is re-selected (steps 0, 99, 199: the last core serves
    from step 200) and accuracy stays within ``BOUND_PP`` of dense (measured: -1.11 pp on
    this seed; the old default q = 1000, which never re-selects here, gave -1.4 pp on
    this seed and -3.6 pp on seed 0)."""
    base = _dense_acc("digits-cnn", 1, 10)
    ev, comp = simulate("digits-cnn", lambda: SlimDP(0.3, 0.15), 1, 10)
    _report("SlimDP(0.3, 0.15)", ev, base)
    assert comp.core_period == 100
    for name in ("conv2.weight", "conv3.weight", "fc.weight"):
        assert comp._layers[name]["core_step"] == 200, (name, comp._layers[name])
    assert 100 * (ev["acc"] - base) >= -BOUND_PP, (ev, base)


@pytest.mark.parametrize("label,make", [("AdaComp()", AdaComp), ("QSGD(4)", lambda: QSGD(4))])
def test_cnn_defaults_keep_quality(label, make):
    """digits-cnn (conv layers: AdaComp's 50-element conv bins), 2 workers, 10 epochs,
    seed 0: within ``BOUND_PP`` of dense (measured: AdaComp +0.28 pp, QSGD +0.28 pp; on
    seed 1 AdaComp was -1.7 pp, which is why the benchmark averages 3 seeds)."""
    base = _dense_acc("digits-cnn", 0, 10)
    ev, comp = simulate("digits-cnn", make, 0, 10)
    _report(label, ev, base)
    st = comp.stats()
    for name in ("conv2.weight", "conv3.weight"):      # the conv layers are compressed
        assert st[name]["mean_compression_rate"] > 5, (name, st[name])
    assert 100 * (ev["acc"] - base) >= -BOUND_PP, f"{label}: {ev} vs dense {base}"
