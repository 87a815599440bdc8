"""CUDA graph capture and replay emulated on the CPU, under Triton's interpreter
(``TRITON_INTERPRET=1``, ``HVDSPARSE_FORCE_TRITON=1``): a backend for
:class:`hvdsparse.device_graphs.SegmentGraphs`.

A CUDA graph records a segment's launches once and replays them: the same kernels with
the same scalar arguments and the same device addresses, reading whatever those
addresses hold at replay. :class:`EmulatedGraphs` does the same with the interpreter:

* ``capture(thunk)`` runs the thunk once and records every launch it issues -- each
  Triton launch with its arguments, and each aten op that would be a CUDA launch (not
  views, allocations or metadata) with its arguments and results. The tensors the
  segment allocated stay alive in the recording: the graph's private pool.
* ``replay(handle)`` issues the recorded launches again with the recorded arguments: a
  Triton launch as recorded; an aten op recomputed from its recorded arguments and its
  result written into the recorded result (an in-place op writes where it wrote).

So a replay reads the current contents of every tensor it names -- the row table the
host rewrote, this step's gradients through the table's addresses -- and nothing the
host computed since the capture. A segment whose launches depend on host state missing
from its graph key replays stale launches here just as a GPU would, and a test comparing
replayed steps with eager ones sees it. Refused during a capture (``RuntimeError``), as a
CUDA capture fails on them: reading a device value on the host, building a tensor from
Python data (a pageable host-to-device copy on CUDA), and torch's random ops (a graph
replays their Philox offsets, which this emulation would not).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchcount import NO_LAUNCH  # noqa: E402

#: host reads of device values: a capture cannot contain them
HOST_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"})
#: a tensor made from Python data (``torch.tensor(...)``)
HOST_DATA = frozenset({"lift_fresh", "lift_fresh_copy"})
#: torch's random ops
RANDOM = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like",
                    "randint_like", "normal", "normal_",
                    "uniform_", "bernoulli", "bernoulli_", "multinomial", "random_",
                    "exponential_", "geometric_", "cauchy_", "log_normal_"})
#: recorded but not re-issued: views, allocations, metadata (the recording keeps their
#: results, as a graph's pool keeps its allocations)
NOT_REISSUED = NO_LAUNCH - HOST_READS


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class EmulatedGraphs:
    """The backend (``applies`` / ``capture`` / ``replay``) for CPU tensors.
    ``patch(obj, name, value)`` installs the Triton launch hook (``setattr``, or pytest's
    ``monkeypatch.setattr`` to undo it after a test). ``launches``: launches recorded by
    every capture; ``reissued``: launches issued by every replay."""

    def __init__(self, patch=setattr):
        import triton.runtime.interpreter as ti
        from torch.utils._python_dispatch import TorchDispatchMode

        self._rec = None
        self._inside = 0
        self.launches = self.reissued = 0
        outer = self
        orig = ti.InterpretedFunction.run
        self._run = orig

        def run(fn_self, *a, **k):
            if outer._rec is not None and not outer._inside:
                outer._rec.append(("triton", fn_self, a, k, None))
            outer._inside += 1
            try:
                return orig(fn_self, *a, **k)
            finally:
                outer._inside -= 1
        patch(ti.InterpretedFunction, "run", run)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, a=(), kw=None):
                kw = kw or {}
                name = func.overloadpacket.__name__
                if outer._rec is not None and not outer._inside:
                    if name in HOST_READS:
                        raise RuntimeError(f"a device segment reads a device value on the "
                                           f"host ({func}): a CUDA graph cannot capture it")
                    if name in HOST_DATA:
                        raise RuntimeError(f"a device segment builds a tensor from host "
                                           f"data ({func}): on CUDA a pageable copy, which "
                                           f"a capture cannot hold")
                    if name in RANDOM:
                        raise RuntimeError(f"a device segment draws with torch's generator "
                                           f"({func}): not emulated")
                    out = func(*a, **kw)
                    if name not in NOT_REISSUED:
                        outer._rec.append(("aten", func, a, kw, out))
                    return out
                return func(*a, **kw)
        self._mode = Mode

    @staticmethod
    def applies(device: torch.device) -> bool:
        return device.type == "cpu"

    def capture(self, thunk):
        rec = []
        self._rec = rec
        try:
            with self._mode():
                outs = thunk()
        finally:
            self._rec = None
        self.launches += len(rec)
        return rec, outs

    def replay(self, rec) -> None:
        for kind, fn, a, k, out in rec:
            if kind == "triton":
                self._inside += 1
                try:
                    self._run(fn, *a, **k)
                finally:
                    self._inside -= 1
            else:
                new = fn(*a, **k)
                for r, n in zip(_tensors(out), _tensors(new)):
                    if r.data_ptr() != n.data_ptr() or r.shape != n.shape:
                        r.copy_(n)
            self.reissued += 1
