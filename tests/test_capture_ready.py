"""A bucket's compress + encode + decode issues the same launches with the same
arguments at every steady-state step (the precondition of replaying it as a CUDA
graph), and between steps the host rewrites only the named per-step cells of the
bucket's staged row tables (``hvdsparse.row_tables``).

Counted through Triton's interpreter on the CUDA code path (``HVDSPARSE_FORCE_TRITON``),
with ``scripts/check_capture.py``'s recorder."""
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from hvdsparse.row_tables import RowTables  # noqa: E402

#: a small bucket: two conv weights, a linear weight and their biases (the biases go
#: dense by policy, so most compressors' buckets hold two groups)
SHAPES = [(64, 32, 1, 1), (64,), (32, 64, 3, 3), (32,), (96, 64), (96,)]

#: per compressor (``check_capture.MAKERS``): the table cells that may change from step
#: to step (seeds, sample offsets, rotation, the reused threshold's tensors)
CASES = {
    "topk": {"C_OFF"},
    "threshold": {"C_TIN", "C_TOUT"},
    "adacomp": {"C_ROT"},
    "qsgd": {"C_SEED"},
    "randomk": {"C_SEED"},
    "slimdp": {"C_SEED"},
}


@pytest.fixture
def forced_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")


@pytest.mark.parametrize("name", sorted(CASES))
def test_steady_steps_launch_alike(name, forced_triton, monkeypatch):
    import check_capture       # sets the forced-Triton environment: under the fixture
    may_change = CASES[name]
    row = check_capture.check(name, check_capture.MAKERS[name], steps=3, shapes=SHAPES,
                              patch=monkeypatch.setattr)
    assert row["launches"] >= 2, row
    assert row["staged_tables"] >= 1, row
    assert row["error_flag"] == 0, row            # the decode accepted every message
    assert row["differences"] == [], row["differences"]
    changed = set().union(*row["rewritten"].values()) if row["rewritten"] else set()
    assert changed <= may_change, (name, row["rewritten"])


def test_row_tables_keep_their_buffers():
    tables = RowTables(limit=2)
    dev = torch.device("cpu")
    a = tables.take(("k", ("l0", "l1")), 2, 5, dev)
    a.host[:] = np.random.randint(-9, 9, size=(2, 5))
    ta = a.upload()
    assert torch.equal(ta, torch.from_numpy(a.host))
    b = tables.take(("k", ("l0", "l1")), 2, 5, dev)
    assert b is a and b.upload().data_ptr() == ta.data_ptr()
    assert not b.host.any()                    # zeroed for the new step
    # another shape or key: another table; beyond the limit the oldest goes
    c = tables.take(("k", ("l0", "l1")), 3, 5, dev)
    assert c is not a and c.host.shape == (3, 5)
    tables.take(("j", ("l2",)), 1, 5, dev)
    assert tables.take(("k", ("l0", "l1")), 2, 5, dev) is not a
    assert len(tables.staged()) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_row_tables_cuda_rewrite_is_ordered():
    """On CUDA a group keeps one device buffer, and each step's rows reach what the
    stream queues after its upload: a copy queued between two steps' uploads sees the
    first step's rows, even when the second step's host rows are written while the
    first copy may still be in flight (the host buffer is then replaced, not reused)."""
    dev = torch.device("cuda")
    tables = RowTables()
    key = ("k", ("a", "b"))
    ptrs, snaps, want = set(), [], []
    for step in range(6):
        t = tables.take(key, 2, 7, dev)
        rows = np.random.randint(-2 ** 40, 2 ** 40, size=(2, 7))
        t.host[:] = rows
        d = t.upload()
        ptrs.add(d.data_ptr())
        snaps.append(d.clone())               # queued on the stream after the upload
        want.append(rows)
    torch.cuda.synchronize()
    assert len(ptrs) == 1
    for s, w in zip(snaps, want):
        assert np.array_equal(s.cpu().numpy(), w)
