"""The non-finite counts ride in the buckets' own messages (``allgather``: a tail of
each message; ``dense``: a [P, L] block of the allreduce) and the other strategies'
buckets share one small allgather (:meth:`NonFinitePolicy.gather_rest`). Checked on P
threads over the in-process transport with the real strategies, fresh random payloads
and counts each run:

* the table every rank gets is every rank's row, in rank order, and the gradient sum is
  bitwise the sum of the same launch without counts (and, in fp32, the rank-order sum
  of the payloads decoded one by one; ranks on threads encode the same layout at once,
  which also checks that the codec's reused buffers are per thread);
* a 16-bit dense wire saturates a count at ``count_saturation`` (never 0, never wrong
  below it), with Horovod's predivide round trip;
* a malformed count (negative; fractional on the dense wire) is rejected on the
  validated path naming the rank, and flags its layer on the unvalidated one;
* a step mixing carrying and non-carrying buckets assembles the same table as rows
  stacked in bucket order.
"""
from __future__ import annotations

import pytest
import torch

import hvdsparse
from hvdsparse import codec, exchange
from hvdsparse.exchange import allgather as AG
from hvdsparse.exchange import dense as D
from hvdsparse.exchange.base import BucketSpec
from hvdsparse.nonfinite import NonFinitePolicy, flagged_layers
from tests.thread_transport import on_threads


def _seed():
    return int(torch.randint(0, 2 ** 31 - 1, (1,)))


def _bucket(P, L, gen, values="fp32", bucket_id=0):
    """A bucket of L layers, every rank's TopK payloads of fresh gradients, and every
    rank's int32 [1, L] count row (zeros, small and large counts)."""
    numels = [int(x) for x in torch.randint(300, 3000, (L,), generator=gen)]
    names = [f"b{bucket_id}.l{j}" for j in range(L)]
    spec = BucketSpec.build(bucket_id, names, numels)
    payloads, rows = [], []
    for r in range(P):
        comp = hvdsparse.TopK(0.05, values=values, compress_1d=True, min_numel=1)
        payloads.append([comp.compress(n, torch.randn(k, generator=gen), 0)
                         for n, k in zip(names, numels)])
        row = torch.randint(0, 4, (1, L), generator=gen, dtype=torch.int32)
        row *= torch.randint(0, 2 ** 20, (1, L), generator=gen, dtype=torch.int32)
        rows.append(row)
    return spec, payloads, rows


def _run(P, strategy, spec, payloads, rows, validate=True, tamper=None, **kw):
    """Launch + finish on P threads; per rank (sum, table or None, pending's bytes)."""
    def body(r, ctx):
        pend = exchange.launch(strategy, spec, payloads[r], ctx,
                               nonfinite_row=None if rows is None else rows[r])
        total = pend.finish().clone()
        table = None if pend.nonfinite is None else pend.nonfinite.clone()
        return total, table, pend.carries_nonfinite, pend.sent_bytes, ctx.error_flag
    return on_threads(P, body, validate=validate, tamper=tamper, **kw)


@pytest.mark.parametrize("strategy,dense_dtype", [("allgather", torch.float32),
                                                  ("dense", torch.float32),
                                                  ("dense", torch.float16)])
@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("validate", [True, False])
def test_counts_ride_and_the_sum_is_unchanged(strategy, dense_dtype, P, validate):
    gen = torch.Generator().manual_seed(_seed())
    L = int(torch.randint(1, 6, (1,), generator=gen))        # odd L: padded tail
    spec, payloads, rows = _bucket(P, L, gen)
    kw = dict(dense_dtype=dense_dtype, gradient_predivide_factor=float(P))
    sent = []

    def record(kind, r, t):
        sent.append((kind, r, t.clone()))
    plain = _run(P, strategy, spec, payloads, None, validate, **kw)
    carried = _run(P, strategy, spec, payloads, rows, validate, tamper=record, **kw)
    ref = torch.zeros(spec.numel)                  # independent: rank-order sum
    for r in range(P):
        ref = ref + torch.cat([codec.payload_to_dense(p).reshape(-1) for p in payloads[r]])
    want = torch.cat(rows)
    if strategy == "allgather" or dense_dtype == torch.float32:
        assert torch.equal(plain[0][0], ref)
    if dense_dtype != torch.float32:
        sat = D.count_saturation(dense_dtype)
        assert sat == 256
        want = want.clamp(max=sat)
        assert bool((want[torch.cat(rows) > 0] > 0).all())  # saturated, never dropped
    for r in range(P):
        total, table, carries, nbytes, flag = carried[r]
        assert carries
        assert torch.equal(total, plain[r][0]), f"rank {r}: the counts changed the sum"
        assert table.dtype == torch.int32 and torch.equal(table, want), (r, table, want)
        if flag is not None:
            assert int(flag[0]) == 0
    if strategy == "allgather":
        extra = AG.counts_nbytes(L)
        assert extra % 8 == 0 and 4 * L <= extra < 4 * L + 8
        assert carried[0][3] - plain[0][3] == (P - 1) * extra
        for kind, r, msg in sent:                 # the tail: the row, then zero padding
            tail = msg[msg.numel() - extra:]
            assert torch.equal(tail[:4 * L].view(torch.int32), rows[r].view(-1))
            assert not bool(tail[4 * L:].any())
    else:
        for kind, r, vec in sent:
            block = vec[spec.numel:].view(P, L).float()
            assert not bool(block[torch.arange(P) != r].any())


