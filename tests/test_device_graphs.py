"""A bucket group's device segment replayed from a capture gives an eager step's bits
(``hvdsparse/device_graphs.py``), for every kind of row, checked without a GPU: the
CUDA graph backend is replaced by ``scripts/graph_emulator.py``, which records a
segment's launches through Triton's interpreter (``HVDSPARSE_FORCE_TRITON=1``) and
replays them with their recorded arguments, reading the tensors' current contents as a
graph does. With ``HVDSPARSE_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh``) the replay
tests run real CUDA graphs instead.

* Every compressor's bucket rows on the gradient wire (tests/test_bucket_compress.py's
  run: policy-dense, QSGD, TopK, Threshold with refresh and reuse steps, AdaComp with and
  without a layer budget, RandomK, Slim-DP; DGC's velocity; AMP's inverse loss scale;
  poisoned outputs) and on the Adam recipe's update wire (tests/test_adam_bucket.py's
  run: the own-step launch too): every payload segment, residual, velocity, non-finite
  count, statistic, Threshold's tau history and Adam's moments, step by step, against the
  same run eager, on fresh random data; segments were replayed (not only run eagerly).
* The contract's edges: a segment with hidden state replays the captured launch (so a
  key that missed an argument would be caught by the comparisons above); host reads,
  tensors built from Python data and torch's random ops are refused inside a capture; a
  closure or an unkeyable argument is refused; a changed argument or a moved table runs
  eagerly, then captures anew.
"""
import dataclasses
import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from hvdsparse import device_graphs  # noqa: E402
from hvdsparse.device_graphs import SegmentGraphs, run_segment, segment_key  # noqa: E402
from hvdsparse.row_tables import RowTables  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
from graph_emulator import EmulatedGraphs  # noqa: E402

import test_adam_bucket as TA  # noqa: E402
import test_bucket_compress as TB  # noqa: E402
import test_bucket_decode as TD  # noqa: E402
import hvdsparse  # noqa: E402
from hvdsparse import codec  # noqa: E402

DEV = torch.device(os.environ.get("HVDSPARSE_TEST_DEVICE", "cpu"))
cpu_only = pytest.mark.skipif(DEV.type != "cpu", reason="the emulator's own contract")


class Graphs:
    """Every owner's segments through one backend while :attr:`on`: the emulator on the
    CPU, CUDA graphs on a GPU (``HVDSPARSE_TEST_DEVICE=cuda``)."""

    def __init__(self, monkeypatch):
        if DEV.type == "cpu":
            monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
            self.emu = EmulatedGraphs(patch=monkeypatch.setattr)
        else:
            self.emu = device_graphs.CudaGraphs()
        self.on = False
        self.made = []

        def graphs_of(owner):
            if not self.on:
                return None
            g = getattr(owner, "segment_graphs", None)
            if g is None:
                g = device_graphs.enable(owner, self.emu)
                self.made.append(g)
            return g
        monkeypatch.setattr(device_graphs, "graphs_of", graphs_of)

    def count(self, what):
        return sum(getattr(g, what) for g in self.made)


@pytest.fixture
def graphs(monkeypatch):
    return Graphs(monkeypatch)


@pytest.mark.parametrize("kind,dtype,scale,mc", [
    ("topk", torch.float32, 0.5, True),
    ("threshold", torch.float32, None, False),
    ("adacomp-budget", torch.bfloat16, 0.5, True),
    ("qsgd", torch.float16, None, False),
    ("randomk", torch.float32, 0.25, True),
    ("slimdp", torch.float32, None, False),
])
def test_replay_gives_eager_bits_gradient_wire(monkeypatch, graphs, kind, dtype, scale, mc):
    TB._poison(monkeypatch)
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref, kinds, _ = TB._run("bucket", kind, dtype, scale, mc, seed, steps=5)
    graphs.on = True
    got, kinds2, _ = TB._run("bucket", kind, dtype, scale, mc, seed, steps=5)
    assert kinds == kinds2
    assert graphs.count("replays") >= 2 and graphs.count("captures") >= 2, \
        (graphs.count("eager"), graphs.count("captures"), graphs.count("replays"))
    for step, (a, b) in enumerate(zip(ref, got)):
        TB._same(a, b, f"seed {seed} {kind} step {step}")


