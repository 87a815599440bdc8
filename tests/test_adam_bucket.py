"""The Adam recipe's update wire on the bucket path (``hvdsparse/adam_bucket.py``,
``kernels/bucket_adam.py``; TopK's and Threshold's ``fresh_weight`` score rows in
``kernels/bucket_topk.py``) gives the per-layer path's bits, through the step engine's
``compress_group`` with the bucket path on and off: every payload segment, residual,
non-finite count, statistic and Adam's new moments, for every compressor, fp32 and bf16
gradients, AMP's inverse loss scale, Adam's coupled weight decay and ``maximize``,
non-finite gradient elements, over several steps (residuals carried), on fresh random
data each run, through Triton's interpreter with ``HVDSPARSE_FORCE_TRITON=1``. The
launches of a step do not grow with the number of layers on the bucket path.
"""
import os

import pytest
import torch

from hvdsparse.adam import AdamRecipe
from hvdsparse.compressors import QSGD, AdaComp, RandomK, SlimDP, Threshold, TopK
from hvdsparse.engine import LayerInput, StepEngine
from hvdsparse.settings import ExchangeSettings

from test_bucket_compress import LAYERS, Launches, _same, _snapshot, _bits  # noqa: E402

DEV = torch.device(os.environ.get("HVDSPARSE_TEST_DEVICE", "cpu"))


def _comp(kind, seed):
    s = seed % 1000
    if kind == "topk":           # the default score, one layer at w = 0.3, one at 0
        return TopK(0.05, output_ratio=None, seed=s,
                    overrides={"w2": dict(fresh_weight=0.3), "w4": dict(fresh_weight=0)})
    if kind == "threshold":      # the default score, one layer at w = 0.5, one at 0
        return Threshold(0.97, life_span=2, output_ratio=None, seed=s,
                         overrides={"w2": dict(fresh_weight=0.5), "w4": dict(fresh_weight=0)})
    if kind == "adacomp":
        return AdaComp(seed=s, overrides={"w4": dict(bin_size=300, max_per_bin=3)})
    if kind == "qsgd":
        return QSGD(4, bucket_size=256, seed=s)
    if kind == "randomk":
        return RandomK(0.05, seed=s, overrides={"w2": dict(shared_seed=True)})
    return SlimDP(0.3, 0.1, core_period=3, seed=s)


def _setup(kind, layers, seed, gdt, coupled, ties=False):
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(DEV, gdt))
              for n, s in layers}
    names = [n for n, _ in layers]
    if coupled:     # Adam's L2 weight decay, maximize, in one group; AdamW in the other
        opt = torch.optim.Adam([dict(params=[params[n] for n in names[:4]], lr=3e-3,
                                     weight_decay=1e-2, maximize=True),
                                dict(params=[params[n] for n in names[4:]], lr=1e-3)],
                               betas=(0.8, 0.99))
    else:
        opt = torch.optim.AdamW([params[n] for n in names], lr=2e-3, weight_decay=0.01)
    for n in names:     # past the warm-up: fp32 moments (a bf16 model's too, here)
        st = opt.state[params[n]]
        st["step"] = torch.tensor(3.0)
        st["exp_avg"] = (torch.randn(params[n].shape, generator=g) * 1e-2).to(DEV)
        st["exp_avg_sq"] = (torch.rand(params[n].shape, generator=g) * 1e-4).to(DEV)
    if ties:        # zero moments: |x| = lr * (1 - b1) / (sqrt(1 - b2) ...) almost everywhere,
        # so the k-th score of w1 ties with hundreds of others at the first step
        for key in ("exp_avg", "exp_avg_sq"):
            opt.state[params["w1"]][key].zero_()
    comp = _comp(kind, seed)
    comp.register_layers([(n, params[n].shape) for n in names])
    comp.set_adam_update_wire(True)
    recipe = AdamRecipe(opt, params, 1, lambda n: not comp.policy.is_dense(
        n, params[n].shape), warmup=1, wire="update")
    eng = StepEngine(comp, ExchangeSettings(), None, rank=0, world_size=1, prefix="t",
                     local_update=recipe)
    return params, opt, comp, recipe, eng


def _grads(layers, gdt, step, seed):
    g = torch.Generator().manual_seed(1000 * seed + step)
    out = {n: (torch.randn(s, generator=g) * torch.exp(torch.randn(s, generator=g))
               ).to(DEV, gdt) for n, s in layers}
    out["w2"].view(-1)[5] = float("nan")
    out["w2"].view(-1)[2000] = float("-inf")
    out["bn.bias"].view(-1)[3] = float("inf")
    return out


