"""The ``balanced`` exchange's single-process parts (hvdsparse/exchange/balanced.py):
the boundary choice from the P x H histogram, the re-balancing rule, the phase-2
capacity and the cost model's price. Random inputs from the per-test seed; expected
values from plain Python written from the definitions in the module docstring, and a
check on the actual points that the new regions hold equal shares. The multi-rank path
runs in tests/test_trust_hvd.py (P = 3, every compressor, against a plain-torch replay).
"""
import math

import pytest
import torch
from tests.thread_transport import on_threads

from hvdsparse.exchange import balanced as B
from hvdsparse.exchange.base import HostReadout
from hvdsparse.exchange.cost_model import (EXACT_STRATEGIES, LOSSY_MARGIN, BucketFigures,
                                           choose, costs, phase2_capacity)


def _random_bounds(gen, N, P):
    cuts = sorted(int(x) for x in torch.randint(0, N + 1, (P - 1,), generator=gen))
    return [0] + cuts + [N]


def _edges(bounds, H):
    """Owner r's region [b_r, b_{r+1}) cut into H equal integer sub-bins."""
    out = []
    for r in range(len(bounds) - 1):
        a, b = bounds[r], bounds[r + 1]
        out += [a + (j * (b - a)) // H for j in range(H)]
    return out + [bounds[-1]]


def _reference_cuts(counts, edges, P):
    """Where the cumulative count first reaches ceil(j M / P), linear inside that bin."""
    M = sum(counts)
    cuts = []
    for j in range(1, P):
        t = -(-j * M // P)
        run = 0
        for i, c in enumerate(counts):
            if run + c >= t:
                cuts.append(edges[i] + ((t - run) * (edges[i + 1] - edges[i])) // max(c, 1))
                break
            run += c
    for j in range(1, len(cuts)):           # boundaries never go backwards
        cuts[j] = max(cuts[j], cuts[j - 1])
    return [edges[0]] + cuts + [edges[-1]]


@pytest.mark.parametrize("P", [2, 3, 8, 16])
def test_candidate_bounds_match_reference(seed, P):
    gen = torch.Generator().manual_seed(seed + P)
    H = B.HIST_BINS
    for _ in range(20):
        N = int(torch.randint(P, 50_000, (1,), generator=gen))
        bounds = _random_bounds(gen, N, P)
        assert B.sub_bin_edges(bounds, H) == _edges(bounds, H)
        # sparse, clustered counts (many empty sub-bins, some heavy ones)
        counts = torch.randint(0, 50, (P * H,), generator=gen)
        counts[torch.rand(P * H, generator=gen) < 0.6] = 0
        # an empty sub-bin (zero width) cannot hold pairs
        E = _edges(bounds, H)
        counts = [int(c) if E[i + 1] > E[i] else 0 for i, c in enumerate(counts)]
        got = B.candidate_bounds(torch.tensor(counts).view(P, H),
                                 torch.tensor(E, dtype=torch.int64), P).tolist()
        if sum(counts) == 0:
            assert got == bounds
        else:
            assert got == _reference_cuts(counts, E, P), (bounds, counts)
        assert got[0] == 0 and got[-1] == N and all(a <= b for a, b in zip(got, got[1:]))


@pytest.mark.parametrize("P", [3, 8, 16])
def test_new_regions_hold_equal_shares_of_the_selected_points(seed, P):
    """Points (selected coordinates) concentrated in a few hot spots; start from
    equal-width regions, re-balance twice from the histogram of where the points fell.
    Every new region then holds M/P points up to the content of one sub-bin (the
    histogram's resolution): far closer to equal than equal-width regions."""
    gen = torch.Generator().manual_seed(seed)
    N, H, M = 200_000, B.HIST_BINS, 20_000
    centres = torch.randint(0, N, (4,), generator=gen)
    pts = (centres[torch.randint(0, 4, (M,), generator=gen)]
           + (torch.randn(M, generator=gen) * 2000).long()).clamp(0, N - 1)
    pts = torch.unique(pts)                      # a selection: distinct coordinates
    bounds = B.equal_bounds(N, P)

    def per_region(bd):
        return [int(((pts >= a) & (pts < b)).sum()) for a, b in zip(bd, bd[1:])]

    before = per_region(bounds)
    for _ in range(2):
        E = B.sub_bin_edges(bounds, H)
        hist = [int(((pts >= E[i]) & (pts < E[i + 1])).sum()) for i in range(P * H)]
        bounds = B.candidate_bounds(torch.tensor(hist).view(P, H),
                                    torch.tensor(E, dtype=torch.int64), P).tolist()
    got = per_region(bounds)
    mean = pts.numel() / P
    E = B.sub_bin_edges(bounds, H)
    finest = max(int(((pts >= E[i]) & (pts < E[i + 1])).sum()) for i in range(P * H))
    assert sum(got) == pts.numel()
    assert max(got) <= mean + 2 * finest + 1, (got, finest)
    assert max(got) / mean < max(before) / mean or max(before) / mean < 1.1, (before, got)


def _readout(M, maxm, cand, version_values=None):
    v = torch.tensor([M, 0, 0, maxm, 0, 0] + list(cand), dtype=torch.float64)
    return HostReadout(v)


def test_rebalance_rule():
    """Exchange n reads exchange n-2's figures; adopts the candidate when they were
    computed under the current boundaries and (imbalance > bound or REBALANCE_EVERY
    exchanges have passed); never from figures of older boundaries."""
    P, N = 4, 1000
    bal = B.Balance(N, P, torch.device("cpu"))
    cand = [0, 100, 200, 300, 1000]
    assert bal.bounds == [0, 250, 500, 750, 1000]
    bal.before_launch()                                   # exchange 0: no history
    bal.record(_readout(400, 400, cand))                  # all pairs at one owner
    bal.before_launch()                                   # exchange 1: one entry only
    assert bal.version == 0
    bal.record(_readout(400, 400, [0, 1, 2, 3, 1000]))    # exchange 1, boundaries v0
    bal.before_launch()                                   # exchange 2: reads exchange 0
    assert bal.bounds == cand and bal.version == 1
    assert bal.lo_t.view(-1).tolist() == cand[:-1]
    assert bal.n_t.view(-1).tolist() == [100, 100, 100, 700]
    bal.record(_readout(400, 100, cand))                  # exchange 2, under v1
    bal.before_launch()                                   # exchange 3 reads exchange 1:
    assert bal.bounds == cand                             # imbalanced but stale (v0)
    # balanced (imbalance 1.0): no change until REBALANCE_EVERY exchanges have passed
    other = [0, 110, 220, 330, 1000]
    n = 0
    while bal.bounds == cand:
        bal.record(_readout(400, 100, other))
        bal.before_launch()
        n += 1
        assert n < 100
    assert bal.bounds == other and bal.since == 1
    assert bal.changes == 2
    assert n >= B.REBALANCE_EVERY - 2


def test_phase2_capacity_and_message_length():
    assert phase2_capacity(16, 10_000, 100) == 7          # ceil(100 / 16)
    assert phase2_capacity(4, 10_000, 100, widest_region=20) == 20
    assert phase2_capacity(4, 10_000, 10_000, widest_region=3000) == 3000   # dense: all
    assert phase2_capacity(1, 10, 3) == 3
    for c in (0, 1, 7, 100):
        for vb in (2, 4):
            assert B.message_nbytes(c, vb) == 32 + 4 * B.HIST_BINS + 4 * c + \
                4 * math.ceil(c * vb / 4)


@pytest.mark.parametrize("P", [2, 3, 4, 8, 16, 64])
def test_cost_model_prices_balanced_and_auto_margin(P):
    """balanced = (P-1)/P k (4+v) + (P-1) L(c = ceil(k/P)); auto takes it only below
    LOSSY_MARGIN x the cheapest exact strategy."""
    N = 1_000_000
    k = 10_000
    f = BucketFigures(world_size=P, numel=N, capacity=k, wire_nbytes=8 * k + 96)
    c = costs(f)
    L = 32 + 4 * B.HIST_BINS + 8 * math.ceil(k / P)
    assert c["balanced"] == pytest.approx((P - 1) / P * 8 * k + (P - 1) * L)
    best_exact = min(c[s] for s in EXACT_STRATEGIES)
    want = "balanced" if c["balanced"] < LOSSY_MARGIN * best_exact else \
        min(EXACT_STRATEGIES, key=lambda s: (c[s], EXACT_STRATEGIES.index(s)))
    assert choose(f) == want
    assert choose(f, allowed=EXACT_STRATEGIES) != "balanced"
    if P <= 4:
        assert want == "allgather"             # balanced would truncate for <= 2x saving
    if P >= 8:
        assert want == "balanced"
    # nearly flat in P: at most 2 (P-1)/P k (4+v) plus headers
    assert c["balanced"] <= 2 * 8 * k + (P - 1) * (32 + 4 * B.HIST_BINS + 8)


def test_bytes_target_predicted():
    """The scaling target in the model: TopK 1 % at P = 16 within 2.5x of P = 2 (auto)."""
    N, k = 4_000_000, 40_000

    def auto_bytes(P):
        f = BucketFigures(world_size=P, numel=N, capacity=k, wire_nbytes=8 * k + 96)
        return costs(f)[choose(f)]
    assert auto_bytes(16) <= 2.5 * auto_bytes(2), (auto_bytes(2), auto_bytes(16))


# ---------------------------------------------------------------- truncation feedback
def _run_balanced(P, payloads_of, spec):
    """Launch + finish the real exchange on P threads; returns [(sum, undelivered)]."""
    def body(r, ctx):
        pend = B.launch(spec, payloads_of[r], ctx)
        total = pend.finish().clone()
        back = None if pend.undelivered is None else pend.undelivered.clone()
        return total, back, dict(pend.figures)
    return on_threads(P, body)


@pytest.mark.parametrize("P,values", [(2, "fp32"), (3, "fp32"), (5, "fp16"), (8, "int8")])
def test_undelivered_shares_sum_to_the_dropped_part(seed, P, values):
    """Every rank's ``undelivered`` is its own sent values (as on the wire) exactly where
    nothing was delivered; summed over the ranks (rank order) it is ``T - delivered``,
    T = the sum of what the ranks sent: the dropped part, which phase 2 reports as
    ``p2_dropped_energy``."""
    import hvdsparse
    from hvdsparse import codec
    from hvdsparse.exchange.base import BucketSpec
    gen = torch.Generator().manual_seed(seed + P)
    numels = [int(x) for x in torch.randint(1500, 6000, (3,), generator=gen)]
    names = [f"l{j}" for j in range(3)]
    spec = BucketSpec.build(0, names, numels)
    payloads, own = [], []
    for r in range(P):
        comp = hvdsparse.TopK(0.05, values=values, compress_1d=True)
        pls = [comp.compress(n, torch.randn(k, generator=gen) * (1 + j), 0)
               for j, (n, k) in enumerate(zip(names, numels))]
        payloads.append(pls)
        own.append(torch.cat([codec.payload_to_dense(p).reshape(-1) for p in pls]))
    out = _run_balanced(P, payloads, spec)
    T = torch.zeros(spec.numel)
    for o in own:
        T = T + o                                   # rank order, as the owners sum
    total0 = out[0][0]
    for total, back, _ in out:
        assert torch.equal(total, total0)           # every rank decodes the same sum
    delivered = total0 != 0
    f = out[0][2]
    assert f["p2_capacity"] * P < int((T != 0).sum()), "nothing was truncated"
    assert f["p2_dropped_energy"] > 0
    dropped = torch.where(delivered, torch.zeros(()), T)
    backsum = torch.zeros(spec.numel)
    for r, (_, back, _) in enumerate(out):
        assert back is not None
        want = torch.where(delivered, torch.zeros(()), own[r])
        assert torch.equal(back, want), f"rank {r}: undelivered != own sent where dropped"
        backsum = backsum + back
    if values != "fp16":                            # fp16 also rounds the delivered sum
        assert torch.equal(total0[delivered], T[delivered])
    assert torch.equal(backsum, dropped)            # same additions, same order
    share = float(dropped.double().square().sum() / T.double().square().sum())
    assert abs(share - f["p2_dropped_energy"]) < 1e-4 + 1e-3 * share


def test_owner_counts_cpu_path_equals_running_count():
    """split.owner_counts on the CPU path (numpy count per region stretch) against the
    device formula written out in torch: running non-zero count at each region's last
    index, 0 for empty regions, differenced. Regions from random bounds, empty ones
    included."""
    from hvdsparse.exchange import split
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))
    for _ in range(20):
        N = int(torch.randint(1, 5000, (1,), generator=g))
        P = int(torch.randint(1, 9, (1,), generator=g))
        flat = torch.randn(N, generator=g) * (torch.rand(N, generator=g) < 0.3)
        cuts = sorted(torch.randint(0, N + 1, (P - 1,), generator=g).tolist())
        bounds = [0] + cuts + [N]
        ends = torch.tensor([max(b - 1, 0) for b in bounds[1:]], dtype=torch.int64)
        nonempty = torch.tensor([int(b > 0) for b in bounds[1:]], dtype=torch.int64)
        cs = torch.cumsum(flat != 0, 0)
        upto = cs[ends] * nonempty
        want = torch.diff(upto, prepend=torch.zeros(1, dtype=torch.int64))
        got = split._owner_counts_cpu(flat, ends, nonempty)
        assert torch.equal(got, want), (bounds, got, want)
        assert int(got.sum()) == int((flat != 0).sum())


@pytest.mark.parametrize("vdtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_parse_pair_rows_any_count(vdtype, m):
    """Phase 1's received rows back to (index, value), one row included: with fp16 /
    bf16 pairs a single row's stride (6 bytes) once made the int32 view fail (found by
    the randomised allgather worker). Rows are built byte by byte with struct."""
    import struct
    from hvdsparse.exchange import split
    g = torch.Generator().manual_seed(m * 31 + {torch.float32: 0, torch.float16: 1,
                                                torch.bfloat16: 2}[vdtype])
    idx = torch.randint(0, 2 ** 31 - 1, (m,), generator=g)
    vals = torch.randn(m, generator=g).to(vdtype)
    vb = torch.finfo(vdtype).bits // 8
    raw = b"".join(struct.pack("<i", int(i)) + bytes(v.view(torch.uint8).tolist())
                   for i, v in zip(idx, vals.reshape(m, 1)))
    rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(m, 4 + vb)
    got_i, got_v = split.parse_pair_rows(rows, vdtype)
    assert torch.equal(got_i, idx.to(torch.int64))
    assert torch.equal(got_v, vals.float())


@pytest.mark.parametrize("strategy", ["split", "balanced"])
def test_wait_is_not_counted_as_decode(strategy):
    """The two-phase strategies book a collective's wait in ``wait_s`` only: with one
    rank arriving 0.6 s late, the other's ``wait_s`` holds that wait and ``wait_s +
    decode_s`` never exceeds the wall time of its ``finish()`` (before, ``finish``
    added the earlier phases' whole time, their alltoall wait included, to
    ``decode_s`` as well)."""
    import time

    import hvdsparse
    from hvdsparse.exchange import split as S
    from hvdsparse.exchange.base import BucketSpec
    mod = S if strategy == "split" else B
    P = 2
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))
    numels = [int(x) for x in torch.randint(2000, 5000, (2,), generator=gen)]
    names = ["a", "b"]
    spec = BucketSpec.build(0, names, numels)
    payloads = []
    for r in range(P):
        comp = hvdsparse.TopK(0.05, compress_1d=True)
        payloads.append([comp.compress(n, torch.randn(k, generator=gen), 0)
                         for n, k in zip(names, numels)])

    def body(r, ctx):
        if r == 1:
            time.sleep(0.6)
        pend = mod.launch(spec, payloads[r], ctx)
        t0 = time.perf_counter()
        pend.finish()
        return time.perf_counter() - t0, pend.wait_s, pend.decode_s
    out = on_threads(P, body)
    for r, (wall, wait, dec) in enumerate(out):
        assert wait >= 0 and dec >= 0, (r, wait, dec)
        assert wait + dec <= wall + 1e-3, (r, wall, wait, dec)
    wall0, wait0, dec0 = out[0]
    assert wait0 >= 0.3, out[0]          # rank 0 waited for the late rank


