"""Offline compile check of hvdsparse's Triton kernels for sm_80 and sm_90 (no GPU).

What it does (the engine of ``tests/test_compile_offline.py``):

1. Replaces every ``@triton.jit`` launch kernel in ``hvdsparse.kernels`` with a
   recorder, sets ``HVDSPARSE_FORCE_TRITON=1`` and drives the public API with CPU
   tensors (compressors' ``compress`` on a 25M-element layer; the bucket path of
   ``compressors/bucket.py`` for TopK / Threshold / policy-dense / QSGD / AdaComp rows;
   ``codec.encode`` of narrowed TopK payloads; ``codec.accumulate`` with
   ``validate=False``, per segment and table-driven; DCT-MP's row threshold) and
   ``hvdsparse.ops`` with meta tensors for layers of more than 2**31 elements. Every
   launch is recorded with its grid, arguments and options; nothing runs, so a
   scenario never reads a kernel's output on the host (messages to decode are zeros of
   the right length, or made on the CPU path).
2. Binds each recorded launch exactly as a real launch would (Triton's own binder,
   ``create_function_from_signature`` + ``JITFunction._pack_args``: argument types,
   16-byte alignment / divisibility specialisation, constexprs, options such as
   ``enable_fp_fusion``), de-duplicates the specialisations and compiles each one with
   ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` for cc 80 and
   90. ``ptxas -v`` (the one shipped in the Triton wheel) reports registers and spills.
3. Integer specialisation: a real launch turns an integer argument equal to 1 into a
   constexpr (and one divisible by 16 into an ``i32`` with a divisibility attribute), so
   a kernel whose code needs a tensor there (``x.to(...)`` on an argument) compiles for
   most values and fails for 1. The recorded scenarios rarely pass 1, so every kernel is
   also bound once with each of its (specialised, non-constexpr) integer arguments set
   to 1 and once set to 16, through the same binder, and compiled (``forced`` in the
   report; sm_90 only, compile errors only).
4. Inspects the result and writes a JSON report: compile errors, registers, spill bytes,
   grid sizes, 128-bit global loads (``ld.global.v4``) in the PTX, atomic semantics
   (every global ``atom``/``red`` says ``.relaxed``, a shared one is relaxed or has no
   ``.sem``, which PTX reads as relaxed; no ``fence``), FMA instructions where a product
   feeds a sum (``fma.rn.f32`` must not appear in the no-contraction kernels), fp32
   divisions that are not IEEE-rounded (``div.full`` / ``div.approx`` / ``rcp.approx``
   must not appear there either, nor in the kernels that state ``div_rn``), and the
   integer width of every tensor pointer offset in the Triton IR (``tt.addptr`` with
   ``i32`` offsets would overflow past 2**31 bytes/elements).

Run (must NOT run under TRITON_INTERPRET=1; the test starts it in a subprocess)::

    PYTHONPATH=. python scripts/compile_kernels.py --out report.json [--full] [--cc 90]

``--full`` (or ``HVDSPARSE_COMPILE_FULL=1``): every compressor x encoding x bucket;
default: a representative subset that stays within about a minute with a warm cache.
``--cc 90`` compiles for sm_90 only (the reduced run against a second Triton: put that
Triton first on ``PYTHONPATH``; the report's ``triton`` field says which one ran).
The Triton cache defaults to ``~/.cache/hvdsparse/triton`` (``TRITON_CACHE_DIR``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import OrderedDict

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_kernels.py must run without TRITON_INTERPRET (it compiles for real)")
os.environ["HVDSPARSE_FORCE_TRITON"] = "1"
os.environ.setdefault("TRITON_CACHE_DIR",
                      os.path.join(os.path.expanduser("~"), ".cache", "hvdsparse", "triton"))

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from hvdsparse import ops  # noqa: E402

K = ops.kernels_package()
#: (submodule, kernel attribute) of every launch kernel (a ``@triton.jit`` function that
#: Python code in ``kernels/`` launches as ``kernel[grid](...)``; the ``bucket_*``
#: submodules are imported through ``ops.bucket_kernels``). A literal: the test reads it
#: with ``ast`` and checks it against a scan of ``kernels/*.py``.
KERNELS = [("residual", "_residual_tile_kernel"), ("residual", "_residual_flat_kernel"),
           ("select", "_select_compact_kernel"), ("quantize", "_quantize_pack_kernel"),
           ("quantize", "_unpack_kernel"), ("quantize", "_philox_uniform_kernel"),
           ("scatter", "_scatter_row_kernel"), ("rowthreshold", "_row_threshold_kernel"),
           ("refine", "_refine_count_kernel"), ("refine", "_refine_final_kernel"),
           ("clean", "_clean_kernel"), ("masking", "_zero_slots_kernel"),
           ("binned", "_binned_count_kernel"), ("binned", "_binned_pack_kernel"),
           ("bucket_topk", "_accumulate_kernel"), ("bucket_topk", "_sample_kernel"),
           ("bucket_topk", "_count_kernel"), ("bucket_topk", "_select_kernel"),
           ("bucket_topk", "_clamp_kernel"), ("bucket_topk", "_mask_kernel"),
           ("bucket_topk", "_ladder_kernel"), ("bucket_topk", "_radix_hist_kernel"),
           ("bucket_adam", "_own_step_kernel"),
           ("bucket_dense", "_dense_copy_kernel"), ("bucket_dense", "_qsgd_pack_kernel"),
           ("bucket_dense", "_whole_cast_kernel"), ("bucket_binned", "_ada_accumulate_kernel"),
           ("bucket_binned", "_ada_count_kernel"), ("bucket_binned", "_ada_pack_kernel"),
           ("bucket_decode", "_check_kernel"), ("bucket_decode", "_scatter_kernel"),
           ("bucket_narrow", "_narrow_kernel"), ("segment_mean", "_segment_mean_kernel"),
           ("bucket_randomk", "_pick_kernel"), ("bucket_slimdp", "_gather_kernel"),
           ("bin_quota", "_quota_kernel"), ("bin_quota", "_quota_table_kernel"),
           ("split_ranges", "_split_ranges_kernel")]
#: kernels that stream over a whole layer: grid >= 1000 programs at 25M elements, and
#: 128-bit loads of aligned fp32 inputs
STREAMING = {"_residual_tile_kernel", "_residual_flat_kernel", "_select_compact_kernel",
             "_refine_count_kernel", "_clean_kernel", "_binned_count_kernel",
             "_binned_pack_kernel",
             "_quantize_pack_kernel", "_unpack_kernel", "_philox_uniform_kernel"}
#: table-driven (bucket) kernels whose programs tile the bucket's layers: a launch in a
#: scenario whose bucket holds a 25M-element layer has >= 1000 programs (they take no
#: ``n``; the scenario's name ends in ``@25M``)
TABLE_STREAMING = {"_accumulate_kernel", "_count_kernel", "_select_kernel",
                   "_ladder_kernel", "_radix_hist_kernel", "_dense_copy_kernel",
                   "_whole_cast_kernel", "_qsgd_pack_kernel", "_ada_accumulate_kernel",
                   "_ada_count_kernel", "_ada_pack_kernel", "_own_step_kernel"}
VECTOR_LOADS = {"_residual_tile_kernel", "_residual_flat_kernel", "_select_compact_kernel",
                "_refine_count_kernel", "_clean_kernel",
                "_quantize_pack_kernel"}
#: kernels where a product feeds a sum and the math says two roundings (their modules
#: say ``enable_fp_fusion=False``): no fma.rn.f32, and no approximate fp32 division
NO_FMA = {"_residual_tile_kernel", "_residual_flat_kernel", "_select_compact_kernel",
          "_refine_count_kernel", "_refine_final_kernel", "_binned_count_kernel",
          "_binned_pack_kernel", "_accumulate_kernel", "_count_kernel", "_select_kernel",
          "_ladder_kernel", "_clamp_kernel", "_dense_copy_kernel", "_qsgd_pack_kernel",
          "_whole_cast_kernel",
          "_ada_accumulate_kernel", "_ada_count_kernel", "_ada_pack_kernel", "_pick_kernel",
          "_gather_kernel", "_radix_hist_kernel", "_own_step_kernel"}
#: kernels whose modules state a correctly rounded fp32 division (``div_rn``) without
#: turning contraction off: no approximate fp32 division
EXACT_DIV = {"_quantize_pack_kernel", "_unpack_kernel", "_scatter_row_kernel",
             "_scatter_kernel"}
BIG = 25_000_000

#: kernel -> the positions of its output arguments a recorded launch zero-fills
FILLED = {"_philox_uniform_kernel": (0,)}
RECORDS: list = []
_SCENARIO = ["?"]


class Recorder:
    """Stands in for a JITFunction: ``rec[grid](*args, **kw)`` records, runs nothing --
    except that the outputs named in :data:`FILLED` are zero-filled: values the host
    path computes indices from (RandomK's stratified draw, Slim-DP's explorer: 0 is a
    valid uniform), which left unwritten would send ``index_add_`` out of range."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for i in FILLED.get(self.name, ()):
                if isinstance(args[i], torch.Tensor) and args[i].device.type != "meta":
                    args[i].zero_()
            g = tuple(int(x) for x in (grid(kwargs) if callable(grid) else grid))
            names = list(self.fn.signature.parameters)
            n = args[names.index("n")] if "n" in names and names.index("n") < len(args) \
                else kwargs.get("n")
            RECORDS.append(dict(kernel=self.name, fn=self.fn, grid=g, args=args,
                                kwargs=kwargs, scenario=_SCENARIO[0],
                                n=int(n) if isinstance(n, int) else None))
        return launch