@pytest.mark.parametrize("kind,gdt,scale", [
    ("topk", torch.float32, 0.5),
    ("threshold", torch.bfloat16, None),
    ("adacomp", torch.float32, None),
])
def test_replay_gives_eager_bits_update_wire(graphs, kind, gdt, scale):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref = TA._run(True, kind, TA.LAYERS, seed, gdt, scale, False, steps=5)
    graphs.on = True
    got = TA._run(True, kind, TA.LAYERS, seed, gdt, scale, False, steps=5)
    assert graphs.count("replays") >= 2
    # the Adam recipe's own-step segment replayed too
    owners = {type(g).__name__ for g in graphs.made}
    assert len(graphs.made) == 2, owners
    assert all(g.replays >= 2 for g in graphs.made), [(g.eager, g.captures, g.replays)
                                                        for g in graphs.made]
    for step, (a, b) in enumerate(zip(ref, got)):
        TB._same(a, b, f"seed {seed} {kind} step {step}")


SEG_TENSORS = ("count", "values", "indices", "scales", "bin_counts", "implicit_indices")


def _on_device(payloads):
    """The payloads' tensors on the test device (IMPLICIT indices must be there)."""
    out = []
    for p in payloads:
        segs = [dataclasses.replace(seg, **{f: getattr(seg, f).to(DEV) for f in SEG_TENSORS
                                            if isinstance(getattr(seg, f), torch.Tensor)})
                for seg in p.segments]
        out.append(dataclasses.replace(p, segments=segs))
    return out


def _refill(kept, fresh):
    """``fresh``'s contents copied into ``kept``'s tensors (same layout), in place: a
    compress replay's outputs, new values at the same addresses."""
    for p, q in zip(kept, fresh):
        for a, b in zip(p.segments, q.segments):
            for f in SEG_TENSORS:
                if isinstance(getattr(a, f), torch.Tensor):
                    getattr(a, f).copy_(getattr(b, f))


def _decode_step(rows, template, flat, flag, counts, graphs):
    """One step's decode into the poisoned ``flat`` as the allgather exchange runs it."""
    flag.zero_()
    outs, pos = [], 0
    for p in template:
        outs.append(flat[pos:pos + p.numel])
        pos += p.numel
    codec.accumulate(rows, template, outs, validate=False, error_flag=flag,
                     counts_out=counts, zero=True, graphs=graphs)


