"""Proof across real ranks of the trust matrix: run under ``horovodrun`` (modes ``matrix``,
``scenarios``, ``kill``) or as a plain process (``single``: world size 1).

Usage: horovodrun -np 3 ... python trust_worker.py matrix|scenarios|kill
       python trust_worker.py single

Every case prints one line from rank 0, ``[case] <name> OK ...`` or
``[case] <name> FAIL: <rank r: reason>; ...``, built from every rank's findings (one
``allgather_object`` at the end of the case), so tests/test_trust_hvd.py can report each
case separately from one launch. A case that hangs is ended by a watchdog that prints
``[case] <name> FAIL: hang ...`` and exits (horovodrun then terminates the job).

The expectations are built here in plain torch, never by calling the code under test for
the math:

* the raw gradient of every layer is captured by a post-accumulate-grad hook registered
  BEFORE the optimizer wraps the model (so it runs before hvdsparse's hook), together
  with the layer's residual at that moment (``residual_before``);
* what a rank sent is decoded from the payload the compressor returned (a spy on the
  compressor instance's ``compress`` -- the real method runs) by :func:`decode_payload`,
  an independent plain-torch reader of :class:`hvdsparse.payload.Segment`;
* (a) error feedback, (b) the compressor's selection rule and (c) the exchanged
  gradient = (sum over ranks in rank order of sent_r) / P are checked per layer and step;
* ``balanced``: the Ok-Topk truncation (:func:`check_balanced_bucket`) and its feedback
  (a sent, undelivered element goes back into the sender's residual; the residual is
  carried by the replay from step to step; parameters follow plain SGD on the
  delivered sum).
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
import hvdsparse
from hvdsparse import codec, native
from hvdsparse.compressors import topk_bucket as TB
from hvdsparse.payload import IndexEncoding, ValueEncoding

MODE = sys.argv[1] if len(sys.argv) > 1 else "matrix"
hvd.init()
R, P = hvd.rank(), hvd.size()
torch.set_num_threads(1)
warnings.simplefilter("ignore")

U = 2.0 ** -24                     # unit roundoff of fp32
TINY = float(torch.finfo(torch.float32).tiny)
QBITS = {int(ValueEncoding.INT8): 8, int(ValueEncoding.INT4): 4, int(ValueEncoding.INT2): 2}


# ------------------------------------------------------------------------------ output
def say(msg):
    if R == 0:
        print(msg, flush=True)


def gather(obj, tag):
    return hvd.allgather_object(obj, name=f"trust.{tag}")


class Case:
    """Collects this rank's failures for one case; ``finish()`` gathers every rank's and
    prints one line (rank 0). A watchdog ends the job if the case hangs."""

    def __init__(self, name, timeout=180.0):
        self.name = name
        self.fails = []
        self.notes = []
        self.cut = 0            # AdaComp layer budgets that held back a slot
        self._timer = threading.Timer(timeout, self._hang)
        self._timer.daemon = True
        self._timer.start()

    def _hang(self):
        print(f"[case] {self.name} FAIL: hang: rank {R} did not finish the case within the "
              f"watchdog time", flush=True)
        os._exit(7)

    def check(self, cond, msg):
        if not cond and len(self.fails) < 6:
            self.fails.append(f"rank {R}: {msg}")
        return bool(cond)

    def fail(self, msg):
        self.check(False, msg)

    def finish(self):
        self._timer.cancel()
        everyone = gather((self.fails, self.notes), f"end.{self.name}")
        fails = [f for fl, _ in everyone for f in fl]
        notes = everyone[0][1]
        if fails:
            say(f"[case] {self.name} FAIL: " + " | ".join(fails[:8]).replace("\n", " "))
        else:
            say(f"[case] {self.name} OK " + "; ".join(notes))
        return not fails


def digest(model):
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def maxdiff(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ------------------------------------------------------------------------------ models
class Net(nn.Module):
    """Mixed sizes: fc1/fc2/fc3 weights (1536, 3072, 1920 elements) are compressed
    (>= min_numel 1024), the biases and head go dense by the policy."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 64)
        self.fc2 = nn.Linear(64, 48)
        self.fc3 = nn.Linear(48, 40)
        self.head = nn.Linear(40, 5)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        h = torch.tanh(self.fc3(h))
        return self.head(h)


def batch(step, rank, salt=0, n=16):
    g = torch.Generator().manual_seed(1_000_003 * salt + 7919 * step + 104_729 * rank + 17)
    x = torch.randn(n, 24, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return x, y


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net()


def loss_of(model, step, salt=0):
    x, y = batch(step, R, salt)
    return F.cross_entropy(model(x), y)


# ------------------------------------------------------------------------------ capture
class Capture:
    """Hooks registered before the optimizer: raw gradient and residual before compress;
    a spy on ``compression.compress`` keeps the payload the real method returned."""

    def __init__(self, model, comp, inject=None):
        self.comp = comp
        self.raw, self.rbefore, self.payloads = {}, {}, {}
        self.inject = inject            # fn(name, grad) -> None, mutates grad in place
        self.handles = []
        for name, p in model.named_parameters():
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))
        orig = comp.compress

        def spy(name, grad, *args, **kwargs):
            pl = orig(name, grad, *args, **kwargs)
            self.payloads[name] = pl
            return pl
        comp.compress = spy
        # TopK's bucket path (compressors/topk_bucket.py: the default on the device path
        # and, with the compiled loops, on the CPU) compresses a bucket's layers without
        # calling compress(): keep what it returned too
        self._orig_bucket = TB.compress_bucket

        def bucket_spy(c, items, *args, **kwargs):
            pays, batch = self._orig_bucket(c, items, *args, **kwargs)
            if c is self.comp:
                self.payloads.update(pays)
                self.bucket_layers.update(pays)
            return pays, batch
        self.bucket_layers = set()
        TB.compress_bucket = bucket_spy

    def _hook(self, name):
        def hook(p):
            with torch.no_grad():
                if self.inject is not None:
                    self.inject(name, p.grad)
                g = p.grad
                self.raw[name] = (g.coalesce().to_dense() if g.is_sparse else g).detach().clone()
                r = self.comp.residual(name)
                self.rbefore[name] = None if r is None else r.detach().clone()
        return hook

    def reset(self):
        self.raw.clear()
        self.rbefore.clear()
        self.payloads.clear()

    def remove(self):
        for h in self.handles:
            h.remove()
        TB.compress_bucket = self._orig_bucket