def install_recorders():
    for mod, attr in KERNELS:
        if mod.startswith("bucket_"):
            ops.bucket_kernels(mod[len("bucket_"):])   # imports the submodule once
        m = getattr(K, mod)
        fn = getattr(m, attr)
        setattr(m, attr, Recorder(attr, fn))


class scenario:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        _SCENARIO[0] = self.name

    def __exit__(self, *exc):
        _SCENARIO[0] = "?"


# ------------------------------------------------------------------------ scenarios
def drive(full: bool, errors: list):
    import hvdsparse
    from hvdsparse import codec

    def run(name, f):
        with scenario(name):
            try:
                f()
            except Exception as e:  # reported, and the test fails on it
                errors.append(f"scenario {name}: {type(e).__name__}: {e}\n"
                              f"{traceback.format_exc(limit=6)}")

    # a 2-D layer (1-D layers stay dense by policy); values are irrelevant: nothing runs
    g_big = torch.zeros(5000, BIG // 5000)
    comps = [("TopK-fp32", lambda: hvdsparse.TopK(0.01)),
             ("TopK-int4", lambda: hvdsparse.TopK(0.01, values="int4")),
             # the bf16 store rounds with integer ops (kernels/select.py)
             ("TopK-bf16", lambda: hvdsparse.TopK(0.01, values="bf16")),
             ("AdaComp", lambda: hvdsparse.AdaComp()),
             ("QSGD-4", lambda: hvdsparse.QSGD(4)),
             ("RandomK", lambda: hvdsparse.RandomK(0.01))]
    if full:
        comps += [("TopK-fp16", lambda: hvdsparse.TopK(0.01, values="fp16")),
                  ("TopK-int8", lambda: hvdsparse.TopK(0.01, values="int8")),
                  ("TopK-int2", lambda: hvdsparse.TopK(0.01, values="int2")),
                  ("Threshold", lambda: hvdsparse.Threshold(0.99)),
                  ("AdaComp-500", lambda: hvdsparse.AdaComp(bin_size=500)),
                  ("QSGD-8", lambda: hvdsparse.QSGD(8)),
                  ("QSGD-2-b1024", lambda: hvdsparse.QSGD(2, bucket_size=1024)),
                  ("QSGD-8-ef", lambda: hvdsparse.QSGD(8, error_feedback=True)),
                  ("SlimDP", lambda: hvdsparse.SlimDP(0.2, 0.1))]
    for name, make in comps:
        def f(make=make):
            c = make()
            for step in range(2 if full else 1):
                c.compress("layer25M", g_big, step)
        run(f"{name}@25M", f)
    # AdaComp on a conv weight (bins of 50, u8 indices)
    run("AdaComp-conv@25M", lambda: hvdsparse.AdaComp().compress(
        "conv", torch.zeros(5000, 125, 40, 1), 0))
    # a layer budget (the quota launch between count and pack: 50,000 bins of 500)
    run("AdaComp-budget@25M", lambda: hvdsparse.AdaComp(mean_per_bin=3).compress(
        "layer25M", g_big, 0))
    # an odd-sized layer (24,999,999 elements: 16 does not divide n, so a mask
    # ``offs < n`` alone would forbid 128-bit loads)
    run("TopK-fp32@odd25M", lambda: hvdsparse.TopK(0.01).compress(
        "odd", torch.zeros(4999, 5001), 0))
    # the clean gradient (policy-dense layers, momentum correction, the Adam recipe)
    run("clean-fp32@25M", lambda: ops.clean_grad(
        torch.zeros(BIG), grad_scale=torch.ones(1),
        nonfinite=torch.zeros(1, dtype=torch.int32)))
    run("clean-bf16@odd25M", lambda: ops.clean_grad(
        torch.zeros(BIG - 1, dtype=torch.bfloat16)))
    run("clean-meta-2^31+5", lambda: ops.clean_grad(
        torch.empty((1 << 31) + 5, device=torch.device("meta"))))
    # momentum-factor masking of a 1% payload of the 25M layer; int64 positions; and a
    # flat tensor past 2**31 elements
    run("zero_slots@25M", lambda: ops.zero_slots(
        torch.zeros(BIG), torch.zeros(BIG // 100, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32)))
    run("zero_slots-i64@25M", lambda: ops.zero_slots(
        torch.zeros(BIG), torch.zeros(BIG // 100, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int32)))
    run("zero_slots-meta-2^31+5", lambda: ops.zero_slots(
        torch.empty((1 << 31) + 5, device=torch.device("meta")),
        torch.empty(1000, dtype=torch.int64, device=torch.device("meta")),
        torch.empty(1, dtype=torch.int32, device=torch.device("meta"))))
    dtypes = [torch.float16, torch.bfloat16] if full else [torch.bfloat16]
    for dt in dtypes:
        run(f"TopK-grad-{dt}@25M",
            lambda dt=dt: hvdsparse.TopK(0.01).compress(
                "w", torch.zeros(5000, BIG // 5000, dtype=dt), 0))
    # the decoder: real messages made on the CPU path, decoded through the kernels
    for name, make in comps[:4]:
        def f(make=make):
            g = torch.Generator().manual_seed(1)
            os.environ["HVDSPARSE_FORCE_TRITON"] = "0"
            try:
                c = make()
                pay = [c.compress("a", torch.randn(3000, generator=g), 0),
                       c.compress("b", torch.randn(700, 40, generator=g), 0)]
                bufs = torch.stack([codec.encode(pay) for _ in range(3)])
            finally:
                os.environ["HVDSPARSE_FORCE_TRITON"] = "1"
            outs = [torch.zeros(p.numel) for p in pay]
            flag = torch.zeros(1, dtype=torch.int32)
            codec.accumulate(bufs, pay, outs, validate=False, error_flag=flag)
        run(f"accumulate-{name}", f)
    # TopK's bucket path (compressors/topk_bucket.py): a 25M layer, a sampled one and
    # an exact one in one table; momentum correction with Nesterov and weight decay
    def bucket(dt, mom):
        from hvdsparse.compressors import topk_bucket as TB
        c = hvdsparse.TopK(0.01, values="fp16" if dt == torch.float16 else "fp32")
        items, plans = [], []
        for n, shp in (("big", (5000, BIG // 5000)), ("mid", (350, 200)),
                       ("small", (40, 50))):
            g, p = torch.zeros(shp, dtype=dt), torch.zeros(shp, dtype=dt)
            spec = TB.MomentumSpec(torch.zeros(shp), 0.9, 0.0, True, 1e-4) if mom else None
            pl = TB.layer_plan(c, n, g, 0, p, spec)
            if pl is None:
                raise AssertionError(f"layer {n}: not taken by the bucket path")
            items.append(TB.BucketItem(n, g, p, torch.zeros(1, dtype=torch.int32), spec))
            plans.append(pl)
        _, batch = TB.compress_bucket(c, items, plans, 0, grad_scale=torch.ones(1))
        TB.mask_bucket(batch)
    run("bucket-TopK-fp32-mc@25M", lambda: bucket(torch.float32, True))
    run("bucket-TopK-fp16@25M", lambda: bucket(torch.float16, False))

    # Threshold between refreshes (ROUTE_GIVEN, the guard's overflow ladder): step 0 is
    # the per-layer refresh (its launches recorded too), step 1 the bucket path
    def bucket_threshold():
        from hvdsparse.compressors import topk_bucket as TB
        c = hvdsparse.Threshold(0.99, output_ratio=None)
        shp = (5000, BIG // 5000)
        c.compress("big", torch.randn(shp), 0)
        c.commit()
        g, p = torch.zeros(shp), torch.zeros(shp)
        spec = TB.MomentumSpec(torch.zeros(shp), 0.9, 0.0, False, 0.0)
        pl = TB.layer_plan(c, "big", g, 1, p, spec)
        if pl is None or pl["exact"] != 2:
            raise AssertionError("Threshold at step 1: not on the bucket path's given route")
        TB.compress_bucket(c, [TB.BucketItem("big", g, p, torch.zeros(1, dtype=torch.int32),
                                             spec)], [pl], 1)
    run("bucket-Threshold-mc@25M", bucket_threshold)

    def reached(*kernels):
        """The scenario launched these kernels (a library change that routes around
        them fails here, not silently)."""
        got = {r["kernel"] for r in RECORDS if r["scenario"] == _SCENARIO[0]}
        miss = sorted(set(kernels) - got)
        if miss:
            raise AssertionError(f"not launched: {miss} (launched: {sorted(got)})")

    # the bucket path for every compressor (compressors/bucket.py: plan_layer, group_key,
    # compress_bucket, mask_bucket, as the step engine calls them); outputs are never read
    def bucket_groups(comp, layers, expect, step=0, dtype=torch.float32, grad_scale=None,
                      pending=()):
        from hvdsparse.compressors import bucket as BK
        groups = {}
        for name, shp in layers:
            g, p = torch.zeros(shp, dtype=dtype), torch.zeros(shp, dtype=dtype)
            if name in pending:        # a residual left by take_back, flushed by the send
                comp.take_back(name, torch.ones(g.numel()))
            got = BK.plan_layer(comp, None, name, g, p, step)
            if got is None:
                raise AssertionError(f"layer {name} {shp}: not taken by the bucket path")
            spec, plan = got
            it = BK.BucketItem(name, g, p, torch.zeros(1, dtype=torch.int32), spec)
            its, pls = groups.setdefault(BK.group_key(plan, it), ([], []))
            its.append(it)
            pls.append(plan)
        for its, pls in groups.values():
            _, batch = BK.compress_bucket(comp, its, pls, step, grad_scale=grad_scale)
            BK.mask_bucket(batch)
        reached(*expect)

    big2 = (5000, BIG // 5000)
    # policy-dense rows (1-D layers): AMP's scale, a pending residual
    run("bucket-dense-fp32@25M", lambda: bucket_groups(
        hvdsparse.TopK(0.01), [("bias", (BIG,)), ("b", (300,))], ["_dense_copy_kernel"],
        grad_scale=torch.ones(1), pending=("b",)))
    run("bucket-dense-bf16@odd25M", lambda: bucket_groups(
        hvdsparse.QSGD(4), [("bias", (BIG - 1,))], ["_dense_copy_kernel"],
        dtype=torch.bfloat16))
    # whole rows (TopK's small layers on the Adam recipe's update wire): bf16 values of
    # an fp32 gradient with AMP's scale; fp16 values of a bf16 one; fp32 values

    def whole(values=None, **kw):
        comp = hvdsparse.TopK(0.01, values=values, **kw)
        comp.set_adam_update_wire(True)
        return comp
    run("bucket-whole-bf16@25M", lambda: bucket_groups(
        whole(), [("bias", (BIG,)), ("b", (300,))], ["_whole_cast_kernel"],
        grad_scale=torch.ones(1), pending=("b",)))
    run("bucket-whole-fp32", lambda: bucket_groups(
        whole(overrides={"b": dict(values="fp32")}), [("b", (300,))],
        ["_whole_cast_kernel"]))
    run("bucket-whole-fp16@odd25M", lambda: bucket_groups(
        whole("fp16"), [("bias", (BIG - 1,))], ["_whole_cast_kernel"],
        dtype=torch.bfloat16))
    # QSGD rows: one group per (bits, bucket size); rows with and without error feedback
    qsgd = [("QSGD-4", lambda: hvdsparse.QSGD(4, overrides={"s": dict(error_feedback=True)}))]
    if full:
        qsgd += [("QSGD-8-b100-ef", lambda: hvdsparse.QSGD(8, bucket_size=100,
                                                           error_feedback=True)),
                 ("QSGD-2-b1024", lambda: hvdsparse.QSGD(2, bucket_size=1024))]
    for name, make in qsgd:
        run(f"bucket-{name}@25M", lambda make=make: bucket_groups(
            make(), [("w", big2), ("s", (37, 50))], ["_qsgd_pack_kernel"],
            grad_scale=torch.ones(1)))
    # AdaComp rows: bins of 500 (int16 bin-relative slots) and of 50 (uint8, a conv)
    ada = ["_ada_accumulate_kernel", "_ada_count_kernel", "_ada_pack_kernel"]
    run("bucket-AdaComp@25M", lambda: bucket_groups(
        hvdsparse.AdaComp(), [("w", big2), ("s", (37, 50))], ada))
    run("bucket-AdaComp-conv@25M", lambda: bucket_groups(
        hvdsparse.AdaComp(), [("conv", (5000, 125, 40, 1))], ada))
    run("bucket-AdaComp-budget@25M", lambda: bucket_groups(
        hvdsparse.AdaComp(mean_per_bin=3), [("w", big2), ("s", (37, 50))],
        ada + ["_quota_table_kernel"]))
    if full:
        run("bucket-AdaComp-bf16-scaled@25M", lambda: bucket_groups(
            hvdsparse.AdaComp(), [("w", big2)], ada, dtype=torch.bfloat16,
            grad_scale=torch.ones(1)))
    # RandomK rows: own seeds (int32 indices) and shared seeds (int64 implicit indices too)
    run("bucket-RandomK@25M", lambda: bucket_groups(
        hvdsparse.RandomK(0.01, overrides={"s": dict(shared_seed=True)}),
        [("w", big2), ("s", (37, 50))], ["_accumulate_kernel", "_pick_kernel"]))
    if full:
        run("bucket-RandomK-bf16@25M", lambda: bucket_groups(
            hvdsparse.RandomK(0.01, values="bf16"), [("w", big2)], ["_pick_kernel"],
            dtype=torch.bfloat16))
    # Slim-DP rows: core gather (int64 core) and explorer draw (binary search over it)
    run("bucket-SlimDP@25M", lambda: bucket_groups(
        hvdsparse.SlimDP(0.02, 0.01), [("w", big2), ("s", (37, 50))],
        ["_accumulate_kernel", "_gather_kernel"], step=1))
    # Threshold's refresh step on the bucket path (ROUTE_FRESH: the radix select)
    run("bucket-Threshold-fresh@25M", lambda: bucket_groups(
        hvdsparse.Threshold(0.99, output_ratio=None), [("big", big2), ("mid", (350, 200))],
        ["_radix_hist_kernel", "_select_kernel"]))

    # the Adam recipe's update wire on the bucket path: the own-step launch, then TopK's
    # score rows (MODE_SCORE: the radix select of |acc + x|)
    def adam_update_wire():
        from hvdsparse.adam import AdamRecipe
        from hvdsparse.adam_bucket import OwnStepRow, own_steps
        from hvdsparse.compressors import bucket as BK
        p = torch.nn.Parameter(torch.zeros(big2))
        g = torch.zeros(big2)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
        opt.state[p].update(step=torch.tensor(3.0), exp_avg=torch.zeros(big2),
                            exp_avg_sq=torch.zeros(big2))
        rec = AdamRecipe(opt, {"w": p}, 1, lambda n: True, warmup=1, wire="update")
        made = rec.bucket_own_step("w", g, p.detach())
        if made is None:
            raise AssertionError("the update wire's step: not on the bucket path")
        nf = torch.zeros(1, dtype=torch.int32)
        x = own_steps(rec, [OwnStepRow("w", g, p.detach(), nf, made)], torch.ones(1))["w"]
        comp = hvdsparse.TopK(0.01, output_ratio=None)
        comp.set_adam_update_wire(True)
        got = BK.plan_layer(comp, None, "w", x, p.detach(), 1, clean_input=True)
        if got is None or not got[1].get("score"):
            raise AssertionError("TopK's score row: not on the bucket path")
        BK.compress_bucket(comp, [BK.BucketItem("w", x, p.detach(), nf, None)], [got[1]], 1)
        reached("_own_step_kernel", "_radix_hist_kernel", "_select_kernel")
    run("bucket-Adam-update-TopK-score@25M", adam_update_wire)

    def cpu_payloads(makers):
        """Real payloads made on the CPU path from ``[(make compressor, name, shape)]``
        (random gradients; zeros for the policy-dense 25M-element layer: only its layout
        matters, and random numbers cost seconds there)."""
        g = torch.Generator().manual_seed(2)
        os.environ["HVDSPARSE_FORCE_TRITON"] = "0"
        try:
            return [make().compress(name, torch.randn(shp, generator=g) if len(shp) > 1
                                    else torch.zeros(shp), 0)
                    for make, name, shp in makers]
        finally:
            os.environ["HVDSPARSE_FORCE_TRITON"] = "1"

    # the encoder's index narrowing (INT32 -> BIN_U16, kernels/bucket_narrow.py; one
    # program per segment, whatever the size): bin counts 4 bytes wide (two 65536-element
    # bins) and 2 bytes wide (one bin of < 65536)
    for values in (["fp32", "bf16", "fp16"] if full else ["fp32", "bf16"]):
        def f(values=values):
            pay = cpu_payloads([(lambda: hvdsparse.TopK(0.01, values=values), "big",
                                 (300, 400)),
                                (lambda: hvdsparse.TopK(0.01, values=values), "mid",
                                 (300, 200))])
            if not all(s.narrow_indices for p in pay for s in p.segments):
                raise AssertionError("TopK's segments are not marked for narrowing")
            codec.encode(pay)
            reached("_narrow_kernel")
        run(f"encode-narrow-{values}", f)

    # the table-driven bucket decode (codec.accumulate, validate=False, the outputs slices
    # of one flat tensor): DENSE (a 25M-element policy-dense layer: one program per 1024
    # slots; QSGD codes), BIN_U16 (narrowed TopK, fp32 and bf16 values), BIN_U8 / BIN_U16
    # with sign bits (AdaComp), IMPLICIT (RandomK). The messages are zeros of the right
    # length: nothing reads them.
    def accumulate_bucket(P=2):
        pay = cpu_payloads([
            (lambda: hvdsparse.TopK(0.01), "w", (300, 400)),
            (lambda: hvdsparse.TopK(0.01), "bias", (BIG,)),
            (lambda: hvdsparse.TopK(0.01, values="bf16"), "mid", (300, 200)),
            (lambda: hvdsparse.QSGD(4), "q", (700, 40)),
            (lambda: hvdsparse.AdaComp(), "a", (700, 40)),
            (lambda: hvdsparse.AdaComp(), "conv", (64, 32, 3, 3)),
            (lambda: hvdsparse.RandomK(0.01), "r", (700, 40))])
        bufs = torch.zeros(P, codec.encoded_nbytes(pay), dtype=torch.uint8)
        base = torch.zeros(sum(p.numel for p in pay))
        outs, o = [], 0
        for p in pay:
            outs.append(base[o:o + p.numel])
            o += p.numel
        codec.accumulate(bufs, pay, outs, validate=False,
                         error_flag=torch.zeros(1, dtype=torch.int32))
        reached("_check_kernel", "_scatter_kernel")
    run("accumulate-bucket@25M", accumulate_bucket)

    # the split exchange's phase-2 decode: sparse ranges (fp16 pairs: the shift, and
    # bf16 / fp32) and dense ranges of a 25M-element bucket at P = 3, in one launch each;
    # the messages are zeros of the right length (K = 0 reads nothing)
    def split_ranges(vdtype):
        from hvdsparse.exchange import split as SP
        from hvdsparse.exchange.base import BucketSpec, BufferPool, ExchangeContext
        P, vb = 3, torch.finfo(vdtype).bits // 8
        bounds = SP.range_bounds(BIG, P)
        lens = [SP.sparse_msg_nbytes(1000, vb), SP.sparse_msg_nbytes(0, vb),
                SP.dense_msg_nbytes(bounds[3] - bounds[2], 0, 512)]
        ctx = ExchangeContext(rank=0, world_size=P, prefix="c", validate=False,
                              buffers=BufferPool(),
                              error_flag=torch.zeros(1, dtype=torch.int32))
        SP.decode_ranges(torch.zeros(sum(lens), dtype=torch.uint8), lens, bounds,
                         BucketSpec.build(0, ["w"], [BIG]), ctx, vdtype, torch.device("cpu"))
        reached("_split_ranges_kernel")
    for vdtype in (torch.float16, torch.bfloat16, torch.float32):
        run(f"split-ranges-{str(vdtype)[6:]}", lambda vdtype=vdtype: split_ranges(vdtype))
    # DCT-MP row threshold
    for d in ((256, 4096) if full else (256,)):
        run(f"rowthreshold-d{d}",
            lambda d=d: hvdsparse.mp.row_threshold(torch.zeros(64, d), max(1, d // 10)))
    # ops directly: meta tensors past 2**31 elements and i32 products near the limit
    meta = torch.device("meta")
    huge = (1 << 31) + 5
    near = (1 << 31) - 64                       # i32 argument, n * bits overflows i32
    run("residual-meta-2^31+5-L512", lambda: ops.residual_add_binmax(
        torch.empty(huge, device=meta), torch.empty(huge, device=meta), 512))
    run("residual-meta-2^31+5-Ln", lambda: ops.residual_add_binmax(
        torch.empty(huge, device=meta), torch.empty(huge, device=meta), huge))
    run("quantize-meta-near-2^31", lambda: ops.quantize_pack(
        torch.empty(near, device=meta), 8, 512, 7))
    run("quantize-meta-2^31+5", lambda: ops.quantize_pack(
        torch.empty(huge, device=meta), 4, 512, 7))
    run("dequantize-meta-near-2^31", lambda: ops.dequantize_unpack(
        torch.empty(near, dtype=torch.uint8, device=meta),
        torch.empty(-(-near // 512), device=meta), 8, 512, near))
    run("scatter-int8-meta-cap-near-2^31", lambda: ops.scatter_add_decode(
        torch.empty(near, device=meta), torch.empty(1, near, dtype=torch.int32, device=meta),
        torch.empty(1, 1, dtype=torch.int32, device=meta),
        codes=torch.empty(1, near, dtype=torch.uint8, device=meta),
        scales=torch.empty(1, -(-near // 512), device=meta), bits=8, bucket_size=512,
        error_flag=torch.empty(1, dtype=torch.int32, device=meta)))
    run("philox-meta-2^31+5", lambda: ops.philox_uniform(3, huge, device=meta))

    def select_guard():
        try:
            ops.select_compact(torch.empty(huge, device=meta), 0.5, 1000)
        except ValueError as e:
            if "acc" not in str(e):
                raise AssertionError(f"select guard does not name acc: {e}")
            return
        raise AssertionError("select_compact accepted 2**31+5 elements (int32 indices)")
    run("select-guard-2^31+5", select_guard)


# ---------------------------------------------------------------------- compiling
def _bind(rec, target):
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    fn = rec["fn"]
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(rec["kwargs"])
    bound, spec, opts = binder(*rec["args"], **kwargs)
    kwargs.setdefault("debug", False)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return fn, options, signature, constexprs, attrs


def _int_params(fn, rec):
    """Names of ``fn``'s non-constexpr parameters that this launch passes a Python int
    (not a bool) and that the JIT specialises (not in ``do_not_specialize``)."""
    names = list(fn.signature.parameters)
    bound = dict(zip(names, rec["args"]))
    bound.update({k: v for k, v in rec["kwargs"].items() if k in names})
    out = []
    for kp in fn.params:
        v = bound.get(kp.name)
        if kp.is_constexpr or kp.do_not_specialize:
            continue
        if isinstance(v, int) and not isinstance(v, bool):
            out.append(kp.name)
    return out


def _forced(rec, value):
    """A copy of the launch record with every specialised integer argument set to
    ``value`` (grid and everything else unchanged), or None if it has none."""
    fn = rec["fn"]
    names = list(fn.signature.parameters)
    which = _int_params(fn, rec)
    if not which:
        return None
    args = list(rec["args"])
    kwargs = dict(rec["kwargs"])
    for name in which:
        i = names.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return dict(rec, args=tuple(args), kwargs=kwargs, forced=which)


def _ptxas_report(ptx: str, cc: int, fmad: bool, cache_dir: str):
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` (cached)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    arch = sm_arch_from_capability(cc)
    key = hashlib.sha256((ptx + arch + str(fmad)).encode()).hexdigest()
    path = os.path.join(cache_dir, "ptxas-v", key + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return tuple(json.load(f))
    with tempfile.TemporaryDirectory() as td:
        src = os.path.join(td, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(cc).path, "-lineinfo", *([] if fmad else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", src + ".o"]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    regs = max([int(x) for x in re.findall(r"Used (\d+) registers", log)] or [0])
    st = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    ld = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", log))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump([regs, st, ld], f)
    return regs, st, ld


_SEMS = (".relaxed", ".acquire", ".release", ".acq_rel", ".sc", ".mmio")


def _relaxed(atom: str) -> bool:
    """An ``atom`` / ``red`` instruction is relaxed: it says ``.relaxed``, or it is a
    shared-memory one with no ``.sem`` qualifier (PTX: an absent ``.sem`` means
    ``.relaxed``; Triton's block-local ``tl.histogram`` lowers to ``atom.shared.add``
    without one). A global atomic must say ``.relaxed`` (Triton's default is acq_rel)."""
    return ".relaxed" in atom or (".shared" in atom and not any(q in atom for q in _SEMS))


def _inspect(ptx: str, ttir: str) -> dict:
    atoms = re.findall(r"\b((?:atom|red)\.[\w.]+)", ptx)
    return dict(
        v4_loads=len(re.findall(r"\bld\.global(?:\.[\w]+)*\.v4\.", ptx)),
        scalar_loads=len(re.findall(r"\bld\.global(?:\.(?!v[24])[\w]+)*\s", ptx)),
        atomics=sorted(set(atoms)),
        nonrelaxed_atomics=sorted({a for a in atoms if not _relaxed(a)}),
        fences=sorted(set(re.findall(r"\b(fence\.[\w.]+|membar\.[\w.]+)", ptx))),
        fma_f32=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        # fp32 division that is not IEEE round-to-nearest (Triton's plain ``/`` may
        # lower to div.full.f32, ~2 ulp): the kernels whose math is exact use div_rn
        approx_div_f32=len(re.findall(r"\b(?:div\.(?:approx|full)(?:\.ftz)?\.f32|"
                                      r"rcp\.approx(?:\.ftz)?\.f32)\b", ptx)),
        i32_tensor_offsets=sorted(set(re.findall(
            r"tt\.addptr [^:]*: tensor<[0-9x]+x!tt\.ptr<\w+>>, tensor<[0-9x]+xi32>", ttir))),
    )


def _controls() -> dict:
    """Positive controls of the PTX inspection: a kernel with a plain fp32 ``/`` must be
    reported as approximate division (Triton lowers it to ``div.full.f32``), the same
    with ``tl.math.div_rn`` must not; an atomic add with Triton's default semantics
    (acq_rel) must be reported as not relaxed, one with ``sem="relaxed"`` and a
    ``tl.histogram`` (shared-memory atomics without a ``.sem``) must not. Proves the
    checks can fail."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def plain_div(x_ptr, y_ptr, o_ptr):
        tl.store(o_ptr, tl.load(x_ptr) / tl.load(y_ptr))

    @triton.jit
    def rn_div(x_ptr, y_ptr, o_ptr):
        tl.store(o_ptr, tl.math.div_rn(tl.load(x_ptr), tl.load(y_ptr)))

    @triton.jit
    def acq_rel_atomic(x_ptr, y_ptr, o_ptr):
        tl.atomic_add(o_ptr, tl.load(x_ptr))

    @triton.jit
    def relaxed_atomic(x_ptr, y_ptr, o_ptr):
        tl.atomic_add(o_ptr, tl.load(x_ptr), sem="relaxed")

    @triton.jit
    def histogram(x_ptr, y_ptr, o_ptr):
        b = tl.arange(0, 256)
        h = tl.histogram((tl.load(x_ptr + b).to(tl.int32, bitcast=True) >> 3) & 255, 256)
        tl.atomic_add(o_ptr + b, h.to(tl.float32), sem="relaxed")

    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "o_ptr": "*fp32"}
    out = {}
    for fn in (plain_div, rn_div):
        k = triton.compile(ASTSource(fn, sig, {}), target=GPUTarget("cuda", 80, 32))
        out[fn.__name__] = _inspect(k.asm["ptx"], k.asm["ttir"])["approx_div_f32"]
    for fn in (acq_rel_atomic, relaxed_atomic, histogram):
        k = triton.compile(ASTSource(fn, sig, {}), target=GPUTarget("cuda", 90, 32))
        got = _inspect(k.asm["ptx"], k.asm["ttir"])
        out[fn.__name__] = dict(atomics=got["atomics"], nonrelaxed=got["nonrelaxed_atomics"])
    return out


def compile_all(full: bool, ccs=(80, 90)) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    errors: list = []
    t0 = time.time()
    install_recorders()
    drive(full, errors)
    t_drive = time.time() - t0
    specs: "OrderedDict[tuple, dict]" = OrderedDict()
    launches = []
    for rec in RECORDS:
        launches.append(dict(kernel=rec["kernel"], scenario=rec["scenario"], grid=rec["grid"],
                             n=rec["n"]))
        for cc in ccs:
            target = GPUTarget("cuda", cc, 32)
            try:
                fn, options, signature, constexprs, attrs = _bind(rec, target)
            except Exception as e:
                errors.append(f"bind {rec['kernel']} ({rec['scenario']}): {e}")
                continue
            key = (rec["kernel"], cc, repr(sorted(signature.items())),
                   repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
                   repr(sorted((k, v) for k, v in options.__dict__.items()
                               if isinstance(v, (int, float, str, bool, type(None))))))
            if key in specs:
                specs[key]["scenarios"].add(rec["scenario"])
                continue
            specs[key] = dict(kernel=rec["kernel"], cc=cc, signature=signature,
                              constexprs={str(k): v for k, v in constexprs.items()},
                              scenarios={rec["scenario"]}, fn=fn, options=options,
                              raw=(signature, constexprs, attrs))
    cache = os.environ["TRITON_CACHE_DIR"]
    out = []
    for key, s in specs.items():
        signature, constexprs, attrs = s["raw"]
        row = dict(kernel=s["kernel"], cc=s["cc"], scenarios=sorted(s["scenarios"]),
                   signature=s["signature"], constexprs=s["constexprs"],
                   enable_fp_fusion=s["options"].enable_fp_fusion,
                   num_warps=s["options"].num_warps)
        t = time.time()
        try:
            k = triton.compile(ASTSource(s["fn"], signature, constexprs, attrs),
                               target=GPUTarget("cuda", s["cc"], 32),
                               options=s["options"].__dict__)
            row.update(ok=True, **_inspect(k.asm["ptx"], k.asm["ttir"]))
            regs, st, ld = _ptxas_report(k.asm["ptx"], s["cc"], s["options"].enable_fp_fusion,
                                         cache)
            row.update(registers=regs, spill_store_bytes=st, spill_load_bytes=ld)
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
        row["seconds"] = round(time.time() - t, 2)
        out.append(row)
    # every kernel once with its integer arguments forced to 1 and to 16 (sm_90)
    forced, seen = [], set()
    target = GPUTarget("cuda", 90, 32)
    for rec in RECORDS:
        if rec["kernel"] in seen:
            continue
        seen.add(rec["kernel"])
        for value in (1, 16):
            frec = _forced(rec, value)
            if frec is None:
                continue
            row = dict(kernel=rec["kernel"], cc=90, value=value, args=frec["forced"],
                       scenario=rec["scenario"])
            t = time.time()
            try:
                fn, options, signature, constexprs, attrs = _bind(frec, target)
                row["constexprs"] = sorted(str(k) for k in constexprs)
                triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                               options=options.__dict__)
                row["ok"] = True
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
            row["seconds"] = round(time.time() - t, 2)
            forced.append(row)
    return dict(full=full, triton=triton.__version__, torch=torch.__version__,
                ccs=sorted(ccs),
                drive_seconds=round(t_drive, 1), total_seconds=round(time.time() - t0, 1),
                errors=errors, launches=launches, specializations=out, forced=forced,
                controls=_controls(),
                streaming=sorted(STREAMING), vector_loads=sorted(VECTOR_LOADS),
                no_fma=sorted(NO_FMA), exact_div=sorted(EXACT_DIV),
                table_streaming=sorted(TABLE_STREAMING), kernels=[k for _, k in KERNELS],
                big=BIG)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--full", action="store_true",
                    default=os.environ.get("HVDSPARSE_COMPILE_FULL", "") == "1")
    ap.add_argument("--cc", type=int, action="append", choices=(80, 90),
                    help="compute capability to compile for (repeatable; default 80 and 90)")
    a = ap.parse_args()
    rep = compile_all(a.full, tuple(a.cc or (80, 90)))
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=1, default=str)
    bad = [r for r in rep["specializations"] if not r["ok"]]
    fbad = [r for r in rep["forced"] if not r["ok"]]
    print(f"Triton {rep['triton']}, torch {rep['torch']}, sm_{rep['ccs']}: "
          f"{len(rep['launches'])} launches, {len(rep['specializations'])} specialisations "
          f"compiled ({len(bad)} failed), {len(rep['forced'])} forced-integer variants "
          f"({len(fbad)} failed) in {rep['total_seconds']} s; "
          f"{len(rep['errors'])} scenario errors")
    for r in fbad:
        print(f"  FORCED {r['kernel']} {r['args']}={r['value']}: {r['error'][-300:]}")
    for r in rep["specializations"]:
        print(f"  {r['kernel']:<24} sm_{r['cc']} ok={r['ok']} regs={r.get('registers')} "
              f"spills={r.get('spill_store_bytes')}/{r.get('spill_load_bytes')} "
              f"v4={r.get('v4_loads')} fma={r.get('fma_f32')} {r['seconds']}s "
              f"{','.join(r['scenarios'])[:60]}")
    for e in rep["errors"]:
        print("ERROR", e)


if __name__ == "__main__":
    main()
