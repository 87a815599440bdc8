"""Run Horovod 0.28.1's own ``TorchTests`` optimizer tests with every
``hvd.DistributedOptimizer`` call forced through hvdsparse (run under ``horovodrun``).

Usage: horovodrun -np 2 ... python upstream_worker.py <horovod source dir> <test,test,...>

``<horovod source dir>`` holds ``test/parallel/test_torch.py`` and ``test/utils/common.py``
of Horovod 0.28.1 (read at test time, never copied into this repository). After
``import hvdsparse`` (the routing), ``horovod.torch.DistributedOptimizer`` is replaced by
:func:`forced`, which sends every call -- whatever ``compression`` the upstream test
passes (Horovod's own compressors would otherwise go to Horovod untouched) -- to
``hvdsparse.DistributedOptimizer`` with ``compression=hvdsparse.NoCompression()`` (exact:
a dense fp32 exchange through hvdsparse's scheduler, codec and exchange) and
``nonfinite="propagate"`` (Horovod lets NaN/Inf travel; hvdsparse's default would raise).

With ``HVDSPARSE_UPSTREAM_BASELINE=1`` every test runs twice in the same processes: first
with Horovod's own ``DistributedOptimizer`` (the baseline: what the upstream test does on
this torch), then with :func:`forced`; by default only with :func:`forced`. Prints, from every rank, one line per test and variant:
``[upstream] rank=<r> <variant> <test> <ok|FAIL|ERROR|skip> hvdsparse_optimizers=<n> <detail>``
with variant ``horovod`` or ``hvdsparse``.

Harness adjustments (not to the tests' logic), each for a reason outside hvdsparse:

* ``TorchTests.tearDown`` shuts Horovod down after every test under Gloo; re-initialising
  Gloo in the same process then aborts (``gloo::IoException: connect ... Connection
  refused``), so tearDown is a barrier here and Horovod stays initialised;
* ``torch.optim.Muon`` (added in torch 2.9, after Horovod 0.28.1; it accepts 2-D
  parameters only) is hidden from ``test_broadcast_state``'s discovery of every
  ``torch.optim`` optimizer class (its ``__module__`` is renamed), which would otherwise
  fail constructing it for a bias with Horovod's own optimizer as well.
"""
from __future__ import annotations

import inspect
import io
import os
import sys
import time
import traceback
import unittest
import unittest.mock
import warnings

import horovod.torch as hvd
import hvdsparse

SRC, NAMES = sys.argv[1], sys.argv[2].split(",")
sys.path.insert(0, os.path.join(SRC, "test", "parallel"))
sys.path.insert(0, os.path.join(SRC, "test", "utils"))
# test/utils/common.py imports the ``mock`` backport; the standard library has the same API
sys.modules.setdefault("mock", unittest.mock)

_HOROVOD = hvdsparse.horovod_original()
_POSITIONAL = [p for p in inspect.signature(_HOROVOD).parameters][1:]
created = []


def forced(optimizer, *args, **kwargs):
    """Every DistributedOptimizer call -> hvdsparse, compression=NoCompression()."""
    merged = dict(kwargs)
    for key, value in zip(_POSITIONAL, args):
        if key in merged:
            raise TypeError(f"DistributedOptimizer() got multiple values for {key!r}")
        merged[key] = value
    merged["compression"] = hvdsparse.NoCompression()
    # Horovod's semantics for NaN/Inf: they travel like any value (an allreduce of a NaN is
    # NaN). hvdsparse's default raises instead; test_dynamic_requires_grad's model diverges
    # to Inf by its 6th step, which Horovod never notices.
    merged.setdefault("nonfinite", "propagate")
    opt = hvdsparse.DistributedOptimizer(optimizer, **merged)
    created.append(opt)
    return opt


import torch  # noqa: E402
import test_torch  # noqa: E402  (Horovod's file)

if hasattr(torch.optim, "Muon"):
    torch.optim.Muon.__module__ = "hidden_from_horovod_0_28_1.Muon"
test_torch.TorchTests.tearDown = lambda self: hvd.barrier() if hvd.is_initialized() else None


def main():
    warnings.simplefilter("ignore")
    for name in NAMES:
        variants = ("horovod", "hvdsparse") if os.environ.get(
            "HVDSPARSE_UPSTREAM_BASELINE") == "1" else ("hvdsparse",)
        for variant in variants:
            hvd.DistributedOptimizer = forced if variant == "hvdsparse" else _HOROVOD
            run_one(name, variant)
    hvd.DistributedOptimizer = hvdsparse.optimizer.routed_distributed_optimizer
    hvd.barrier()
    print(f"HVDSPARSE-OK rank={hvd.rank()}", flush=True)


def run_one(name, variant):
    """Run one TorchTests method; print its status on this rank."""
    n0 = len(created)
    t0 = time.time()
    stream = io.StringIO()
    result = unittest.TextTestRunner(stream=stream, verbosity=0).run(
        test_torch.TorchTests(name))
    if result.skipped:
        status, detail = "skip", result.skipped[0][1]
    elif result.errors:
        status, detail = "ERROR", result.errors[0][1]
    elif result.failures:
        status, detail = "FAIL", result.failures[0][1]
    else:
        status, detail = "ok", ""
    for opt in created[n0:]:
        try:
            opt.scheduler.remove_hooks()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    tail = detail.strip().splitlines()[-1] if detail.strip() else ""
    print(f"[upstream] rank={rank} {variant} {name} {status} hvdsparse_optimizers="
          f"{len(created) - n0} t={time.time() - t0:.1f}s {tail}", flush=True)
    if status in ("FAIL", "ERROR"):
        print(f"[detail] {variant} {name}\n{detail}", flush=True)


if __name__ == "__main__":
    main()