# ------------------------------------------------------------------------------ decoder
def _unpack(u8, bits, n):
    """Element j of a little-end packed stream: byte j*bits//8, bit (j*bits)%8."""
    j = torch.arange(n, dtype=torch.int64)
    byte = u8.to(torch.int64)[(j * bits) // 8]
    return (byte >> ((j * bits) % 8)) & ((1 << bits) - 1)


def decode_segment(seg):
    """(idx int64[count], val fp32[count], scales or None): the valid slots of a segment,
    read in plain torch from its fields (independent of hvdsparse.codec)."""
    n, cap = int(seg.numel), int(seg.capacity)
    cnt = int(seg.count.reshape(-1)[0])
    ie, ve = int(seg.index_encoding), int(seg.value_encoding)
    if not 0 <= cnt <= cap:
        raise AssertionError(f"count {cnt} outside [0, capacity {cap}]")
    if ie == IndexEncoding.DENSE:
        if cap != n or cnt != n:
            raise AssertionError(f"dense segment with capacity {cap} / count {cnt} != n {n}")
        idx = torch.arange(n, dtype=torch.int64)
    elif ie == IndexEncoding.INT32:
        idx = seg.indices.reshape(-1)[:cnt].to(torch.int64)
    elif ie in (IndexEncoding.BIN_U8, IndexEncoding.BIN_U16):
        rel = seg.indices.reshape(-1)
        rel = rel.to(torch.int64) & (0xFF if ie == IndexEncoding.BIN_U8 else 0xFFFF)
        bc = seg.bin_counts.reshape(-1).to(torch.int64)
        if int(bc.sum()) != cnt:
            raise AssertionError(f"bin counts sum {int(bc.sum())} != count {cnt}")
        bins = torch.repeat_interleave(torch.arange(bc.numel()), bc)
        idx = bins * int(seg.bin_size) + rel[:cnt]
        if cnt and int((rel[:cnt] >= int(seg.bin_size)).sum()):
            raise AssertionError("bin-relative index >= bin size")
    elif ie == IndexEncoding.IMPLICIT:
        idx = seg.implicit_indices.reshape(-1)[:cnt].to(torch.int64)
    else:
        raise AssertionError(f"unexpected index encoding {ie}")
    scales = None
    if ve in (ValueEncoding.FP32, ValueEncoding.FP16, ValueEncoding.BF16):
        val = seg.values.reshape(-1)[:cnt].float()
    elif ve in QBITS:
        bits = QBITS[ve]
        s = (1 << (bits - 1)) - 1
        q = _unpack(seg.values.reshape(-1), bits, cap) - (1 << (bits - 1))
        scales = seg.scales.reshape(-1).float()
        sc = scales[torch.arange(cap) // int(seg.quant_bucket)]
        # the documented map: v = fp32(fp32(q * scale) / s)
        val = ((q.to(torch.float32) * sc) / float(s))[:cnt]
    elif ve == ValueEncoding.SIGN1:
        b = _unpack(seg.values.reshape(-1), 1, cnt)
        scales = seg.scales.reshape(-1).float()
        val = torch.where(b.bool(), -scales[0], scales[0])
    else:
        raise AssertionError(f"unexpected value encoding {ve}")
    if cnt and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise AssertionError("index out of range")
    return idx, val, scales


def decode_payload(pl):
    """Dense fp32 sum of the payload's segments plus the decoded segments."""
    dense = torch.zeros(pl.numel, dtype=torch.float32)
    segs = []
    for seg in pl.segments:
        idx, val, scales = decode_segment(seg)
        dense.index_put_((idx,), val, accumulate=True)
        segs.append((seg, idx, val, scales))
    return dense, segs


# ------------------------------------------------------------------------------ rules
def k_of(d, n):
    return max(1, min(n, math.ceil(d * n - 1e-9)))


def is_quant(ve):
    return int(ve) in QBITS


def check_quant(case, where, seg, idx_slots, v, deq, scales):
    """Stochastic rounding of the slot values ``v`` (fp32, slot order, count long):
    scale_b = max |v| over the valid slots of quantisation bucket b (bitwise) and
    |deq - v| <= scale_b / s (plus one fp32 rounding), sign preserved."""
    bits = QBITS[int(seg.value_encoding)]
    s = (1 << (bits - 1)) - 1
    qb = int(seg.quant_bucket)
    cnt = v.numel()
    if cnt == 0:
        return
    b = torch.arange(cnt) // qb
    nb = int(b.max()) + 1
    exp_scale = torch.zeros(nb).index_reduce_(0, b, v.abs(), "amax", include_self=True)
    case.check(torch.equal(scales[:nb], exp_scale),
               f"{where}: quantisation scales {scales[:nb].tolist()[:4]} != max |value| per "
               f"bucket {exp_scale.tolist()[:4]}")
    # |q scale / s - v| < scale / s exactly; deq adds two fp32 roundings (<= 2u scale)
    bound = scales[b] / s + 4 * U * scales[b] + 1e-30
    err = (deq.double() - v.double()).abs()
    case.check(bool((err <= bound.double()).all()),
               f"{where}: |deq - v| exceeds scale/{s}: max excess "
               f"{float((err - bound.double()).max())}")
    case.check(bool(((deq * v) >= 0).all()), f"{where}: quantisation flipped a sign")


class Replay:
    """Per-rank plain-torch state a compressor rule needs across steps (Threshold's tau)."""

    def __init__(self):
        self.tau = {}
        self.k = {}
        self.res = {}       # balanced: this rank's residual, carried with the add-back
        self.fed = {}       # balanced: elements fed back (counts)


def slim_push(step, cfg):
    """Slim-DP pushes the whole layer dense at step 0 (its average chooses the first
    core) and before every re-selection ((step + 1) % q == 0)."""
    return step == 0 or (step + 1) % cfg["q"] == 0


def slim_core(p, core_n):
    """Slim-DP's core from identical data (Eq. 1): the core_n largest |w| + c|g|,
    c = mean|w| / mean|g|, g the averaged gradient, w the weights before the update."""
    ag = p.grad.detach().reshape(-1).float().abs()
    aw = p.detach().reshape(-1).float().abs()
    mg = ag.mean()
    c = aw.mean() / mg if float(mg) > 0 else torch.ones(())
    return torch.sort(torch.topk(aw + c * ag, core_n, sorted=False).indices).values


def check_layer(case, kind, cfg, name, step, grad, rb, ra, pl, replay, policy_dense,
                delivered=None):
    """Checks (a) and (b) for one layer of this rank at one step; returns sent (fp32).
    ``delivered`` (bool per element, ``balanced`` buckets): where the exchange delivered
    a value; a sent element that was not delivered must be back in the residual
    (``residual_after = (acc - sent) + sent`` there, the Ok-Topk feedback), the checks
    below then see the residual before that add-back."""
    where = f"{kind} step {step} {name}"
    n = grad.numel()
    flat = grad.reshape(-1).float()
    try:
        sent, segs = decode_payload(pl)
    except AssertionError as e:
        case.fail(f"{where}: payload: {e}")
        return torch.zeros(n)
    rbz = torch.zeros(n) if rb is None else rb.reshape(-1)
    acc = rbz + flat                       # fp32, as residual_add (one rounding)
    ef = cfg.get("ef", True) and not policy_dense
    raz = torch.zeros(n) if ra is None else ra.reshape(-1)
    exact_vals = all(int(s.value_encoding) == ValueEncoding.FP32 for s, *_ in segs)
    # a policy-dense layer keeps no residual of its own, but takes back what a balanced
    # bucket sent and did not deliver (flushed by its next dense send)
    if delivered is not None and cfg.get("ef", True):
        back = torch.where(delivered.reshape(-1), torch.zeros(()), sent)
        und = back != 0
        pure = acc - sent                   # the residual before the add-back (fp32)
        want = pure[und] + back[und]
        got = raz[und]
        if exact_vals:
            case.check(torch.equal(got, want), f"{where}: a sent, undelivered element is "
                       f"not back in the residual (max diff {maxdiff(got, want)})")
        else:
            # pure and deq as the library rounds them: a few fp32 roundings
            bd = 2 * U * (pure[und].double().abs() + back[und].double().abs()
                          + want.double().abs()) + 1e-38
            case.check(bool(((got.double() - want.double()).abs() <= bd).all()),
                       f"{where}: a sent, undelivered element is not back in the residual")
        replay.fed[(name, "count")] = replay.fed.get((name, "count"), 0) + int(und.sum())
        raz = torch.where(und, pure, raz)

    # ---- (a) error feedback: sent + residual_after == residual_before + grad
    if policy_dense:
        case.check(float(raz.abs().max()) == 0.0 if n else True,
                   f"{where}: policy-dense layer keeps a residual")
        case.check(torch.equal(sent, acc), f"{where}: dense layer sent != grad (+ pending "
                   f"residual), max diff {maxdiff(sent, acc)}")
    elif not ef:
        case.check(ra is None or float(ra.abs().max()) == 0.0,
                   f"{where}: error_feedback=False but a residual is kept")
    elif exact_vals:
        case.check(torch.equal(sent + raz, acc),
                   f"{where}: (a) sent + residual_after != residual_before + grad (fp32 must "
                   f"be exact), max diff {maxdiff(sent + raz, acc)}")
    else:
        # one fp32 rounding of residual_after = fl(acc - deq): |sent + r - acc| <= u |r|
        err = (sent.double() + raz.double() - acc.double()).abs()
        bound = U * raz.double().abs() * (1 + 1e-6) + 1e-38
        case.check(bool((err <= bound).all()),
                   f"{where}: (a) |sent + residual_after - acc| exceeds one fp32 rounding "
                   f"of the residual: max excess {float((err - bound).max())}")
    if policy_dense:
        return sent
    v_in = acc if ef else flat              # what the compressor worked on

    # ---- (b) the selection rule
    seg0, idx0, val0, sc0 = segs[0]
    ie0 = int(seg0.index_encoding)
    if ie0 == IndexEncoding.DENSE and len(segs) == 1:
        # the whole layer (QSGD, SlimDP's push before re-selection, sparse not worth it)
        if is_quant(seg0.value_encoding):
            check_quant(case, where, seg0, idx0, v_in, val0, sc0)
        elif int(seg0.value_encoding) == ValueEncoding.FP32:
            case.check(torch.equal(val0, v_in), f"{where}: dense fp32 values != acc")
        if kind == "slimdp":
            case.check(slim_push(step, cfg), f"{where}: SlimDP went dense outside a push step")
        if kind in ("topk", "threshold", "randomk", "topk_pb", "adacomp"):
            case.notes.append(f"{name} dense at step {step}") if len(case.notes) < 3 else None
        return sent
    if kind in ("topk", "threshold", "randomk", "topk_pb"):
        idx, val = idx0, val0
        cnt = idx.numel()
        case.check(len(segs) == 1, f"{where}: {len(segs)} segments")
        case.check(idx.unique().numel() == cnt, f"{where}: repeated indices")
        if is_quant(seg0.value_encoding):
            check_quant(case, where, seg0, idx, acc[idx], val, sc0)
        elif int(seg0.value_encoding) == ValueEncoding.FP32:
            case.check(torch.equal(val, acc[idx]), f"{where}: sent values != acc at the "
                       f"selected indices, max diff {maxdiff(val, acc[idx])}")
        a = acc.abs()
        mask = torch.zeros(n, dtype=torch.bool)
        mask[idx] = True
        nnz = int((a > 0).sum())
        if kind == "topk":
            k = k_of(cfg["ratio"], n)
            C = min(n, math.ceil(1.5 * k))
            case.check(cnt <= C, f"{where}: count {cnt} > capacity {C}")
            # layers this small (2 * sample > n) get the exact k-th largest |acc|
            case.check(cnt >= min(k, nnz), f"{where}: count {cnt} < k {k}")
            if cnt and cnt < n:
                lo, hi = float(a[mask].min()), float(a[~mask].max())
                case.check(lo >= hi, f"{where}: an unsent |acc| {hi} exceeds a sent one {lo}")
        elif kind == "randomk":
            k = k_of(cfg["ratio"], n)
            case.check(cnt == k, f"{where}: RandomK sent {cnt} != k {k}")
        elif kind == "topk_pb":
            B = min(cfg["B"], n)
            kb = k_of(cfg["ratio"], B)
            nb = -(-n // B)
            pad = nb * B - n
            ap = torch.cat([a, torch.zeros(pad)]).view(nb, B)
            mp = torch.cat([mask, torch.zeros(pad, dtype=torch.bool)]).view(nb, B)
            per = mp.sum(1)
            nzb = (ap > 0).sum(1)
            case.check(torch.equal(per, torch.minimum(nzb, torch.full_like(nzb, kb))),
                       f"{where}: per-bucket counts {per.tolist()} != min(kb={kb}, nnz)")
            lo = torch.where(mp, ap, torch.full_like(ap, float("inf"))).min(1).values
            hi = torch.where(mp, torch.full_like(ap, -1.0), ap).max(1).values
            case.check(bool((lo >= hi).all()), f"{where}: per bucket an unsent |acc| exceeds "
                       f"a sent one")
        elif kind == "threshold":
            k = k_of(1.0 - cfg["sparsity"], n)
            cap = min(n, math.ceil(2.0 * k))
            refresh = replay.tau.get(name) is None or step % 1000 == 0 or \
                replay.k.get(name) != k
            if refresh:
                replay.tau[name] = torch.topk(a, k, sorted=False).values.min().clamp_min(TINY)
                replay.k[name] = k
            tau = replay.tau[name]
            sel = torch.nonzero(a >= tau).reshape(-1)
            want = sel[:cap]               # the first `cap` in ascending index order (CPU)
            if not refresh and sel.numel() > cap:
                # the overflow ladder: rungs fp32(tau * 2^(j/8)), j < 32; everything at or
                # above the lowest that fits (past the top rung: its first `cap`)
                rungs = [tau * torch.tensor(2.0 ** (j / 8), dtype=torch.float32)
                         for j in range(32)]
                r = min(sum(int((a >= t).sum()) > cap for t in rungs), 31)
                want = torch.nonzero(a >= rungs[r]).reshape(-1)[:cap]
            case.check(torch.equal(torch.sort(idx).values, want),
                       f"{where}: sent {cnt} indices, expected the {want.numel()} of "
                       f"{sel.numel()} with |acc| >= tau={float(tau):.6g} (cap {cap})")
            # overflow guard: tau *= min(2, sqrt(selected / cap)) when selected > cap
            ratio = torch.tensor(float(sel.numel()), dtype=torch.float32) / float(cap)
            replay.tau[name] = torch.where(
                ratio > 1.0, tau * ratio.double().sqrt().float().clamp_max(2.0), tau)
        return sent
    if kind == "adacomp":
        L = min(500, n)
        c = min(max(4, math.ceil(L / 50)), L)
        nb = -(-n // L)
        pad = nb * L - n
        G = acc
        H = G + (cfg.get("scale", 4.0) - 1.0) * flat     # AdaComp's documented default: 4
        Gp = torch.cat([G.abs(), torch.zeros(pad)]).view(nb, L)
        Hp = torch.cat([H.abs(), torch.zeros(pad)]).view(nb, L)
        gmax = Gp.max(1).values
        thr = gmax.clamp_min(TINY).unsqueeze(1)
        selp = Hp >= thr
        mask = torch.zeros(n, dtype=torch.bool)
        mask[idx0] = True
        mp = torch.cat([mask, torch.zeros(pad, dtype=torch.bool)]).view(nb, L)
        case.check(bool((~mp | selp).all()), f"{where}: AdaComp sent an element with "
                   f"|H| < its bin max |G|")
        want = torch.minimum(selp.sum(1), torch.full((nb,), c))
        a = cfg.get("mean_per_bin")
        budget = nb * c if a is None else min(nb * c, max(c, math.ceil(a * nb - 1e-9)))
        if budget < nb * c:
            # the layer budget: dealt one slot per bin per round from bin
            # step * 2654435761 mod nb (the plain oracle's deal)
            from hvdsparse import oracle
            demand = want
            want = torch.tensor(oracle.bin_quota(demand.tolist(), budget,
                                                 (step * 2654435761) % nb))
            case.cut += int(want.sum()) < int(demand.sum())
        case.check(torch.equal(mp.sum(1), want), f"{where}: per-bin counts "
                   f"{mp.sum(1).tolist()} != {want.tolist()} (min({c}, #|H|>=gmax)"
                   f"{'' if budget == nb * c else f', dealt within a budget of {budget}'})")
        lo = torch.where(mp, Hp, torch.full_like(Hp, float("inf"))).min(1).values
        hi = torch.where(selp & ~mp, Hp, torch.full_like(Hp, -1.0)).max(1).values
        case.check(bool((lo >= hi).all()), f"{where}: AdaComp left a larger |H| unsent")
        # the mean in its documented summation order (the plain oracle's loops)
        from hvdsparse import oracle
        s = oracle.segment_mean(gmax)
        q = torch.where(G[idx0] < 0, -s, s)
        case.check(torch.equal(val0, q), f"{where}: AdaComp values != sign(G) * mean bin max "
                   f"({float(s)}), max diff {maxdiff(val0, q)}")
        ra_exp = G.clone()
        ra_exp[idx0] = G[idx0] - q
        case.check(torch.equal(raz, ra_exp), f"{where}: AdaComp residual != G - Q(G) on sent, "
                   f"G elsewhere (max diff {maxdiff(raz, ra_exp)})")
        return sent
    if kind == "slimdp":
        core_n = min(n, math.ceil(cfg["beta"] * n - 1e-9))
        ex_n = min(n - core_n, max(0, math.ceil((cfg["alpha"] - cfg["beta"]) * n - 1e-9)))
        case.check(not slim_push(step, cfg), f"{where}: SlimDP did not push dense at step 0 / "
                   f"before re-selection")
        core = [t for t in segs if int(t[0].index_encoding) == IndexEncoding.IMPLICIT]
        expl = [t for t in segs if int(t[0].index_encoding) == IndexEncoding.INT32]
        if not case.check(len(core) == 1 and len(expl) == 1 and len(segs) == 2,
                          f"{where}: SlimDP segments "
                          f"{[int(t[0].index_encoding) for t in segs]}"):
            return sent
        ci, ei = core[0][1], expl[0][1]
        case.check(ci.numel() == core_n and ci.unique().numel() == core_n,
                   f"{where}: core size {ci.numel()} != {core_n}")
        case.check(ei.numel() == ex_n and ei.unique().numel() == ex_n,
                   f"{where}: explorer size {ei.numel()} != {ex_n}")
        both = torch.cat([ci, ei])
        case.check(both.unique().numel() == both.numel(), f"{where}: explorer overlaps core")
        case.check(torch.equal(sent[both], acc[both]), f"{where}: SlimDP values != acc")
        replay.k[("core", name)] = torch.sort(ci).values
        exp = replay.k.get(("core_exp", name))
        if exp is not None:
            case.check(torch.equal(torch.sort(ci).values, exp),
                       f"{where}: core is not the top-{core_n} of |w| + c|g| (c = mean|w| / "
                       f"mean|g|) of the last push step's averaged gradient and weights")
        return sent
    case.fail(f"{where}: no rule for {kind}")
    return sent


# ------------------------------------------------------------------------------ matrix
COMPRESSORS = {
    "topk": ("topk", dict(ratio=0.05), lambda: hvdsparse.TopK(0.05)),
    "threshold": ("threshold", dict(sparsity=0.95), lambda: hvdsparse.Threshold(0.95)),
    "adacomp": ("adacomp", dict(), lambda: hvdsparse.AdaComp()),
    "adacomp-budget": ("adacomp", dict(mean_per_bin=2),
                       lambda: hvdsparse.AdaComp(mean_per_bin=2)),
    "slimdp": ("slimdp", dict(alpha=0.3, beta=0.15, q=5),
               lambda: hvdsparse.SlimDP(0.3, 0.15, core_period=5)),
    "randomk": ("randomk", dict(ratio=0.05), lambda: hvdsparse.RandomK(0.05)),
    "qsgd4": ("qsgd", dict(ef=False), lambda: hvdsparse.QSGD(4)),
    "topk-int8": ("topk", dict(ratio=0.05), lambda: hvdsparse.TopK(0.05, values="int8")),
    "topk-int4": ("topk", dict(ratio=0.05), lambda: hvdsparse.TopK(0.05, values="int4")),
    # at 5 % an int2 top-k payload (4.25 bytes a pair) is not smaller than the dense int2
    # layer and would go dense: 2 % keeps it sparse
    "topk-int2": ("topk", dict(ratio=0.02), lambda: hvdsparse.TopK(0.02, values="int2")),
    "topk-perbucket": ("topk_pb", dict(ratio=0.05, B=512),
                       lambda: hvdsparse.TopK(0.05, per_bucket=512)),
}
EXCHANGES = ("allgather", "split", "dense", "auto", "balanced")
QUANT_CASES = ("topk-int8", "topk-int4", "topk-int2")
MATRIX_STEPS = int(os.environ.get("TRUST_MATRIX_STEPS", "10"))


def check_balanced_bucket(case, step, bucket, rows, offsets, model):
    """A ``balanced`` bucket (Ok-Topk): in the bucket's flat layout, with the regions
    and per-owner capacity c the exchange reports, the delivered sum must be, region by
    region, the sum over ranks (rank order, fp32) of what they sent restricted to its
    min(c, nnz) entries of largest magnitude, divided by P; nothing else delivered."""
    params = dict(model.named_parameters())
    T = torch.zeros(bucket["numel"])
    absum = torch.zeros(bucket["numel"], dtype=torch.float64)
    for r in range(P):
        s_r = torch.cat([rows[r, offsets[n][0]:offsets[n][0] + offsets[n][1]]
                         for n in bucket["layers"]])
        T = T + s_r
        absum += s_r.double().abs()
    got = torch.cat([params[n].grad.detach().reshape(-1) for n in bucket["layers"]])
    f = bucket["figures"]
    bounds, c = f["bounds"], f["p2_capacity"]
    case.check(bounds[0] == 0 and bounds[-1] == bucket["numel"] and len(bounds) == P + 1
               and all(a <= b for a, b in zip(bounds, bounds[1:])),
               f"step {step} bucket {bucket['id']}: bad regions {bounds}")
    worst = 0.0
    for r in range(P):
        a, e = bounds[r], bounds[r + 1]
        Tr, d = T[a:e], got[a:e] != 0
        nz = Tr != 0
        case.check(not bool((d & ~nz).any()),
                   f"step {step} bucket {bucket['id']} region {r}: delivered where the sum is 0")
        case.check(int(d.sum()) == min(c, int(nz.sum())),
                   f"step {step} bucket {bucket['id']} region {r}: {int(d.sum())} entries "
                   f"delivered, want min(c={c}, nnz={int(nz.sum())})")
        dropped = nz & ~d
        if bool(d.any()) and bool(dropped.any()):
            case.check(float(Tr[d].abs().min()) >= float(Tr[dropped].abs().max()),
                       f"step {step} bucket {bucket['id']} region {r}: a dropped |sum| "
                       f"exceeds a delivered one (not the top-{c})")
    want = torch.where(got != 0, T / float(P), torch.zeros(()))
    bound = (2 * (P - 1) * U * absum / P + 2 * U * want.double().abs()) * 1.01 + 1e-38
    err = (got.double() - want.double()).abs()
    worst = max(worst, float((err / bound).max()))
    case.check(bool((err <= bound).all()),
               f"step {step} bucket {bucket['id']} (balanced): delivered values off the "
               f"rank sum / P by {float(err.max())}")
    return worst


def matrix_case(cname, exchange):
    case = Case(f"matrix/{cname}/{exchange}")
    kind, cfg, make = COMPRESSORS[cname]
    model = make_model(seed=5)
    comp = make()
    cap = Capture(model, comp)
    # the replay applies plain SGD momentum to the exchanged sum, so DGC momentum
    # correction is off here explicitly (whatever the library's default); its own
    # replay runs in momentum_worker.py and the "skip + DGC" scenario
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, exchange=exchange,
                                   fusion_threshold=2000, momentum_correction=False)
    if not case.check(hasattr(opt, "scheduler"), "routing did not reach hvdsparse"):
        return case.finish()
    names = [n for n, _ in model.named_parameters()]
    # TopK's / Threshold's output layer (topk.py's docstring): the last registered
    # parameter the policy compresses is sent at density >= output_ratio = 0.1
    out_name = None
    if kind in ("topk", "topk_pb", "threshold"):
        out_name = [n for n, p in model.named_parameters()
                    if not comp.policy.is_dense(n, p.shape)][-1]
        case.check(comp.output_layer == out_name, f"output layer {comp.output_layer!r}, "
                   f"expected {out_name!r}")
    replay = Replay()
    bitwise_all, worst = True, 0.0
    sgd_par = {n: p.detach().clone() for n, p in model.named_parameters()}
    sgd_buf, fed_energy = {}, []
    strategies, avg_forms = set(), set()
    try:
        for step in range(MATRIX_STEPS):
            cap.reset()
            opt.zero_grad()
            loss_of(model, step, salt=1).backward()
            opt.synchronize()
            last = opt.stats()["last"]
            layer_strategy = {n: b["strategy"] for b in last["buckets"] for n in b["layers"]}
            strategies.update(layer_strategy.values())
            sent = {}
            for name, p in model.named_parameters():
                if name not in cap.payloads:
                    case.fail(f"step {step} {name}: no payload from compress()")
                    sent[name] = torch.zeros(p.numel())
                    continue
                pd = comp.policy.is_dense(name, p.shape)
                bal = layer_strategy.get(name) == "balanced"
                ef = cfg.get("ef", True) and not pd
                if bal and ef:
                    # (a') the residual carried by this replay (add-back included) is the
                    # one the compressor starts the step with
                    rr = replay.res.get(name, torch.zeros(p.numel()))
                    rb = cap.rbefore[name]
                    rbz = torch.zeros(p.numel()) if rb is None else rb.reshape(-1)
                    if cname in QUANT_CASES:   # rounded differently: a few fp32 roundings
                        ok = bool(((rbz - rr).abs() <= 4 * U * rr.abs() + 1e-38).all())
                    else:
                        ok = torch.equal(rbz, rr)
                    case.check(ok, f"step {step} {name}: residual before the step != the "
                               f"replay's carried residual (max diff {maxdiff(rbz, rr)})")
                lcfg = cfg
                if name == out_name and "ratio" in cfg:
                    lcfg = dict(cfg, ratio=max(cfg["ratio"], 0.1))
                elif name == out_name:
                    lcfg = dict(cfg, sparsity=min(cfg["sparsity"], 0.9))
                sent[name] = check_layer(case, kind, lcfg, name, step, cap.raw[name],
                                         cap.rbefore[name], comp.residual(name),
                                         cap.payloads[name], replay, pd,
                                         delivered=(p.grad.detach() != 0) if bal else None)
                if bal and ef:
                    acc = rr + cap.raw[name].reshape(-1).float()
                    pure = acc - sent[name]
                    back = torch.where(p.grad.detach().reshape(-1) != 0, torch.zeros(()),
                                       sent[name])
                    nxt = torch.where(back != 0, pure + back, pure)
                    if cname in QUANT_CASES:   # do not let the roundings compound
                        r_lib = comp.residual(name)
                        nxt = r_lib.detach().reshape(-1).clone()
                    replay.res[name] = nxt
            if kind == "slimdp" and slim_push(step, cfg):
                for name, p in model.named_parameters():
                    if not comp.policy.is_dense(name, p.shape):
                        replay.k[("core_exp", name)] = slim_core(
                            p, min(p.numel(), math.ceil(cfg["beta"] * p.numel() - 1e-9)))
            # one allgather per step: every rank's sent vectors and parameters (flat fp32)
            flat_sent = torch.cat([sent[n].reshape(-1) for n in names])
            flat_par = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
            rows = hvd.allgather(torch.cat([flat_sent, flat_par]).unsqueeze(0),
                                 name=f"trust.m.{cname}.{exchange}.{step}")
            pars = rows[:, flat_sent.numel():]
            case.check(all(torch.equal(pars[r], pars[0]) for r in range(P)),
                       f"step {step}: parameters differ across ranks before the update")
            if kind == "slimdp":
                core = {n: replay.k.get(("core", n)) for n in names}
                cores = gather(core, f"m.{cname}.{exchange}.{step}.core")
                for n in names:
                    cs = [c[n] for c in cores]
                    if cs[0] is not None:
                        case.check(all(c is not None and torch.equal(c, cs[0]) for c in cs),
                                   f"step {step} {n}: Slim-DP cores differ across ranks")
            # (c') balanced buckets: the Ok-Topk truncation replayed (then skipped below)
            offsets, o = {}, 0
            for name, p in model.named_parameters():
                offsets[name] = (o, p.numel())
                o += p.numel()
            for bk in last["buckets"]:
                if bk["strategy"] == "balanced":
                    worst = max(worst, check_balanced_bucket(case, step, bk, rows, offsets,
                                                             model))
                    bitwise_all = False
                    fed_energy.append(bk["figures"].get("p2_dropped_energy", 0.0))
            if exchange == "balanced":
                # plain SGD (lr 0.1, momentum 0.5) on the replayed gradient: the delivered
                # part of the rank sum / P (what phase 2 dropped went to the residuals)
                for name, p in model.named_parameters():
                    o_, k_ = offsets[name]
                    T = torch.zeros(k_)
                    for r in range(P):
                        T = T + rows[r, o_:o_ + k_]
                    g = torch.where(p.grad.detach().reshape(-1) != 0, T / float(P),
                                    torch.zeros(())).view(p.shape)
                    b_ = sgd_buf.get(name)
                    sgd_buf[name] = g.clone() if b_ is None else b_ * 0.5 + g
                    sgd_par[name] = sgd_par[name] - 0.1 * sgd_buf[name]
            # (c) p.grad == (sum over ranks, in rank order, of sent_r) / P
            off = 0
            for name, p in model.named_parameters():
                k = p.numel()
                if layer_strategy.get(name) == "balanced":
                    off += k
                    continue
                tot = torch.zeros(k)
                absum = torch.zeros(k, dtype=torch.float64)
                for r in range(P):
                    s_r = rows[r, off:off + k]
                    tot = tot + s_r
                    absum += s_r.double().abs()
                off += k
                want = tot / float(P)
                got = p.grad.detach().reshape(-1)
                same = torch.equal(got, want)
                if layer_strategy.get(name) == "allgather":
                    # the documented average is sum / P; sum * fp32(1/P) is the same
                    # rank-independent rank-order sum, one rounding apart: accepted, noted
                    other = torch.equal(got, tot * (1.0 / P))
                    if not same and other:
                        avg_forms.add("sum*(1/P)")
                    else:
                        if same and not other:
                            avg_forms.add("sum/P")
                        case.check(same, f"step {step} {name} (allgather): p.grad != rank-order "
                                   f"sum / P, max diff {maxdiff(got, want)}")
                else:
                    bitwise_all &= same
                    # fp32 summation in another order + the division: bound stated here
                    bound = (2 * (P - 1) * U * absum / P + 2 * U * want.double().abs()
                             ) * 1.01 + 1e-38
                    err = (got.double() - want.double()).abs()
                    worst = max(worst, float((err / bound).max()))
                    case.check(bool((err <= bound).all()),
                               f"step {step} {name} ({layer_strategy.get(name)}): p.grad off "
                               f"the rank sum / P by {float(err.max())} > order bound")
            with opt.skip_synchronize():
                opt.step()
            if exchange == "balanced":
                for name, p in model.named_parameters():
                    case.check(torch.allclose(p.detach(), sgd_par[name], rtol=1e-5,
                                              atol=1e-6),
                               f"step {step} {name}: parameters off the plain-SGD replay "
                               f"of the truncated sum by {maxdiff(p.detach(), sgd_par[name])}")
        final = gather(digest(model), f"m.{cname}.{exchange}.final")
        case.check(all(d == final[0] for d in final), "parameters differ across ranks at the end")
    except Exception as e:  # noqa: BLE001 - reported per case
        case.fail(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    if cfg.get("mean_per_bin") is not None:
        case.check(case.cut > 0, "the layer budget never held a slot back (a test that "
                   "cannot fail)")
        case.notes.append(f"budget cut {case.cut} layer-steps")
    case.notes.append(f"strategies {sorted(strategies)}")
    if cname in ("topk", "threshold") and native.available() and \
            os.environ.get("HVDSPARSE_BUCKET_PATH", "1") != "0":
        # the default path of fp32 TopK (and Threshold between its refreshes) on the
        # CPU: the matrix must have checked it
        case.check(bool(cap.bucket_layers), f"{cname}: the bucket path never ran")
        case.notes.append(f"bucket path: {sorted(cap.bucket_layers)}")
    if avg_forms:
        case.notes.append(f"allgather average bitwise = {'/'.join(sorted(avg_forms))}")
    if fed_energy:
        fed = sum(v for k, v in replay.fed.items() if k[1] == "count")
        case.notes.append(f"phase 2 dropped {100 * max(fed_energy):.0f}% of the energy at "
                          f"most, {fed} elements fed back on rank {R}")
    if exchange in ("split", "dense", "balanced") or strategies - {"allgather"}:
        case.notes.append(f"non-allgather buckets bitwise={bitwise_all} worst err/bound "
                          f"{worst:.3f}")
    opt.scheduler.remove_hooks()
    cap.remove()
    return case.finish()


def run_matrix():
    only = os.environ.get("TRUST_MATRIX_ONLY")
    for cname in COMPRESSORS:
        for ex in EXCHANGES:
            if only and f"{cname}/{ex}" not in only.split(","):
                continue
            t0 = time.time()
            matrix_case(cname, ex)
            if os.environ.get("TRUST_TIMING"):
                say(f"[time] {cname}/{ex} {time.time() - t0:.2f}s")


# ------------------------------------------------------------------------------ scenarios
def residuals(comp, names):
    out = {}
    for n in names:
        r = comp.residual(n)
        out[n] = None if r is None else r.detach().clone()
    return out


def same_residuals(a, b):
    for n in a:
        x, y = a[n], b.get(n)
        if (x is None) != (y is None):
            if x is not None and float(x.abs().max()) == 0 or \
                    y is not None and float(y.abs().max()) == 0:
                continue
            return n
        if x is not None and not torch.equal(x, y):
            return n
    return None


NAN_STEP, NAN_LAYER, NAN_POS = 2, "fc2.weight", (3, 7)


def nan_raise(exchange="allgather"):
    case = Case("nan/raise" if exchange == "allgather" else f"nan/raise-{exchange}")
    model = make_model(1)
    comp = hvdsparse.TopK(0.05)

    def inject(name, g):
        if R == 1 and name == NAN_LAYER and state["step"] == NAN_STEP:
            g[NAN_POS] = float("nan")
    state = dict(step=0)
    cap = Capture(model, comp, inject)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, exchange=exchange)
    names = [n for n, _ in model.named_parameters()]
    raised = None
    try:
        # stop at the NaN step whatever happens: a rank that did not raise must not start
        # collectives of a step the others never join
        for step in range(NAN_STEP + 1):
            state["step"] = step
            opt.zero_grad()
            before = residuals(comp, names)
            loss_of(model, step, salt=2).backward()
            try:
                opt.step()
            except Exception as e:  # noqa: BLE001
                raised = (step, e)
                break
        if raised is None:
            case.fail("no error raised for a NaN gradient on rank 1")
        else:
            step, e = raised
            msg = str(e)
            case.check(step == NAN_STEP, f"raised at step {step}, NaN was injected at "
                       f"{NAN_STEP}: {type(e).__name__}: {msg}")
            case.check(isinstance(e, (RuntimeError, FloatingPointError)),
                       f"{type(e).__name__} raised, expected RuntimeError (or "
                       f"FloatingPointError): {msg}")
            case.check(NAN_LAYER in msg and names_rank(msg, 1),
                       f"message does not name layer {NAN_LAYER!r} and rank 1: {msg!r}")
            case.notes.append(f"{type(e).__name__}: {msg[:160]}")
            after = residuals(comp, names)
            for n, r in after.items():
                if r is not None:
                    case.check(bool(torch.isfinite(r).all()), f"residual of {n} holds a "
                               f"non-finite value after the NaN step")
            if R == 1:
                rb, ra = before.get(NAN_LAYER), after.get(NAN_LAYER)
                flat = NAN_POS[0] * 64 + NAN_POS[1]
                if ra is not None:
                    b = 0.0 if rb is None else float(rb[flat])
                    case.check(float(ra[flat]) == b, f"residual at the NaN element changed "
                               f"({b} -> {float(ra[flat])})")
    except Exception as e:  # noqa: BLE001
        case.fail(f"{type(e).__name__}: {e}")
    opt.scheduler.remove_hooks()
    cap.remove()
    case.finish()


def nan_skip(exchange="allgather", dgc=False):
    """``nonfinite="skip"``. With ``exchange="balanced"`` and DGC's momentum correction
    (one bucket: phase 2 truncates) the skipped steps' rollback must also undo the
    truncation's add-back and the velocity masking, and on the other steps the velocity
    is masked exactly where an element was sent AND delivered (a dropped one went back
    into the residual, so its velocity is kept)."""
    case = Case(f"nan/skip-{exchange}" + ("-dgc" if dgc else ""))
    model = make_model(1)
    comp = hvdsparse.TopK(0.05)
    state = dict(step=0)

    def inject(name, g):
        if R == 1 and name == NAN_LAYER and state["step"] == NAN_STEP:
            g[NAN_POS] = float("nan")
        if R == 0 and name == "fc1.bias" and state["step"] == NAN_STEP + 2:
            g[5] = float("inf")
    cap = Capture(model, comp, inject)
    try:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression=comp, exchange=exchange,
                                       nonfinite="skip", momentum_correction=dgc,
                                       momentum_masking=True)
    except Exception as e:  # noqa: BLE001
        case.fail(f"nonfinite='skip' refused: {type(e).__name__}: {e}")
        cap.remove()
        return case.finish()
    names = [n for n, _ in model.named_parameters()]
    skipped = []
    lu = opt.scheduler.local_update if dgc else None
    kept_u = 0
    try:
        for step in range(7):
            state["step"] = step
            opt.zero_grad()
            rb = residuals(comp, names)
            ub = {n: t.clone() for n, t in lu.u.items()} if lu is not None else {}
            pb = params_of(model)
            loss_of(model, step, salt=3).backward()
            opt.step()
            pa = params_of(model)
            unchanged = all(torch.equal(pa[n], pb[n]) for n in names)
            if step in (NAN_STEP, NAN_STEP + 2):
                case.check(unchanged, f"step {step} (non-finite on rank "
                           f"{1 if step == NAN_STEP else 0}) was not skipped: parameters changed")
                bad = same_residuals(rb, residuals(comp, names))
                case.check(bad is None, f"step {step} skipped but residual of {bad} changed")
                if lu is not None:
                    case.check(set(lu.u) == set(ub) and all(torch.equal(lu.u[n], ub[n])
                                                            for n in ub),
                               f"step {step} skipped but the DGC velocity changed")
                skipped.append(step)
            else:
                case.check(not unchanged, f"step {step}: parameters did not change")
                if lu is not None:
                    params = dict(model.named_parameters())
                    for n, u in lu.u.items():
                        sent = decode_payload(cap.payloads[n])[0].view(u.shape) != 0
                        dl = params[n].grad.detach() != 0
                        case.check(bool((u[sent & dl] == 0).all()), f"step {step} {n}: "
                                   f"velocity of a delivered element not masked")
                        und = sent & ~dl
                        case.check(bool((u[und] != 0).all()), f"step {step} {n}: velocity "
                                   f"of a sent but undelivered element masked")
                        kept_u += int(und.sum())
            for n, r in residuals(comp, names).items():
                if r is not None:
                    case.check(bool(torch.isfinite(r).all()), f"step {step}: residual of {n} "
                               f"not finite")
            case.check(all(bool(torch.isfinite(p).all()) for p in pa.values()),
                       f"step {step}: non-finite parameters")
            d = gather(digest(model), f"skip.{step}")
            case.check(all(x == d[0] for x in d), f"step {step}: replicas differ")
        case.notes.append(f"skipped steps {skipped} (NaN on rank 1 in {NAN_LAYER}, Inf on "
                          f"rank 0 in fc1.bias), training continued, replicas identical")
        if lu is not None:
            case.check(kept_u > 0, "phase 2 never dropped a sent element: nothing tested")
            case.notes.append(f"{kept_u} sent, undelivered elements kept their velocity "
                              f"on rank {R}")
    except Exception as e:  # noqa: BLE001
        case.fail(f"{type(e).__name__}: {e}")
    opt.scheduler.remove_hooks()
    cap.remove()
    case.finish()


def frozen(momentum):
    tag = "frozen/sgd-momentum" if momentum else "frozen/sgd"
    case = Case(tag)
    model = make_model(2)
    comp = hvdsparse.TopK(0.05)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                   momentum=momentum),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, fusion_threshold=2000)
    names = [n for n, _ in model.named_parameters()]
    w = model.fc1.weight
    try:
        frozen_at = None
        for step in range(13):
            if step == 6:
                w.requires_grad_(False)
                frozen_at = w.detach().clone()
            if step == 10:
                w.requires_grad_(True)
            opt.zero_grad(set_to_none=True)
            pb = params_of(model)
            loss_of(model, step, salt=4).backward()
            opt.step()
            pa = params_of(model)
            if 6 <= step < 10:
                case.check(torch.equal(w.detach(), frozen_at),
                           f"step {step}: frozen fc1.weight changed in "
                           f"{int((w.detach() != frozen_at).sum())} elements")
                moved = [n for n in names if n != "fc1.weight" and not torch.equal(pa[n], pb[n])]
                case.check(len(moved) == len(names) - 1,
                           f"step {step}: only {moved} trained while fc1.weight was frozen")
            else:
                case.check(not torch.equal(pa["fc1.weight"], pb["fc1.weight"]),
                           f"step {step}: fc1.weight did not train "
                           f"({'after unfreezing' if step >= 10 else 'before freezing'})")
            d = gather(digest(model), f"{tag}.{step}")
            case.check(all(x == d[0] for x in d), f"step {step}: replicas differ")
        case.notes.append("frozen at steps 6-9: bitwise unchanged; trains before and after")
    except Exception as e:  # noqa: BLE001
        case.fail(f"{type(e).__name__}: {e}")
    opt.scheduler.remove_hooks()
    case.finish()