def _commit(opt, params, recipe):
    """What ``step()`` does to the moments (the parameters are left as they are)."""
    for n, (m, v) in list(recipe._moments.items()):
        st = opt.state[params[n]]
        st["exp_avg"].copy_(m)
        st["exp_avg_sq"].copy_(v)
        st["step"] += 1
        recipe._steps[n] += 1
    recipe._moments.clear()


def _run(bucket_on, kind, layers, seed, gdt, scale, coupled, steps=3, counter=None,
         ties=False):
    params, opt, comp, recipe, eng = _setup(kind, layers, seed, gdt, coupled, ties)
    eng.bucket_path = eng.bucket_path and bucket_on
    if scale is not None:
        inv = torch.tensor([scale], dtype=torch.float32, device=DEV)
        eng.grad_scale = lambda device: inv
    names = [n for n, _ in layers]
    hist = []
    for step in range(steps):
        grads = _grads(layers, gdt, step, seed)
        eng.begin_step(step)
        nfs = {n: torch.zeros(1, dtype=torch.int32, device=DEV) for n in names}
        ins = [LayerInput(n, grads[n], params[n], nfs[n]) for n in names]
        if counter is not None and step == steps - 1:
            counter.__enter__()
        pays = eng.compress_group(ins, step, [])
        if counter is not None and step == steps - 1:
            counter.__exit__(None, None, None)
        snap = _snapshot(comp, None, dict(zip(names, pays)), nfs)
        snap["moments"] = {n: (_bits(m), _bits(v)) for n, (m, v) in recipe._moments.items()}
        hist.append(snap)
        _commit(opt, params, recipe)
    return hist


@pytest.mark.parametrize("kind,gdt,scale,coupled,ties", [
    ("topk", torch.float32, None, False, False),
    ("topk", torch.float32, 0.5, True, False),
    ("topk", torch.bfloat16, 0.25, False, False),
    ("topk", torch.float32, None, False, True),
    ("threshold", torch.float32, 0.5, False, False),
    ("threshold", torch.bfloat16, None, True, False),
    ("adacomp", torch.float32, None, True, False),
    ("qsgd", torch.bfloat16, None, False, False),
    ("randomk", torch.float32, 0.5, False, False),
    ("slimdp", torch.float32, None, True, False),
])
def test_update_wire_bucket_matches_per_layer(monkeypatch, kind, gdt, scale, coupled, ties):
    if DEV.type != "cpu" and ties:
        pytest.skip("which of the scores equal to the k-th are sent follows the GPU's "
                    "block order (kernels/bucket_topk.py); checked through the interpreter")
    if DEV.type == "cpu":
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref = _run(False, kind, LAYERS, seed, gdt, scale, coupled, ties=ties)
    got = _run(True, kind, LAYERS, seed, gdt, scale, coupled, ties=ties)
    if ties:        # the case is what it says: the k-th score of w1 ties at step 0
        seg = ref[0]["segs"]["w1"][0]
        assert seg["count"] == seg["cap"], seg["count"]
    # the layers on the update wire: TopK (bf16 values) sends its biases, norms and
    # small layers whole (compressors/policy.py), the others send them exact
    compressed = [n for n, s in LAYERS if kind == "topk" or torch.Size(s).numel() >= 1024]
    for step, (a, b) in enumerate(zip(ref, got)):
        assert set(a["moments"]) == set(compressed), (step, sorted(a["moments"]))
        assert a["nf"]["w2"] == 2 and a["nf"]["bn.bias"] == 1, a["nf"]
        _same(a, b, f"seed {seed} {kind} step {step}")


def test_update_wire_launches_do_not_grow_with_layers(monkeypatch):
    """The bucket path's launches for a step of TopK's default score rows (and the
    rows of the layers it sends whole) are the same for a bucket of 8 layers and one
    of 16."""
    if DEV.type == "cpu":
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    twice = LAYERS + [(n + ".b", s) for n, s in LAYERS]
    counts = []
    for layers in (LAYERS, twice):
        c = Launches(monkeypatch)
        _run(True, "topk", layers, seed, torch.float32, 0.5, False, steps=2, counter=c)
        counts.append((c.total(), dict(c.triton)))
    assert counts[0] == counts[1], counts
    tri = counts[0][1]
    # one own-step launch; the score's radix select, no per-layer kernel
    assert tri.get("_own_step_kernel") == 1 and tri.get("_radix_hist_kernel") == 4, tri
    assert tri.get("_whole_cast_kernel") == 1 and "_dense_copy_kernel" not in tri, tri
    assert not {"_clean_kernel", "_residual_tile_kernel", "_residual_flat_kernel"} & set(tri)