def test_encode_and_decode_replay_give_eager_bits(graphs):
    """A bucket's encode (narrowing + one cat into the kept message buffer, with a tail
    as the allgather's non-finite counts) and its decode (zero + check + one scatter per
    rank) replayed from captures: every step fresh payload contents at the same addresses
    (as compress replays leave them), the gathered rows a new tensor each time (as a
    collective returns them), some damaged, decoded into the same poisoned sum. The
    messages, the sums, the error flag and the count fields equal an eager run's, bit for
    bit, and the later steps replayed."""
    seed = TD.fresh_seed()
    rng = np.random.default_rng(seed)
    layout = TD._layout(rng)
    P = int(rng.integers(2, 4))
    kept = [_on_device(TD._rank_payloads(rng, layout)[0]) for _ in range(P)]
    template = kept[0]
    numel = sum(p.numel for p in template)
    nseg = sum(len(p.segments) for p in template)
    tails = [torch.zeros(len(layout), dtype=torch.int32, device=DEV) for _ in range(P)]
    nbytes = codec.encoded_nbytes(template) + 8 * (-(-4 * len(layout) // 8))
    messages = [torch.empty(nbytes, dtype=torch.uint8, device=DEV) for _ in range(P)]
    g = SegmentGraphs(graphs.emu)
    keep = [torch.empty(numel, device=DEV), torch.empty(1, dtype=torch.int32, device=DEV),
            torch.empty(P * nseg, dtype=torch.int32, device=DEV)]
    for step in range(6):
        for r in range(P):
            _refill(kept[r], _on_device(TD._rank_payloads(rng, layout)[0]))
            tails[r].copy_(torch.from_numpy(rng.integers(0, 9, len(layout), dtype=np.int32)))
        ref_msgs = [codec.encode(kept[r], tail=tails[r].view(torch.uint8)) for r in range(P)]
        for r in range(P):
            messages[r].fill_(0xA5)
            got = codec.encode(kept[r], out=messages[r], tail=tails[r].view(torch.uint8),
                               graphs=g)
            assert torch.equal(got.cpu(), ref_msgs[r].cpu()), f"seed {seed} step {step} " \
                f"rank {r}: message bytes differ"
        rows = torch.stack(ref_msgs).cpu()[:, :codec.encoded_nbytes(template)].clone()
        what = "valid"
        if step in (3, 5):
            what = TD._corrupt(rng, rows, template,
                               ["count", "header", "bins", "rel", "index"][rng.integers(5)])
        poison = torch.randn(numel, generator=torch.Generator().manual_seed(seed + step))
        ref = [poison.clone().to(DEV), torch.empty(1, dtype=torch.int32, device=DEV),
               torch.empty(P * nseg, dtype=torch.int32, device=DEV)]
        _decode_step(rows.to(DEV), template, *ref, graphs=None)
        keep[0].copy_(poison)
        _decode_step(rows.to(DEV), template, *keep, graphs=g)
        where = f"seed {seed} step {step} P={P} {what}"
        for a, b in zip(ref, keep):
            assert torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32)), where
        # random bit flips (TD._corrupt's fallback when the layout has no segment of the
        # kind asked for) may land in value bytes, which no check can see: then only the
        # agreement of the two decodes above is asserted
        if what != "flips":
            assert (int(ref[1]) != 0) == (what != "valid"), where
    # per step P encodes and one decode: each key's first step eager, its second
    # captured, the other four replayed
    assert (g.eager, g.captures, g.replays) == (P + 1, P + 1, 4 * (P + 1)), \
        (g.eager, g.captures, g.replays)


#: per exchange: (eager runs, captures, replays) over 5 steps of one bucket: allgather's
#: encode and decode; dense's own_dense encode and decode, its row / wire copy and its
#: reads; split's and balanced's own_dense two and their per-owner counts
SEGMENTS = {"allgather": (2, 2, 6), "dense": (4, 4, 12), "dense-fp16": (4, 4, 12),
            "split": (3, 3, 9), "balanced": (3, 3, 9)}