def sync_then_step():
    case = Case("sync-then-step")
    mA, mB = make_model(3), make_model(3)
    oA = hvd.DistributedOptimizer(torch.optim.SGD(mA.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=mA.named_parameters(),
                                  compression=hvdsparse.TopK(0.05, warmup=hvdsparse.RtWarmup(4)),
                                  exchange="allgather")
    oB = hvd.DistributedOptimizer(torch.optim.SGD(mB.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=mB.named_parameters(),
                                  compression=hvdsparse.TopK(0.05, warmup=hvdsparse.RtWarmup(4)),
                                  exchange="allgather")
    steps = 6
    try:
        for step in range(steps):
            oA.zero_grad()
            loss_of(mA, step, salt=5).backward()
            oA.synchronize()
            oA.step()                      # no skip_synchronize(): must not exchange again
            oB.zero_grad()
            loss_of(mB, step, salt=5).backward()
            oB.synchronize()
            with oB.skip_synchronize():
                oB.step()
            case.check(digest(mA) == digest(mB), f"step {step}: synchronize()+step() differs "
                       f"from synchronize()+skip_synchronize() step()")
            case.check(oA.scheduler.step == step + 1, f"step {step}: scheduler step counter "
                       f"{oA.scheduler.step}, expected {step + 1} (exchanged twice?)")
        d = gather(digest(mA), "sts")
        case.check(all(x == d[0] for x in d), "replicas differ")
        case.notes.append(f"{steps} steps bitwise equal, step counter {oA.scheduler.step}")
    except Exception as e:  # noqa: BLE001
        case.fail(f"{type(e).__name__}: {e}")
    oA.scheduler.remove_hooks()
    oB.scheduler.remove_hooks()
    case.finish()


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)
        self.fc = nn.Linear(16, 80)        # 1280 elements: compressed by TopK
        self.out = nn.Linear(80, 4)

    def forward(self, ids):
        return self.out(torch.tanh(self.fc(self.emb(ids).mean(1))))


def sparse_embeddings():
    case = Case("sparse-embeddings")
    torch.manual_seed(4)
    model = EmbedNet()
    comp = hvdsparse.TopK(0.05)
    cap = Capture(model, comp)
    try:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       compression=comp, fusion_threshold=2000)
        bitwise = True
        losses = []
        for step in range(6):
            cap.reset()
            g = torch.Generator().manual_seed(step * 13 + R)
            ids = torch.randint(0, 100, (8, 5), generator=g)
            y = torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(ids), y)
            loss.backward()
            losses.append(float(loss))
            opt.synchronize()
            raw = gather(cap.raw["emb.weight"], f"emb.{step}")
            tot = torch.zeros(100, 16)
            for r in range(P):
                tot = tot + raw[r]
            want = tot / float(P)
            gg = model.emb.weight.grad
            got = (gg.coalesce().to_dense() if gg.is_sparse else gg).detach()
            bitwise &= torch.equal(got, want)
            case.check(torch.allclose(got, want, rtol=1e-6, atol=1e-9),
                       f"step {step}: embedding grad != average of the ranks' sparse "
                       f"gradients, max diff {maxdiff(got, want)}")
            pb = params_of(model)
            with opt.skip_synchronize():
                opt.step()
            case.check(not torch.equal(pb["emb.weight"], model.emb.weight.detach()),
                       f"step {step}: embedding did not train")
            d = gather(digest(model), f"embd.{step}")
            case.check(all(x == d[0] for x in d), f"step {step}: replicas differ")
        case.notes.append(f"embedding grad bitwise rank-order average: {bitwise}; loss "
                          f"{losses[0]:.3f} -> {losses[-1]:.3f}")
        opt.scheduler.remove_hooks()
    except Exception as e:  # noqa: BLE001
        case.fail(f"{type(e).__name__}: {e}")
    cap.remove()
    case.finish()