@pytest.mark.parametrize("strategy,dense_dtype", [("allgather", torch.float32),
                                                  ("dense", torch.float32),
                                                  ("dense", torch.float16)])
@pytest.mark.parametrize("validate", [True, False])
def test_malformed_count_is_rejected_or_flagged(strategy, dense_dtype, validate):
    P = 3
    gen = torch.Generator().manual_seed(_seed())
    L = 3
    spec, payloads, rows = _bucket(P, L, gen)
    for row in rows:
        row.zero_()                                # a clean step ...
    bad_layer = int(torch.randint(0, L, (1,), generator=gen))
    bad_value = -7 if strategy == "allgather" else \
        [0.5 if dense_dtype == torch.float32 else 0.2, -2.0, float("nan")][
            int(torch.randint(0, 3, (1,), generator=gen))]
    kw = dict(dense_dtype=dense_dtype)

    def corrupt(kind, r, t):                       # ... but rank 1's count is garbage
        if r != 1:
            return
        if strategy == "allgather":
            at = t.numel() - AG.counts_nbytes(L) + 4 * bad_layer
            t[at:at + 4].view(torch.int32).fill_(bad_value)
        else:
            t[spec.numel + 1 * L + bad_layer] = bad_value
    if validate:
        with pytest.raises(AssertionError) as info:
            _run(P, strategy, spec, payloads, rows, True, tamper=corrupt, **kw)
        errs = info.value.args[0]
        assert len(errs) == P                      # every rank rejects it
        for _, e in errs:
            assert "rank 1" in str(e) and spec.names[bad_layer] in str(e), str(e)
    else:
        out = _run(P, strategy, spec, payloads, rows, False, tamper=corrupt, **kw)
        for total, table, *_ in out:
            flagged = flagged_layers(table)
            assert flagged.tolist() == [j == bad_layer for j in range(L)], table


def test_mixed_step_assembles_the_table_in_bucket_order():
    """Buckets over allgather, split, dense and balanced in one step: the carrying ones
    bring their own blocks, split's and balanced's rows travel in one allgather, and
    the assembled table is every rank's full row in bucket order, on every rank."""
    P = 3
    gen = torch.Generator().manual_seed(_seed())
    strategies = ["allgather", "split", "dense", "balanced"]
    buckets = [_bucket(P, int(torch.randint(1, 4, (1,), generator=gen)), gen, bucket_id=b)
               for b in range(len(strategies))]

    def body(r, ctx):
        pol = NonFinitePolicy("propagate", ctx.comm(), "t", reads=None)
        pends = [exchange.launch(s, spec, pl[r], ctx, nonfinite_row=rows[r])
                 for s, (spec, pl, rows) in zip(strategies, buckets)]
        handle = pol.gather_rest(pends)
        assert handle is not None
        for p in pends:
            p.finish()
        return [p.carries_nonfinite for p in pends], pol.assemble(pends, handle).clone()
    out = on_threads(P, body)
    want = torch.cat([torch.cat(rows) for _, _, rows in buckets], dim=1)
    for carries, table in out:
        assert carries == [s in exchange.CARRY_NONFINITE for s in strategies]
        assert torch.equal(table, want)

    def only_split(r, ctx):                        # nothing carried: the rest is the table
        pol = NonFinitePolicy("propagate", ctx.comm(), "t", reads=None)
        spec, pl, rows = buckets[1]
        pend = exchange.launch("split", spec, pl[r], ctx, nonfinite_row=rows[r])
        handle = pol.gather_rest([pend])
        pend.finish()
        return pol.assemble([pend], handle).clone()
    for table in on_threads(P, only_split):
        assert torch.equal(table, torch.cat(buckets[1][2]))


def test_row_of_the_wrong_width_is_refused():
    gen = torch.Generator().manual_seed(_seed())
    spec, payloads, rows = _bucket(1, 3, gen)

    def body(r, ctx):
        exchange.launch("allgather", spec, payloads[r], ctx,
                        nonfinite_row=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(AssertionError, match="2 counts for 3 layers"):
        on_threads(1, body)


def test_bucket_rows_are_slices_once_the_order_is_followed():
    """:class:`NonFinite`: a bucket's row is its layers' counts in bucket order; after
    :meth:`NonFinite.follow` with the step's bucket order it is a view of the step's
    counters (no gather launch) with the same values."""
    from hvdsparse.nonfinite import NonFinite

    class P:                                    # a payload that counted into its slice
        def __init__(self, c):
            self.nonfinite = c
    names = ["a", "b", "c", "d", "e"]
    buckets = [["e", "d"], ["c", "b", "a"]]     # the reverse of the slot order
    nf = NonFinite(names)
    for step in range(2):
        counts = {n: int(torch.randint(0, 9, (1,))) for n in names}
        pays = {}
        for b in buckets:
            for n in b:
                c = nf.counter(n, "cpu")
                c.add_(counts[n])
                pays[n] = P(c)
        for b in buckets:
            row = nf.row(b, [pays[n] for n in b], "cpu")
            assert row.tolist() == [[counts[n] for n in b]]
            is_view = row.untyped_storage().data_ptr() == nf._buf.untyped_storage().data_ptr()
            assert is_view == (step == 1), (step, b)
        nf.reset()
        nf.follow([n for b in buckets for n in b])
    with pytest.raises(RuntimeError, match="during a step"):
        nf.counter("a", "cpu")
        nf.follow(names)