@pytest.mark.parametrize("name", sorted(SEGMENTS))
def test_exchange_replays_its_device_segments(graphs, name):
    """Every exchange with ``ExchangeContext.graphs`` (the step engine's, with
    ``cuda_graphs``), over 5 steps of fresh payload contents at fixed addresses: the
    same sums and non-finite count tables as the exchange eager, bit for bit, with its
    device segments replayed (allgather: the encode with the counts' tail, the rows
    copied home, the decode; dense: own_dense, the counts' row and the wire copy, the
    reads of the allreduced vector, in fp32 and on a 16-bit wire; split / balanced:
    own_dense and the per-owner counts). One rank on the in-process transport: the emulator records one thread's
    launches."""
    from hvdsparse import exchange
    from tests.thread_transport import on_threads
    import test_nonfinite_carriage as TN
    gen = torch.Generator().manual_seed(TN._seed())
    L = int(torch.randint(2, 6, (1,), generator=gen))
    spec, payloads, rows = TN._bucket(1, L, gen)
    kept, row = _on_device(payloads[0]), rows[0].to(DEV)
    strategy, _, wire = name.partition("-")
    carries = strategy in exchange.CARRY_NONFINITE

    def fresh():
        comp = hvdsparse.TopK(0.05, values="fp32", compress_1d=True, min_numel=1)
        return [comp.compress(p.name, torch.randn(p.numel, generator=gen), 0)
                for p in payloads[0]]
    steps = [(fresh(), torch.randint(0, 9, (1, L), generator=gen, dtype=torch.int32))
             for _ in range(5)]

    def run(g):
        def body(r, ctx):
            ctx.error_flag = ctx.error_flag.to(DEV)
            ctx.graphs, out = g, []
            if wire:
                ctx.dense_dtype = getattr(torch, {"fp16": "float16"}[wire])
            for pays, counts in steps:
                _refill(kept, _on_device(pays))
                row.copy_(counts)
                pend = exchange.launch(strategy, spec, kept, ctx,
                                       nonfinite_row=row if carries else None)
                out.append((pend.finish().clone(),
                            pend.nonfinite.clone() if carries else None))
                ctx.step += 1
            return out, int(ctx.error_flag[0])
        return on_threads(1, body, validate=False)[0]
    ref, ref_flag = run(None)
    g = SegmentGraphs(graphs.emu)
    got, flag = run(g)
    assert ref_flag == flag == 0
    for step, ((a, ta), (b, tb)) in enumerate(zip(ref, got)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {step}"
        # the sum is this rank's own selection, expanded (rounded to fp16 on that wire)
        want = torch.cat([codec.payload_to_dense(p).reshape(-1).float()
                          for p in _on_device(steps[step][0])])
        if wire:
            want = want.half().float()
        assert torch.equal(b.view(torch.int32), want.view(torch.int32)), f"step {step}"
        if carries:
            assert torch.equal(ta, tb), f"step {step}"
            assert torch.equal(tb.cpu(), steps[step][1]), f"step {step}"
    assert (g.eager, g.captures, g.replays) == SEGMENTS[name], \
        (g.eager, g.captures, g.replays)


# ------------------------------------------------------------------ the contract's edges
HIDDEN = {"add": 1.0}


def _hidden_segment(table, x):
    out = torch.empty_like(x)
    torch.add(x, HIDDEN["add"], out=out)       # a host value the key does not see
    return out


def _reads_host(table, x):
    return x * float(x.sum())


def _draws(table, x):
    return x + torch.rand_like(x)


def _host_data(table, x):
    return x + torch.tensor([1.0, 2.0, 3.0, 4.0])


def _plain(table, x, k):
    out = torch.empty_like(x)
    torch.mul(x, k, out=out)
    return out


def _owner(graphs):
    class Owner:
        pass
    o = Owner()
    graphs.on = True
    return o


def _table(tables, key="g"):
    st = tables.take((key,), 2, 3, torch.device("cpu"))
    st.host[:] = 7
    return st


@cpu_only
def test_replay_repeats_the_captured_launches(graphs):
    """Hidden host state is not re-read at replay: the captured scalar is launched
    again, as a CUDA graph would (so a missing key argument shows as wrong bits)."""
    owner, tables = _owner(graphs), RowTables()
    x = torch.randn(5)
    outs = []
    for add in (1.0, 1.0, 5.0, 9.0):
        HIDDEN["add"] = add
        outs.append(run_segment(owner, _hidden_segment, _table(tables), x).clone())
    g = device_graphs.graphs_of(owner)
    assert (g.eager, g.captures, g.replays) == (1, 1, 2)
    for o in outs:                                # every step: x + 1 (the capture's)
        assert torch.equal(o, x + 1.0)


@cpu_only
def test_capture_refuses_host_reads_host_data_and_random_draws(graphs):
    owner, tables = _owner(graphs), RowTables()
    x = torch.randn(4)
    for fn, what in ((_reads_host, "reads a device value"), (_draws, "generator"),
                     (_host_data, "from host data")):
        run_segment(owner, fn, _table(tables, fn.__name__), x)       # eager: allowed
        with pytest.raises(RuntimeError, match=what):
            run_segment(owner, fn, _table(tables, fn.__name__), x)   # the capture


@cpu_only
def test_key_refuses_closures_and_hidden_objects():
    st = RowTables().take(("k",), 1, 1, torch.device("cpu"))
    k = 3

    def closure(table, x):
        return x * k
    with pytest.raises(TypeError, match="closure"):
        segment_key(closure, st, (torch.zeros(1),))
    with pytest.raises(TypeError, match="not keyable"):
        segment_key(_plain, st, (torch.zeros(1), object()))
    with pytest.raises(TypeError, match="not keyable"):
        segment_key(_plain, st, (torch.zeros(1), {"a": 1}))


@cpu_only
def test_changed_arguments_run_eagerly_then_capture_anew(graphs):
    owner, tables = _owner(graphs), RowTables()
    x, y = torch.randn(6), torch.randn(6)
    seq = [(x, 2.0), (x, 2.0), (x, 3.0), (y, 2.0), (x, 2.0), (x, 3.0), (x, 3.0)]
    for t, k in seq:
        got = run_segment(owner, _plain, _table(tables), t, k)
        assert torch.equal(got, t * k), (k, t is x)
    g = device_graphs.graphs_of(owner)
    # (x, 2): eager, capture, replay; (x, 3): eager, capture, replay; (y, 2): eager
    assert (g.eager, g.captures, g.replays) == (3, 2, 2)
    # a table moved to another host buffer is another key
    st = _table(tables)
    before = segment_key(_plain, st, (x, 2.0))
    st._pinned = st._pinned.clone()
    st.host = st._pinned.numpy()
    assert segment_key(_plain, st, (x, 2.0)) != before


@cpu_only
def test_segment_graphs_keep_at_most_limit(graphs):
    owner, tables = _owner(graphs), RowTables()
    g = device_graphs.enable(owner, graphs.emu)
    g.limit = 2
    x = torch.randn(3)
    for k in (1.0, 2.0, 3.0):
        for _ in range(2):
            run_segment(owner, _plain, _table(tables), x, k)
    assert isinstance(g, SegmentGraphs) and len(g._graphs) == 2 and g.captures == 3


@pytest.mark.parametrize("graphs_on", [False, True])
def test_loss_scale_lives_at_one_address_with_graphs(graphs_on):
    """With ``cuda_graphs`` the inverse loss scale a step hands the bucket rows is one
    tensor per device, rewritten in place (a replay reads its address); without, a new
    tensor per step."""
    from hvdsparse.compressors import TopK
    from hvdsparse.engine import StepEngine
    from hvdsparse.settings import ExchangeSettings
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(1))
    eng = StepEngine(TopK(0.01), ExchangeSettings.from_args(cuda_graphs=graphs_on), None,
                     rank=0, world_size=1, prefix="t", grad_scaler=scaler)
    seen = []
    for step, scale in enumerate((1024.0, 512.0, 2048.0)):
        scaler.update(new_scale=scale)
        eng.begin_step(step)
        inv = eng.grad_scale(torch.device("cpu"))
        assert float(inv) == 1.0 / scale
        seen.append(inv)
    assert (len({t.data_ptr() for t in seen}) == 1) == graphs_on


def test_cuda_graphs_option_is_checked(monkeypatch):
    from hvdsparse.settings import ExchangeSettings
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        ExchangeSettings.from_args(cuda_graphs="yes")
    monkeypatch.setenv("HVDSPARSE_CUDA_GRAPHS", "on")
    with pytest.raises(ValueError, match="HVDSPARSE_CUDA_GRAPHS must be 0 or 1"):
        ExchangeSettings.from_args()
    monkeypatch.setenv("HVDSPARSE_CUDA_GRAPHS", "1")
    assert ExchangeSettings.from_args().cuda_graphs is True
    assert ExchangeSettings.from_args(cuda_graphs=False).cuda_graphs is False
