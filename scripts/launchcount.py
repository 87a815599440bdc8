"""Counting GPU launches without a GPU, under Triton's interpreter (``TRITON_INTERPRET=1``)
with ``HVDSPARSE_FORCE_TRITON=1`` (every dispatch takes the branch a CUDA tensor takes).

:class:`LaunchCounter` counts, while active (``with counter:``):

* aten ops dispatched (a ``TorchDispatchMode``) whose name is not in ``skip``: each
  counted as one launch (on CUDA most are exactly one kernel), an upper-bound proxy;
* Triton launches (``InterpretedFunction.run``), one each;

and not the ops the interpreter issues while it emulates a kernel. Subclasses that want
more than per-name counts override :meth:`LaunchCounter.record` (the issuing frame) or
:meth:`LaunchCounter.observe` (the arguments and, for aten ops, the result).

Used by ``scripts/count_device_ops.py``, ``scripts/count_bucket_compress.py`` and
``tests/test_bucket_compress.py`` (which puts ``scripts/`` on ``sys.path``).
"""
from __future__ import annotations

import sys
from collections import Counter

#: aten ops that launch no kernel: views, metadata, allocations, host scalar reads,
#: profiler markers, pinning
NO_LAUNCH = frozenset({
    "view", "detach", "slice", "t", "expand", "as_strided", "_unsafe_view", "alias",
    "unsqueeze", "squeeze", "reshape", "select", "permute", "transpose", "split",
    "chunk", "unbind", "empty", "new_empty", "empty_strided", "empty_like", "lift_fresh",
    "_reshape_alias", "narrow", "set_", "resolve_conj", "resolve_neg", "view_as",
    "_local_scalar_dense", "item", "is_nonzero", "size", "stride", "numel", "dim",
    "is_contiguous", "storage_offset", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "_record_function_enter_new", "_record_function_exit",
    "_pin_memory", "pin_memory", "is_pinned"})
#: host <-> device copies (a caller that states them separately skips these too)
COPIES = frozenset({"_to_copy", "to", "copy_"})


class LaunchCounter:
    """Per-name counts of aten ops (``aten``) and Triton launches (``triton``) while
    active. ``patch(obj, name, value)`` installs the Triton hook (``setattr``, or
    pytest's ``monkeypatch.setattr`` to undo it after a test)."""

    def __init__(self, skip=NO_LAUNCH, patch=setattr):
        import triton.runtime.interpreter as ti
        from torch.utils._python_dispatch import TorchDispatchMode

        self.aten, self.triton = Counter(), Counter()
        self.active, self.inside = False, 0
        outer = self
        orig = ti.InterpretedFunction.run

        def run(fn_self, *a, **k):
            if outer.active and not outer.inside:
                name = getattr(getattr(fn_self, "fn", None), "__name__", "?")
                outer.record("triton", name, sys._getframe(1))
                outer.observe("triton", name, a, k, None)
            outer.inside += 1
            try:
                return orig(fn_self, *a, **k)
            finally:
                outer.inside -= 1
        patch(ti.InterpretedFunction, "run", run)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, a=(), kw=None):
                name = func.overloadpacket.__name__
                counted = outer.active and not outer.inside and name not in skip
                if counted:
                    outer.record("aten", name, sys._getframe(1))
                out = func(*a, **(kw or {}))
                if counted:
                    outer.observe("aten", str(func), a, kw or {}, out)
                return out
        self.mode = Mode

    def record(self, kind: str, name: str, frame) -> None:
        """One launch of ``kind`` (``"aten"`` / ``"triton"``) named ``name``, issued from
        ``frame``."""
        (self.triton if kind == "triton" else self.aten)[name] += 1

    def observe(self, kind: str, name: str, args, kwargs, out) -> None:
        """The same launch with its arguments (``name``: the overload for aten ops, e.g.
        ``aten.cat.out``) and, for an aten op, its result (None for Triton: called
        before the launch). Default: nothing."""

    def clear(self):
        self.aten.clear()
        self.triton.clear()

    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())

    def __enter__(self):
        self.active = True
        self._m = self.mode()
        self._m.__enter__()
        return self

    def __exit__(self, *exc):
        self._m.__exit__(*exc)
        self.active = False
