"""The ``split`` exchange's phase-2 decode (``exchange.split.decode_ranges``): on the
Triton path every sparse and dense range message in one launch
(``kernels/split_ranges.py``, through the interpreter), on the CPU path one range at a
time; both against a plain decode of the same bytes written here from the wire format
(``exchange/split.py``'s docstring), on fresh random messages: P in 1..5, fp32 / fp16
(with value shifts, one beyond the clamp) / bf16 pairs, sparse, dense, quantised and
empty ranges, out-of-range indices on the trusted path (flagged, nothing written), the
sum buffer poisoned before the decode. And the whole exchange on 3 ranks (in-process
transport): the Triton path's sums are the CPU path's bits on every rank."""
import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from hvdsparse import ops  # noqa: E402
from hvdsparse.exchange import split as S  # noqa: E402
from hvdsparse.exchange.base import BucketSpec, BufferPool, ExchangeContext  # noqa: E402

DEV = torch.device(os.environ.get("HVDSPARSE_TEST_DEVICE", "cpu"))
VDTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _messages(gen, P, N, vdtype, bits, qb, damage):
    """P range messages (uint8, back to back), their lengths, and what a plain decode
    gives: the expected flat sum and whether an index is out of its range."""
    vb = torch.finfo(vdtype).bits // 8
    bounds = S.range_bounds(N, P)
    want = torch.zeros(N, dtype=torch.float64)
    parts, lens, bad_any, quant = [], [], False, []
    for r in range(P):
        lo, hi = bounds[r], bounds[r + 1]
        n = hi - lo
        # 0, 1: sparse; 2: the dense form (fp32, or quantised with ``bits``)
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        if n == 0:
            hdr, body = [S.MODE_DENSE, 0, 0, 0], b""
        elif kind <= 1:
            kmax = max(0, min(n, (S.dense_msg_nbytes(n, bits, qb) - S.HEADER_BYTES)
                              // (4 + vb) - 1))
            k = int(torch.randint(0, kmax + 1, (1,), generator=gen))
            while k and S.sparse_msg_nbytes(k, vb) >= S.dense_msg_nbytes(n, bits, qb):
                k -= 1
            idx = torch.randperm(n, generator=gen)[:k].sort().values.to(torch.int32)
            if damage and k:
                j = int(torch.randint(0, k, (1,), generator=gen))
                idx[j] = [-1, n, n + 7, -(2 ** 31)][int(torch.randint(0, 4, (1,),
                                                                          generator=gen))]
            e = 0
            vals = torch.randn(k, generator=gen) * 100
            if vdtype == torch.float16:
                e = int(torch.randint(0, 20, (1,), generator=gen))
                if int(torch.randint(0, 6, (1,), generator=gen)) == 0:
                    e = S.MAX_WIRE_EXPONENT + 9          # clamped on the trusted path
            wire = vals.to(vdtype)
            hdr = [S.MODE_SPARSE, k, 0, e]
            body = idx.numpy().tobytes() + wire.view(torch.uint8).numpy().tobytes()
            body += bytes(S.sparse_msg_nbytes(k, vb) - S.HEADER_BYTES - len(body))
            shift = 2.0 ** min(max(e, 0), S.MAX_WIRE_EXPONENT)
            for i, v in zip(idx.tolist(), wire.float().tolist()):
                if 0 <= i < n:
                    want[lo + i] = v * shift
                else:
                    bad_any = True
        elif not bits:
            vals = torch.randn(n, generator=gen)
            hdr, body = [S.MODE_DENSE, n, 0, 0], vals.numpy().tobytes()
            want[lo:hi] = vals.double()
        else:
            vals = torch.randn(n, generator=gen)
            codes, scales = ops.quantize_pack(vals, bits, qb, 11 + r)
            nc = codes.numel()
            body = codes.numpy().tobytes() + bytes(S.pad4(nc) - nc) + \
                scales.numpy().tobytes()
            hdr = [S.MODE_QUANT, n, 0, 0]
            quant.append((lo, hi, ops.dequantize_unpack(codes, scales, bits, qb, n)))
        msg = np.asarray(hdr, dtype=np.int32).tobytes() + body
        parts.append(msg)
        lens.append(len(msg))
    for lo, hi, deq in quant:
        want[lo:hi] = deq.double()
    g = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).clone()
    return g, lens, bounds, want.float(), bad_any


def _decode(g, lens, bounds, N, P, vdtype, bits, qb, validate):
    pool = BufferPool()
    ctx = ExchangeContext(rank=0, world_size=P, prefix="t", validate=validate,
                          split_dense_bits=bits, quant_bucket=qb, buffers=pool,
                          error_flag=None if validate else
                          torch.zeros(1, dtype=torch.int32, device=DEV))
    spec = BucketSpec.build(3, ["w"], [N])
    pool.get("split.sum", 3, N + 1, torch.float32, DEV).fill_(float("nan"))   # poison
    flat, modes, hdrs = S.decode_ranges(g.to(DEV), lens, bounds, spec, ctx, vdtype, DEV)
    return flat.cpu(), modes, (None if validate else int(ctx.error_flag[0]))


@pytest.mark.parametrize("vdtype", VDTYPES, ids=["fp32", "fp16", "bf16"])
def test_one_launch_and_per_range_decode_give_the_plain_decode(vdtype, monkeypatch):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    launches = []
    orig = ops.split_decode_ranges

    def counted(*a, **k):
        launches.append(1)
        return orig(*a, **k)
    monkeypatch.setattr(ops, "split_decode_ranges", counted)
    for trial in range(6):
        monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
        P = int(torch.randint(1, 6, (1,), generator=gen))
        N = int(torch.randint(0, 3000, (1,), generator=gen)) + (P if trial % 2 else 0)
        bits = [0, 4, 8][trial % 3]
        qb = 64
        damage = trial >= 3 and DEV.type == "cpu" or trial == 5
        g, lens, bounds, want, bad = _messages(gen, P, N, vdtype, bits, qb, damage)
        where = f"seed {seed}, trial {trial}, P {P}, N {N}, bits {bits}"
        if DEV.type == "cpu":
            per_range, _, flag_cpu = _decode(g, lens, bounds, N, P, vdtype, bits, qb, False)
            assert torch.equal(per_range.view(torch.int32), want.view(torch.int32)), where
            assert flag_cpu == (1 if bad else 0), where
            monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
        before = len(launches)
        one, modes, flag = _decode(g, lens, bounds, N, P, vdtype, bits, qb, False)
        assert torch.equal(one.view(torch.int32), want.view(torch.int32)), where
        assert flag == (1 if bad else 0), where
        # the sparse and dense ranges: one launch for the bucket
        assert len(launches) - before == (1 if modes[0] + modes[1] else 0), where
        if not bad and S.MAX_WIRE_EXPONENT + 9 not in _shifts(g, lens):
            # the validated decode accepts the messages and agrees
            monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
            hv, _, _ = _decode(g, lens, bounds, N, P, vdtype, bits, qb, True)
            assert torch.equal(hv.view(torch.int32), want.view(torch.int32)), where


def _shifts(g, lens):
    off, es = 0, []
    for ln in lens:
        es.append(int(g[off + 12:off + 16].view(torch.int32)[0]))
        off += ln
    return es


def test_validated_decode_names_the_rank_of_a_bad_index():
    """The host-validated path raises on an index outside its range, naming the rank."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, ()).item()))
    while True:
        g, lens, bounds, want, bad = _messages(gen, 3, 900, torch.float32, 0, 64, True)
        if bad:
            break
    with pytest.raises(RuntimeError, match=r"rank \d sent an index outside its range"):
        _decode(g, lens, bounds, 900, 3, torch.float32, 0, 64, True)


@pytest.mark.skipif(DEV.type != "cpu", reason="forces Triton on CPU tensors (interpreter)")
@pytest.mark.parametrize("values", ["fp32", "fp16", "bf16"])
def test_split_exchange_on_three_ranks_gives_every_rank_the_sum(values, monkeypatch):
    """The whole ``split`` exchange (own_dense, per-owner counts, alltoall of pairs,
    owner's reduce, range messages, their decode) on 3 ranks over the in-process
    transport, trusted path: on the Triton path (one range-decode launch) every rank's
    sum is bit for bit the CPU path's, every rank holds the same bits, and it is the sum
    of the ranks' own selections (fp32 pairs; fp16 / bf16 pairs round the sum once)."""
    import test_nonfinite_carriage as TN
    from hvdsparse import codec
    gen = torch.Generator().manual_seed(TN._seed())
    spec, payloads, _ = TN._bucket(3, int(torch.randint(2, 5, (1,), generator=gen)), gen,
                                   values=values)
    want = sum(torch.cat([codec.payload_to_dense(p).reshape(-1).float() for p in pays])
               for pays in payloads)
    # Triton's interpreter is not thread-safe: one launch at a time across the ranks
    import threading
    import triton.runtime.interpreter as ti
    lock, run = threading.Lock(), ti.InterpretedFunction.run

    def serialised(*a, **k):
        with lock:
            return run(*a, **k)
    monkeypatch.setattr(ti.InterpretedFunction, "run", serialised)
    launches = []
    decode = ops.split_decode_ranges
    monkeypatch.setattr(ops, "split_decode_ranges",
                        lambda *a, **k: launches.append(1) or decode(*a, **k))
    sums = {}
    for path in ("cpu", "triton"):
        if path == "triton":
            monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
        got = TN._run(3, "split", spec, payloads, None, validate=False)
        sums[path] = [t for t, *_ in got]
        assert all(int(f[0]) == 0 for *_, f in got), path
        assert len(launches) == (3 if path == "triton" else 0), (path, len(launches))
    for r in range(3):
        assert torch.equal(sums["triton"][r].view(torch.int32),
                           sums["cpu"][r].view(torch.int32)), r
        assert torch.equal(sums["triton"][r].view(torch.int32),
                           sums["triton"][0].view(torch.int32)), r
    if values == "fp32":
        assert torch.allclose(sums["triton"][0], want, rtol=1e-6, atol=1e-6)
    else:
        dt = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[values])
        assert torch.allclose(sums["triton"][0], want.to(dt).float(), rtol=2e-2, atol=1e-3)
