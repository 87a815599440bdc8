"""Host-sync detector and the horovodrun worker that runs it over whole optimizer steps
(run by tests/test_host_sync.py with ``-np 2`` under ``TRITON_INTERPRET=1
HVDSPARSE_FORCE_TRITON=1``).

Why a dispatch mode: on CUDA a device-to-host synchronisation is forced by a handful
of aten operations, whatever Python spelling reached them (``t.item()``, ``int(t)``,
``bool(t)``, ``t.tolist()`` all end in ``aten._local_scalar_dense``; ``t[mask]`` in
``aten.index.Tensor`` with a bool index). A ``TorchDispatchMode`` sees every aten op
that runs on the calling thread -- inside the autograd hooks too -- so running the
forced-Triton path on CPU tensors with the mode active lists every op that *would*
stall the host on a GPU, with the Python call site that issued it.

What counts (:func:`sync_reason`):

* ``_local_scalar_dense`` -- item / int / float / bool / tolist of a tensor;
* ``nonzero``, ``argwhere``, ``masked_select``, ``unique*`` -- output size depends on
  the data, so CUDA copies the size to the host;
* ``index.Tensor`` / ``index_put(_)`` with a bool or uint8 index -- a mask index is a
  ``nonzero``;
* ``equal`` (returns a host bool), ``allclose`` (ends in ``_local_scalar_dense``);
* ``bincount`` (CUDA reads ``max()`` to size its output), ``histc`` with min == max,
  ``repeat_interleave`` without ``output_size``;
* ``_to_copy`` / ``copy_`` between a CUDA tensor and a CPU tensor without
  ``non_blocking=True`` (never seen on a CPU-only run: every tensor is on the CPU there,
  and a CPU->CPU copy is no synchronisation);
* ``Tensor.tolist()``, ``Tensor.cpu()`` and ``Tensor.to(<cpu>)`` on a line that names
  ``cpu`` (these dispatch nothing for a CPU tensor, so they are wrapped while the mode
  is active; ``numpy()`` is not: on a GPU it raises for a device tensor instead of
  synchronising, so it only ever reads host memory).

Not seen by the mode (limits of a CPU run, stated so nobody relies on it): ops issued
from C++ threads (Horovod's background loop), ``torch.cuda.synchronize`` / event waits
(no CUDA here; the exchange's :class:`hvdsparse.exchange.HostReadout` reads are
recorded separately by wrapping ``HostReadout.get``), and H2D copies of host data
(``torch.tensor(list, device=cuda)`` is a CPU tensor creation here; the mode lists
``lift_fresh`` sites in hvdsparse as *informational* so they can be reviewed).

Nor code that branches on the device type (``t.is_cuda``, ``device.type == "cuda"``):
a CPU run takes the CPU branch. At the time of writing that is
``scheduler._apply_nonfinite_policy`` (with ``nonfinite="skip"`` a CUDA run reads the
non-finite table with ``.cpu()`` every step), ``compressors.base.uniform`` (the Philox
kernel on CUDA) and the codec's pinned upload of cached layout images.

Ops dispatched while Triton's interpreter emulates a kernel are ignored (on a GPU that
is one asynchronous launch).

Worker: for every compressor (TopK, Threshold, AdaComp, AdaComp with a layer budget, SlimDP,
RandomK, QSGD, TopK int4, TopK per_bucket) x exchange (allgather, split, dense, auto), a
tiny MLP trains ``STEPS`` steps with ``hvdsparse.DistributedOptimizer(...,
validate=False)`` (the trusted decode that CUDA uses) and ``fusion_threshold=0`` (one bucket per layer, so
buckets launch from the backward hooks from step 1 on). Every record is printed as one
``SYNC {json}`` line (phase ``backward`` or ``step``, op, reason, innermost hvdsparse /
kernels call site and the chain of repository frames); readouts as ``READOUT {json}``;
per combination ``COMBO {json}`` with the number of aten ops seen per phase that came
from hvdsparse code (the proof that the mode saw the hooks). The test asserts.
"""
from __future__ import annotations