def names_rank(msg, r):
    """True when ``msg`` names rank ``r``: 'rank 1', 'rank(s) [1]', 'ranks [0, 1]'."""
    for m in re.finditer(r"\branks?(?:\(s\))?\s*\[?\s*(\d+(?:\s*,\s*\d+)*)", msg):
        if r in [int(x) for x in m.group(1).split(",")]:
            return True
    return False


def mismatch(tag, setting, odd_rank, **per_rank):
    """``per_rank``: keyword -> (value for odd_rank, value for the others)."""
    case = Case(f"mismatch/{tag}", timeout=90)
    model = make_model(6)
    kw = dict(exchange="allgather", fusion_threshold=2000)
    comp = hvdsparse.TopK(0.05)
    env_old = os.environ.get("HVDSPARSE_FUSION_THRESHOLD")
    for key, (odd, other) in per_rank.items():
        v = odd if R == odd_rank else other
        if key == "ratio":
            comp = hvdsparse.TopK(v)
        elif key == "env_fusion_threshold":     # the environment default, no keyword
            kw.pop("fusion_threshold")
            os.environ["HVDSPARSE_FUSION_THRESHOLD"] = str(v)
        else:
            kw[key] = v
    t0 = time.time()
    try:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=comp, **kw)
        loss_of(model, 0, salt=6).backward()
        try:
            opt.step()
            case.fail(f"no error with {setting} different on rank {odd_rank}")
        except ValueError as e:
            msg = str(e)
            case.check(setting in msg and names_rank(msg, odd_rank),
                       f"ValueError does not name {setting!r} and rank {odd_rank}: {msg!r}")
            case.notes.append(f"ValueError after {time.time() - t0:.1f}s: {msg[:200]}")
        except Exception as e:  # noqa: BLE001
            case.fail(f"{type(e).__name__} instead of ValueError: {e}")
        opt.scheduler.remove_hooks()
    except Exception as e:  # noqa: BLE001
        case.fail(f"{type(e).__name__}: {e}")
    if env_old is None:
        os.environ.pop("HVDSPARSE_FUSION_THRESHOLD", None)
    else:
        os.environ["HVDSPARSE_FUSION_THRESHOLD"] = env_old
    case.finish()