def test_take_back_many_adds_every_share_as_take_back_does():
    """``Compressor.take_back_many`` (the step engine's feedback of ``undelivered``, one
    multi-tensor add) and ``take_back`` (one layer), against plain torch on fresh random
    shares: a layer with a residual ends with ``residual + share`` (one fp32 addition,
    bit for bit), a layer without one (policy-dense) with exactly its share, a layer
    with ``error_feedback=False`` keeps none and reports False."""
    import hvdsparse
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, ())))
    names = ["w0", "b0", "w1", "b1", "nofb"]
    numels = [int(x) for x in torch.randint(1, 300, (len(names),), generator=gen)]

    def make():
        c = hvdsparse.TopK(0.1, min_numel=1, compress_1d=True,
                           overrides={"nofb": dict(error_feedback=False)})
        for n, k in zip(names, numels):
            if n.startswith("w"):
                c.compress(n, torch.randn(k, generator=torch.Generator().manual_seed(k)), 0)
        return c
    shares = [torch.randn(k, generator=gen) for k in numels]
    one, many = make(), make()
    before = {n: None if one.residual(n) is None else one.residual(n).clone() for n in names}
    assert before["w0"] is not None and before["b0"] is None     # both kinds present
    took_one = [one.take_back(n, v) for n, v in zip(names, shares)]
    took_many = many.take_back_many(names, shares)
    assert took_one == took_many == [True, True, True, True, False]
    for n, v in zip(names, shares):
        want = None if n == "nofb" else v if before[n] is None else before[n] + v
        for c in (one, many):
            got = c.residual(n)
            assert (got is None) == (want is None), n
            if want is not None:
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), n