import json
import linecache
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
_REPO_DIRS = tuple(str(ROOT / d) + os.sep for d in ("hvdsparse", "kernels"))
_TESTS = str(ROOT / "tests") + os.sep
_INTERPRETER = os.sep + os.path.join("triton", "runtime", "interpreter.py")

aten = torch.ops.aten

_ALWAYS = {
    "aten::_local_scalar_dense": "item/int/float/bool/tolist of a tensor",
    "aten::nonzero": "nonzero (data-dependent size)",
    "aten::argwhere": "argwhere (data-dependent size)",
    "aten::masked_select": "masked_select (data-dependent size)",
    "aten::unique_dim": "unique (data-dependent size)",
    "aten::_unique": "unique (data-dependent size)",
    "aten::_unique2": "unique (data-dependent size)",
    "aten::unique_consecutive": "unique (data-dependent size)",
    "aten::unique_dim_consecutive": "unique (data-dependent size)",
    "aten::equal": "equal (returns a host bool)",
    "aten::allclose": "allclose (returns a host bool)",
    "aten::is_nonzero": "bool of a tensor",
    "aten::bincount": "bincount (CUDA reads max() for the output size)",
}


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _dev_type(x) -> str:
    if isinstance(x, torch.Tensor):
        return x.device.type
    if isinstance(x, (str, torch.device)):
        return torch.device(x).type
    return ""


def _to_cpu_literal(args, kwargs, frame) -> bool:
    if not _targets_cpu(args, kwargs):
        return False
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return "cpu" in line


def _targets_cpu(args, kwargs) -> bool:
    for x in list(args) + [kwargs.get("device")]:
        if isinstance(x, (str, torch.device)):
            try:
                return torch.device(x).type == "cpu"
            except (RuntimeError, TypeError):
                return False
    return False


def sync_reason(func, args, kwargs):
    """Why ``func(*args, **kwargs)`` would synchronise the host on CUDA, or None."""
    name = func._schema.name
    if name in _ALWAYS:
        return _ALWAYS[name]
    if name in ("aten::index", "aten::index_put", "aten::index_put_",
                "aten::_index_put_impl_"):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(_is_mask(i) for i in (idx or ()) if i is not None):
            return f"{name[6:]} with a boolean mask (a nonzero)"
        return None
    if name == "aten::histc":
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return "histc with min == max (reads min/max)" if lo == hi else None
    if name == "aten::repeat_interleave":
        if isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None and \
                (len(args) < 2 or isinstance(args[1], torch.Tensor) or
                 func.overloadpacket is aten.repeat_interleave and
                 str(func._overloadname) == "Tensor"):
            return "repeat_interleave without output_size"
        return None
    if name == "aten::_to_copy":
        src = args[0]
        dst = kwargs.get("device")
        if dst is not None and {_dev_type(src), _dev_type(dst)} == {"cpu", "cuda"} \
                and not kwargs.get("non_blocking", False):
            return f"blocking {_dev_type(src)}->{_dev_type(dst)} copy"
        return None
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if {_dev_type(src), _dev_type(dst)} == {"cpu", "cuda"} and not nb:
            return f"blocking {_dev_type(src)}->{_dev_type(dst)} copy_"
        return None
    return None


