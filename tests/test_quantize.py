"""Statistical and exact properties of the stochastic quantiser (hvdsparse.ops on CPU
tensors = the torch reference, which tests/test_kernels.py shows is bit-identical to the
Triton kernel).

Unbiasedness bound: with ``s = 2**(bits-1) - 1``, ``r = |v| * s / scale`` and
``f = r - floor(r)``, one dequantised value is ``sign(v) * scale/s * (floor(r) + X)``,
``X ~ Bernoulli(f)``: mean ``v`` and variance ``var = (scale/s)**2 * f * (1 - f)``.
Averaging over ``K`` independent seeds, the summed error over a bucket of ``m`` elements
has variance ``sum(var) / K`` and is close to Gaussian (``m*K`` >= 10^4 Bernoulli
terms), so we require ``|Z| <= 5`` for the standardised error of every bucket and of the
whole vector (false-alarm probability < 1e-5 per run). A deterministic
round-to-nearest quantiser fails the same test (checked), so it has power.
"""
import os
import random

import numpy as np
import pytest
import torch

from hvdsparse import ops
from hvdsparse import cpu as R


@pytest.fixture
def seed():
    s = int(os.environ.get("HVDSPARSE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"HVDSPARSE_TEST_SEED={s}")
    return s


def _z_scores(v, mean_deq, scales_e, s, K):
    f = (v.abs().double() * s / scales_e.double())
    f = f - torch.floor(f)
    var = (scales_e.double() / s) ** 2 * f * (1 - f)
    err = mean_deq.double() - v.double()
    return err, var / K


def _bucket_z(err, var_mean, B):
    n = err.numel()
    zs = []
    for b in range(0, n, B):
        sd = float(var_mean[b:b + B].sum()) ** 0.5
        e = float(err[b:b + B].sum())
        zs.append(abs(e) / sd if sd > 0 else (0.0 if abs(e) < 1e-9 else float("inf")))
    sd = float(var_mean.sum()) ** 0.5
    return zs, abs(float(err.sum())) / sd


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_unbiased(seed, bits):
    g = torch.Generator().manual_seed(seed)
    n, B, K = 1237, 200, 250  # B does not divide n
    v = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    s = (1 << (bits - 1)) - 1
    acc = torch.zeros(n, dtype=torch.float64)
    rnd = random.Random(seed)
    seeds = rnd.sample(range(2**40), K)
    scales = None
    for sd in seeds:
        codes, scales = ops.quantize_pack(v, bits, B, sd)
        acc += ops.dequantize_unpack(codes, scales, bits, B, n).double()
    mean = acc / K
    scales_e = scales.repeat_interleave(B)[:n]
    err, var_mean = _z_scores(v, mean, scales_e, s, K)
    zb, zall = _bucket_z(err, var_mean, B)
    assert max(zb) <= 5.0, f"bucket z-scores {zb}, seed={seed}"
    assert zall <= 5.0, f"global z {zall}, seed={seed}"
    # power check: deterministic rounding is biased and must fail the same test
    q = torch.round(v.abs() * s / scales_e) * torch.sign(v)
    det = q * scales_e / s
    err_d, _ = _z_scores(v, det, scales_e, s, K)
    zb_d, zall_d = _bucket_z(err_d, var_mean, B)
    assert max(zb_d) > 5.0 or zall_d > 5.0


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("B", [512, 100, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_error_bound_and_layout(seed, bits, B, dtype):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(500, 3000, (1,), generator=g))
    if n % B == 0:
        n += 1
    v = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(dtype)
    v[B:2 * B] = 0  # a zero bucket (when n > 2B)
    s = (1 << (bits - 1)) - 1
    half = 1 << (bits - 1)
    codes, scales = ops.quantize_pack(v, bits, B, seed)
    assert codes.dtype == torch.uint8 and codes.numel() == -(-n * bits // 8)
    assert scales.dtype == torch.float32 and scales.numel() == -(-n // B)
    vf = v.float()
    # scales = per-bucket max |v| (naive loop)
    want_sc = [float(vf[b:b + B].abs().max()) for b in range(0, n, B)]
    assert scales.tolist() == want_sc
    deq = ops.dequantize_unpack(codes, scales, bits, B, n)
    scales_e = scales.repeat_interleave(B)[:n]
    # per-element error below one quantisation step scale/s (+ fp32 rounding slack)
    step = scales_e / s
    assert bool(((deq - vf).abs() <= step * (1 + 1e-5) + 1e-30).all()), f"seed={seed}"
    # q recovered from the dequantised value; repacked independently with numpy
    q = torch.round(deq * s / torch.where(scales_e > 0, scales_e, torch.ones_like(scales_e)))
    assert bool((q.abs() <= s).all())
    assert bool(((q == 0) | (torch.sign(q) == torch.sign(vf))).all())
    assert bool((q[vf == 0] == 0).all())
    c = (q.to(torch.int64) + half).numpy()
    bitarr = ((c[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    np.testing.assert_array_equal(codes.numpy(), np.packbits(bitarr, bitorder="little"))
    # floor/ceil only: q is floor(r) or floor(r) + 1
    r = vf.abs() * s / torch.where(scales_e > 0, scales_e, torch.ones_like(scales_e))
    assert bool(((q.abs() - torch.floor(r)).abs() <= 1).all())


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_round_trip_bit_exact(seed, bits):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 5000, (1,), generator=g))
    c = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, generator=g)
    packed = R._pack_bits(c, bits)
    assert packed.numel() == -(-n * bits // 8)
    assert torch.equal(R._unpack_bits(packed, bits, n).to(torch.uint8), c)
    full = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    assert torch.equal(R._pack_bits(R._unpack_bits(full, bits, n * 8 // bits).to(torch.uint8),
                                    bits), full)
    # quantise -> dequantise -> quantise with the same seed reproduces the same codes
    v = torch.randn(n, generator=g)
    c1, s1 = ops.quantize_pack(v, bits, 64, seed)
    c2, s2 = ops.quantize_pack(v, bits, 64, seed)
    assert torch.equal(c1, c2) and torch.equal(s1, s2)


def test_count_masks_tail(seed):
    g = torch.Generator().manual_seed(seed)
    n, B = 1000, 128
    v = torch.randn(n, generator=g)
    cnt = int(torch.randint(1, n - 1, (1,), generator=g))
    v2 = v.clone()
    v2[cnt:] = 1e6  # garbage padding must not influence scales or codes
    c1, s1 = ops.quantize_pack(v2, 4, B, seed, torch.tensor([cnt], dtype=torch.int32))
    vz = v.clone()
    vz[cnt:] = 0
    c0, s0 = ops.quantize_pack(vz, 4, B, seed)
    assert torch.equal(c1, c0) and torch.equal(s1, s0)
    deq = ops.dequantize_unpack(c1, s1, 4, B, n)
    assert bool((deq[cnt:] == 0).all())


def test_seed_changes_codes_and_errors(seed):
    v = torch.randn(4000, generator=torch.Generator().manual_seed(seed))
    a, _ = ops.quantize_pack(v, 2, 512, seed)
    b, _ = ops.quantize_pack(v, 2, 512, seed + 1)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="bits"):
        ops.quantize_pack(v, 3, 512, 1)
    with pytest.raises(ValueError, match="seed"):
        ops.quantize_pack(v, 4, 512, -1)
    with pytest.raises(ValueError, match="bucket_size"):
        ops.quantize_pack(v, 4, 0, 1)
    with pytest.raises(ValueError, match="codes"):
        ops.dequantize_unpack(a[:10], torch.ones(8), 2, 512, 4000)


def test_philox_uniform_distribution(seed):
    u = ops.philox_uniform(seed, 100000, offset=seed % 1000)
    assert u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())
    # mean 1/2, sd 1/sqrt(12 n): 5 sigma
    assert abs(float(u.double().mean()) - 0.5) <= 5 / (12 * 100000) ** 0.5
    # counter-based: a slice of the stream is the stream of the slice
    assert torch.equal(ops.philox_uniform(seed, 100, offset=seed % 1000 + 500), u[500:600])
