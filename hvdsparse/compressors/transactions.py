"""Per-step transactions of a compressor: :class:`StepTransactions` lets the caller undo
a step whose update was skipped (a non-finite gradient, a skipped ``GradScaler`` step).

``begin_step(step)`` opens a step. The first time ``compress`` or ``after_exchange``
touches a layer inside the step, the layer's residual (copied into a reused buffer)
and its algorithm state (thresholds, Slim-DP core, histories; containers copied,
tensors shared -- they are replaced, never modified in place) are snapshotted.
``commit()`` keeps everything; ``rollback()`` puts every touched layer back exactly
as it was at ``begin_step`` (bitwise residual, same state objects; a residual or
state created during the step is removed; a residual flushed by a policy-dense
step comes back), so the next step behaves as if the skipped step had never run.
Not rolled back: ``stats()`` (the skipped step's bytes did travel) and anything
keyed by the step number (the caller decides whether the skipped step's number is
used again). ``compress``/``after_exchange`` while ``transactional`` is set but no
step is open, ``begin_step`` while one is open, and ``commit``/``rollback`` with
none open raise ``RuntimeError``. With ``transactional=False`` (default)
``begin_step``/``commit``/``rollback`` are no-ops and nothing is copied (except
that ``begin_step`` folds the last step's counts into ``stats()``, device ops only:
:meth:`hvdsparse.stats.StatsCollector.fold`).

:class:`StepTransactions` is a mixin of :class:`~hvdsparse.compressors.base.Compressor`;
it reads and writes the compressor's ``transactional``, ``_txn`` (open step: layer ->
snapshot), ``_txn_step``, ``_snap_bufs`` (reused residual copies), ``_residuals``,
``_layers``, ``_absent`` (no snapshots while a ``compress_absent`` runs) and ``_stats``.
"""
from __future__ import annotations

import torch


_MISSING = object()


def snapshot_state(x):
    """Snapshot of a layer's algorithm state for :meth:`Compressor.rollback`: containers
    are copied, tensors are shared. Valid because compressors never modify a layer-state
    tensor in place -- they replace it (``st["tau"] = torch.where(...)``) -- so sharing
    costs nothing and stays exact (a core of beta*n indices is not copied every step)."""
    if isinstance(x, dict):
        return {k: snapshot_state(v) for k, v in x.items()}
    if isinstance(x, list):
        return [snapshot_state(v) for v in x]
    if isinstance(x, tuple):
        return tuple(snapshot_state(v) for v in x)
    return x


class StepTransactions:
    """``begin_step`` / ``commit`` / ``rollback`` (see the module docstring)."""

    def begin_step(self, step: int):
        """Open step ``step`` (before its first ``compress``); see the class docstring."""
        self._stats.fold()      # last step's counts into the statistics (device ops)
        if not self.transactional:
            return
        if self._txn is not None:
            raise RuntimeError(f"{type(self).__name__}.begin_step({step}): step "
                               f"{self._txn_step} is still open (call commit() or "
                               f"rollback() first)")
        self._txn = {}
        self._txn_step = step

    def commit(self):
        """The step's update was applied: keep the compressor state as it is."""
        if not self.transactional:
            return
        if self._txn is None:
            raise RuntimeError(f"{type(self).__name__}.commit() without begin_step()")
        self._txn = None
        self._txn_step = None

    def rollback(self):
        """The step was skipped: every layer touched since ``begin_step`` gets back its
        residual and algorithm state (see the class docstring)."""
        if not self.transactional:
            return
        if self._txn is None:
            raise RuntimeError(f"{type(self).__name__}.rollback() without begin_step()")
        for name, (rsnap, ssnap) in self._txn.items():
            if rsnap is None:
                self._residuals.pop(name, None)
            else:
                r, buf = rsnap
                r.copy_(buf)
                self._residuals[name] = r
            if ssnap is _MISSING:
                self._layers.pop(name, None)
            else:
                self._layers[name] = ssnap
        self._txn = None
        self._txn_step = None

    def _touch(self, name: str):
        """Snapshot layer ``name`` before its first change in the open step."""
        if self._absent or not self.transactional:
            return
        txn = self._txn
        if txn is None:
            raise RuntimeError(f"{type(self).__name__}: transactional=True but layer "
                               f"{name!r} is compressed outside begin_step()/commit()")
        if name in txn:
            return
        r = self._residuals.get(name)
        rsnap = None
        if r is not None:
            buf = self._snap_bufs.get(name)
            if buf is None or buf.numel() != r.numel() or buf.device != r.device:
                buf = torch.empty_like(r)
                self._snap_bufs[name] = buf
            buf.copy_(r)
            rsnap = (r, buf)
        st = self._layers.get(name, _MISSING)
        txn[name] = (rsnap, _MISSING if st is _MISSING else snapshot_state(st))
