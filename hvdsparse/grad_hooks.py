"""The Horovod door's hooks on gradient accumulation, placed as Horovod places them:
``on_grad(name)`` runs once parameter ``name``'s gradient has been accumulated into
``p.grad`` (``register_post_accumulate_grad_hook``; on a torch without it, a hook on the
parameter's ``AccumulateGrad`` node), and ``on_backward_done()`` once at the end of each
backward pass that ran a hook (a callback queued on autograd's engine at the pass's
first hook; outside a backward pass nothing is queued). A parameter is hooked at most
once.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

__all__ = ["GradHooks"]


class GradHooks:
    """See the module docstring."""

    def __init__(self, on_grad: Callable[[str], None], on_backward_done: Callable[[], None]):
        self.on_grad = on_grad
        self.on_backward_done = on_backward_done
        self.handles: Dict[str, object] = {}
        self._grad_accs: list = []       # older torch: the AccumulateGrad nodes, kept alive
        self._queued = False

    def __contains__(self, name: str) -> bool:
        return name in self.handles

    def add(self, name: str, p: torch.Tensor) -> None:
        """Hook parameter ``name`` (once)."""
        if name in self.handles:
            return
        if hasattr(p, "register_post_accumulate_grad_hook"):
            h = p.register_post_accumulate_grad_hook(lambda _p, _n=name: self.on_grad(_n))
        else:  # older torch: Horovod's way, a hook on the AccumulateGrad node
            grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
            h = grad_acc.register_hook(lambda *a, _n=name: self.on_grad(_n))
            self._grad_accs.append(grad_acc)
        self.handles[name] = h

    def remove(self) -> None:
        for h in self.handles.values():
            h.remove()
        self.handles = {}

    def queue_backward_done(self) -> None:
        """From a hook: ``on_backward_done`` at the end of this backward pass (queued
        once per pass)."""
        if self._queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._done)
            self._queued = True
        except RuntimeError:
            pass

    def _done(self) -> None:
        self._queued = False
        self.on_backward_done()