def _repo_frames(frame):
    """Raw (filename, line, function) of the repository frames on the stack, innermost
    first, or None when the op was dispatched inside Triton's interpreter (i.e. inside
    a kernel launch)."""
    raw = []
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if fn.endswith(_INTERPRETER):
            return None
        if fn.startswith(_REPO_DIRS) or fn.startswith(_TESTS):
            raw.append((fn, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return raw


def _fmt(raw):
    chain = [f"{os.path.relpath(fn, ROOT)}:{ln} in {name}" for fn, ln, name in raw]
    inner = next((c for c in chain if c.startswith(("hvdsparse", "kernels"))),
                 chain[0] if chain else "?")
    return inner, chain


def call_sites(frame):
    """(innermost hvdsparse/kernels frame 'path:line in func' -- or the innermost
    repository frame --, chain of repository frames innermost first), or None inside
    Triton's interpreter."""
    raw = _repo_frames(frame)
    return None if raw is None else _fmt(raw)


class HostSyncDetector(TorchDispatchMode):
    """Records ops that would force a device->host sync on CUDA, per ``phase``.

    Set ``detector.phase`` to a label before the code to watch and to None after;
    ops with ``phase`` None are not recorded. ``records``: list of dicts (phase, op,
    reason, site, chain); ``hvd_ops``: Counter phase -> aten ops issued from hvdsparse
    or kernels code (sanity: the mode saw the hooks); ``fresh``: informational
    ``torch.tensor(<host data>)`` sites in hvdsparse (H2D copies when on a GPU).
    """

    def __init__(self):
        super().__init__()
        self.phase = None
        self.records = []
        self.hvd_ops = Counter()
        self.fresh = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase is not None:
            self._observe(func, args, kwargs, sys._getframe(1))
        return func(*args, **kwargs)

    # Host reads that dispatch no aten op on a CPU tensor (on a GPU each is a blocking
    # D2H copy): Tensor.tolist / cpu / to(cpu) are wrapped while the mode is on.
    # ``to(device)`` counts only when its source line names "cpu": on a CPU-only run a
    # tensor's own device is "cpu" too, and ``t.to(t_other.device)`` is no copy on a GPU.
    # ``numpy()`` is not wrapped: on a GPU it raises for a device tensor (no silent
    # sync), so it only ever reads host memory.
    _HOST_READS = ("tolist", "cpu", "to")

    def __enter__(self):
        det = self
        self._saved = {m: getattr(torch.Tensor, m) for m in self._HOST_READS}

        def wrap(meth, orig):
            def f(t, *a, **k):
                if det.phase is not None and (meth != "to" or _to_cpu_literal(
                        a, k, sys._getframe(1))):
                    det._host_read(meth, sys._getframe(1))
                return orig(t, *a, **k)
            f.__name__ = meth
            return f
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, wrap(m, orig))
        return super().__enter__()

    def __exit__(self, *exc):
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, orig)
        return super().__exit__(*exc)

    def _host_read(self, meth, frame):
        sites = call_sites(frame)
        if sites is None:
            return
        inner, chain = sites
        self.records.append(dict(phase=self.phase, op=f"Tensor.{meth}",
                                 reason=f"Tensor.{meth}() (a blocking D2H copy of a device "
                                        f"tensor)", site=inner, chain=chain[:8]))

    def _observe(self, func, args, kwargs, frame):
        raw = _repo_frames(frame)
        if raw is None:
            return                       # inside an (interpreted) kernel
        phase = self.phase
        ours = any(fn.startswith(_REPO_DIRS) for fn, _, _ in raw)
        if ours:
            self.hvd_ops[phase] += 1
        reason = sync_reason(func, args, kwargs)
        if reason:
            inner, chain = _fmt(raw)
            self.records.append(dict(phase=phase, op=str(func), reason=reason, site=inner,
                                     chain=chain[:8]))
        elif ours and func._schema.name in ("aten::lift_fresh", "aten::lift_fresh_copy"):
            self.fresh[(phase, _fmt(raw)[0])] += 1


class ReadoutRecorder:
    """Wraps ``HostReadout.get`` (the exchange's deferred device reads) to log where the
    host reads device values it copied earlier, and whether the copy was complete."""

    def __init__(self, detector: HostSyncDetector):
        from hvdsparse.exchange.base import HostReadout
        self.detector, self.records = detector, []
        self._cls, self._orig = HostReadout, HostReadout.get
        rec = self

        def get(self_ro):
            if rec.detector.phase is not None:
                sites = call_sites(sys._getframe(1)) or ("?", [])
                rec.records.append(dict(phase=rec.detector.phase, ready=self_ro.ready(),
                                        site=sites[0], chain=sites[1][:6]))
            return rec._orig(self_ro)
        HostReadout.get = get

    def close(self):
        self._cls.get = self._orig


# ---------------------------------------------------------------------------- worker

def tag_new(records: list, start: int, **tags) -> int:
    """Label the records appended since index ``start`` (``setdefault``: a record keeps
    what it already has); returns the new length, the next call's ``start``."""
    for r in records[start:]:
        for k, v in tags.items():
            r.setdefault(k, v)
    return len(records)


STEPS = 3
EXCHANGES = ("allgather", "split", "dense", "auto")