def checkpoint():
    case = Case("checkpoint")
    N = 4

    def build():
        m = make_model(7)
        o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=m.named_parameters(),
                                     compression=hvdsparse.TopK(0.05,
                                                                warmup=hvdsparse.RtWarmup(6)),
                                     exchange="allgather", fusion_threshold=2000)
        return m, o

    def train(m, o, steps):
        for step in steps:
            o.zero_grad()
            loss_of(m, step, salt=7).backward()
            o.step()
    opts = []
    try:
        mA, oA = build()
        opts.append(oA)
        train(mA, oA, range(2 * N))
        mB, oB = build()
        opts.append(oB)
        train(mB, oB, range(N))
        # the README recipe: optimizer + model state (any rank) and every rank's
        # compression state, through torch.save and torch.load's defaults (weights_only)
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(dict(model=mB.state_dict(), optimizer=oB.state_dict()),
                       os.path.join(tmp, "ckpt.pt"))
            torch.save(oB.compression_state_dict(), os.path.join(tmp, f"ckpt.pt.rank{R}"))
            try:
                ck = torch.load(os.path.join(tmp, "ckpt.pt"))
                csd = torch.load(os.path.join(tmp, f"ckpt.pt.rank{R}"))
            except Exception as e:  # noqa: BLE001
                msg = str(e)
                msg = msg[max(0, msg.find("Unsupported global")):][:200]
                case.fail(f"torch.load (weights_only=True, torch's default) cannot read the "
                          f"checkpoint: {type(e).__name__}: {msg}")
                ck = torch.load(os.path.join(tmp, "ckpt.pt"), weights_only=False)
                csd = torch.load(os.path.join(tmp, f"ckpt.pt.rank{R}"), weights_only=False)
        sd, msd = ck["optimizer"], ck["model"]
        extra = sd.get("hvdsparse")
        if case.check(isinstance(extra, dict), f"optimizer.state_dict() has no 'hvdsparse' "
                      f"entry (keys {sorted(sd)})"):
            steps = {k: v for k, v in extra.items() if "step" in k}
            case.check(steps and all(v == N for v in steps.values()),
                       f"hvdsparse step counters {steps}, expected {N}")
            case.check(extra.get("fingerprint") is not None, "no configuration fingerprint "
                       f"in state_dict()['hvdsparse'] (keys {sorted(extra)})")
        # a fresh run restored without the compression state warns about the residuals
        mD, oD = build()
        opts.append(oD)
        mD.load_state_dict(msd)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            # torch's load_state_dict aliases same-device state tensors: a private copy
            oD.load_state_dict(copy.deepcopy(sd))
            train(mD, oD, range(N, N + 1))
        msgs = [str(w.message) for w in rec if issubclass(w.category, UserWarning)]
        case.check(any("residual" in m for m in msgs),
                   f"no UserWarning about residuals when loading without the compression "
                   f"state (warnings: {msgs})")
        # a fresh run restored with both continues bitwise as the uninterrupted one
        mC, oC = build()
        opts.append(oC)
        mC.load_state_dict(msd)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            oC.load_state_dict(copy.deepcopy(sd))
            oC.load_compression_state_dict(csd)
            train(mC, oC, range(N, 2 * N))
        msgs = [str(w.message) for w in rec if "residual" in str(w.message)]
        case.check(not msgs, f"residual warning although the compression state was loaded: "
                   f"{msgs}")
        case.check(oC.scheduler.step == 2 * N, f"resumed scheduler step {oC.scheduler.step}")
        case.check(digest(mC) == digest(mA), "resumed run differs from the uninterrupted run: "
                   + ", ".join(f"{n} max diff {maxdiff(a, b)}" for (n, a), (_, b) in
                               zip(mC.named_parameters(), mA.named_parameters())))
        d = gather(digest(mC), "ckpt")
        case.check(all(x == d[0] for x in d), "replicas differ after resume")
        case.notes.append(f"state_dict()['hvdsparse'] keys {sorted(extra or {})}")
    except Exception as e:  # noqa: BLE001
        case.fail(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    for o in opts:
        o.scheduler.remove_hooks()
    case.finish()


def run_scenarios():
    nan_raise()
    nan_raise("dense")           # the counts ride in the allreduce
    nan_skip()
    nan_skip("split")            # the counts travel in their own allgather
    nan_skip("balanced", dgc=True)
    frozen(0.0)
    frozen(0.9)
    sync_then_step()
    sparse_embeddings()
    checkpoint()
    # last: a missing check here would hang (the watchdog then ends the job)
    mismatch("fusion_threshold", "fusion_threshold", 1, fusion_threshold=(100_000, 2000))
    mismatch("ratio", "ratio", 2, ratio=(0.1, 0.05))
    mismatch("exchange", "exchange", 1, exchange=("split", "allgather"))
    mismatch("env-fusion-threshold", "fusion_threshold", 1,
             env_fusion_threshold=(65536, 2000))


# ------------------------------------------------------------------------------ kill
def run_kill():
    """Rank 2 SIGKILLs itself at step 5 of a TopK training loop; the others must not
    finish. Prints what each rank saw."""
    model = make_model(8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvdsparse.TopK(0.05), exchange="allgather")
    try:
        for step in range(400):
            opt.zero_grad()
            loss_of(model, step, salt=8).backward()
            if R == 2 and step == 5:
                print(f"[kill] rank 2 SIGKILL at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            time.sleep(0.02)
    except BaseException as e:  # noqa: BLE001
        print(f"[kill] rank {R} error at {time.time():.3f}: {type(e).__name__}: {e}",
              flush=True)
        raise
    print(f"[kill] rank {R} finished all steps", flush=True)


# ------------------------------------------------------------------------------ single
def run_single():
    """World size 1: no exchange, p.grad untouched, step == the plain optimizer's step."""
    case = Case("single")
    case.check(P == 1, f"world size {P}")
    for cname in ("topk", "adacomp", "qsgd4"):
        mA, mB = make_model(9), make_model(9)
        comp = COMPRESSORS[cname][2]()
        oA = hvd.DistributedOptimizer(torch.optim.SGD(mA.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=mA.named_parameters(),
                                      compression=comp, fusion_threshold=2000)
        oB = torch.optim.SGD(mB.parameters(), lr=0.1, momentum=0.9)
        try:
            for step in range(5):
                oA.zero_grad()
                loss_of(mA, step, salt=9).backward()
                raw = {n: p.grad.detach().clone() for n, p in mA.named_parameters()}
                oA.synchronize()
                for n, p in mA.named_parameters():
                    case.check(torch.equal(p.grad, raw[n]), f"{cname} step {step} {n}: p.grad "
                               f"changed by the optimizer at world size 1 (max diff "
                               f"{maxdiff(p.grad, raw[n])})")
                    r = comp.residual(n)
                    case.check(r is None or float(r.abs().max()) == 0.0,
                               f"{cname} step {step} {n}: a residual was kept at world size 1")
                with oA.skip_synchronize():
                    oA.step()
                oB.zero_grad()
                loss_of(mB, step, salt=9).backward()
                oB.step()
                case.check(digest(mA) == digest(mB), f"{cname} step {step}: differs from the "
                           f"plain optimizer")
        except Exception as e:  # noqa: BLE001
            case.fail(f"{cname}: {type(e).__name__}: {e}")
        oA.scheduler.remove_hooks()
    case.notes.append("TopK/AdaComp/QSGD: p.grad untouched, bitwise equal to plain SGD+momentum")
    case.finish()


def main():
    if MODE == "matrix":
        run_matrix()
    elif MODE == "scenarios":
        run_scenarios()
    elif MODE == "kill":
        run_kill()
        return
    elif MODE == "single":
        run_single()
    else:
        raise SystemExit(f"unknown mode {MODE!r}")
    hvd.barrier()
    print(f"HVDSPARSE-OK rank={R}", flush=True)


if __name__ == "__main__":
    main()