def compressors():
    import hvdsparse as hs
    return {
        "TopK": lambda: hs.TopK(0.05),
        "Threshold": lambda: hs.Threshold(0.95, life_span=2),
        "AdaComp": lambda: hs.AdaComp(),
        "AdaComp-budget": lambda: hs.AdaComp(mean_per_bin=2),
        "SlimDP": lambda: hs.SlimDP(alpha=0.2, beta=0.1, core_period=2),
        "RandomK": lambda: hs.RandomK(0.05),
        "QSGD": lambda: hs.QSGD(4),
        "TopK-int4": lambda: hs.TopK(0.05, values="int4"),
        "TopK-per_bucket": lambda: hs.TopK(0.05, per_bucket=8),
    }


def control_compressor():
    """Positive control: TopK whose compress() reads a device value (``.item()``), so the
    test can check that a sync inside the optimizer's hooks is caught end to end."""
    import hvdsparse as hs

    class SyncingTopK(hs.TopK):
        def compress(self, name, grad, step, **kw):
            grad.abs().max().item()                         # [control-sync]
            return super().compress(name, grad, step, **kw)
    return SyncingTopK(0.05)


def make_model():
    """Two weights of 1024 elements (compressed: min_numel=1024) and two biases (dense
    by policy): the smallest model with both kinds of layer."""
    import torch.nn as nn
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def main():
    import horovod.torch as hvd
    import torch.nn.functional as F
    import hvdsparse

    hvd.init()
    rank = hvd.rank()
    torch.set_num_threads(1)
    assert os.environ.get("HVDSPARSE_FORCE_TRITON") == "1" and \
        os.environ.get("TRITON_INTERPRET") == "1", "run with the forced-Triton interpreter"
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 and sys.argv[1] else None
    det = HostSyncDetector()
    readouts = ReadoutRecorder(det)
    runs = [(c, m, ex) for c, m in compressors().items() for ex in EXCHANGES]
    runs.append(("control", control_compressor, "allgather"))
    for cname, make, ex in runs:
        if True:
            combo = f"{cname}/{ex}"
            if only and cname not in only and combo not in only:
                continue
            torch.manual_seed(1234)
            model = make_model()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = hvdsparse.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                named_parameters=model.named_parameters(), compression=make(),
                exchange=ex, validate=False, fusion_threshold=0,
                momentum_masking=True)
            g = torch.Generator().manual_seed(100 + rank)
            n_rec, n_ro = len(det.records), len(readouts.records)
            det.hvd_ops.clear()
            t0 = time.time()
            with det:
                for step in range(STEPS):
                    x = torch.randn(16, 16, generator=g)
                    y = torch.randint(0, 16, (16,), generator=g)
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    det.phase = "backward"
                    loss.backward()
                    det.phase = "step"
                    opt.step()
                    det.phase = None
                    n_rec = tag_new(det.records, n_rec, combo=combo, step=step)
                    n_ro = tag_new(readouts.records, n_ro, combo=combo, step=step)
            # the exchange really ran: replicas identical after the steps
            sums = hvd.allgather_object([float(p.detach().double().sum())
                                         for p in model.parameters()], name=f"chk.{combo}")
            same = all(s == sums[0] for s in sums)
            strategies = opt.stats()["last"].get("strategies") if hasattr(opt, "stats") \
                else None
            print("COMBO " + json.dumps(dict(rank=rank, combo=combo, replicas_equal=same,
                                             hvd_ops=dict(det.hvd_ops),
                                             strategies=strategies,
                                             seconds=round(time.time() - t0, 2))), flush=True)
            opt._hvdsparse.remove_hooks() if hasattr(opt, "_hvdsparse") else None
    readouts.close()
    for r in det.records:
        print("SYNC " + json.dumps(dict(rank=rank, **r)), flush=True)
    for r in readouts.records:
        print("READOUT " + json.dumps(dict(rank=rank, **r)), flush=True)
    for (phase, site), n in sorted(det.fresh.items()):
        print("FRESH " + json.dumps(dict(rank=rank, phase=phase, site=site, n=n)), flush=True)
    hvd.shutdown()
    print(f"HVDSPARSE-OK rank={rank}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
