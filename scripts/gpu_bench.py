"""GPU benchmarks and a short training run for ``scripts/gpu_check.sh`` (CUDA only).

1. Every kernel (through ``hvdsparse.ops`` on CUDA tensors) timed with
   ``triton.testing.do_bench`` (median) at 1M and 25M elements, fp32 and bf16
   gradients, against a device-to-device copy of the same number of bytes (the bytes
   the kernel must at least read plus write). ``frac_of_copy = t_copy / t_kernel``;
   target >= 0.7 at 25M for the streaming kernels.
2. ``TopK(0.01).compress`` of a 25M-element layer (5000 x 5000) against one read + one
   write of the gradient (a copy of it); target <= 3x.
3. A few training steps of a small MLP on CUDA at world size 1 through
   ``hvdsparse.compressors`` + ``codec`` (encode, ``accumulate(validate=False)``), for
   TopK, AdaComp and QSGD: the loss must fall, the device error flag stay 0, and the
   CUDA decode of each step's message must equal the CPU decode (validate=True) bit
   for bit. No Horovod is imported.
4. A CUDA-graph probe (``graph_rows``): one bucket's compress + encode + decode timed
   eager and as one captured graph's replay, per compressor, or the capture's error.

Writes ``gpu_bench.json`` and ``gpu_bench.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def bench(fn, warmup=25, rep=100):
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_ms(nbytes: int, dev) -> float:
    """Median time of a device-to-device copy moving ``nbytes`` (read + write)."""
    half = max(1, nbytes // 2)
    a = torch.empty(half, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return bench(lambda: b.copy_(a))


def kernel_rows(dev):
    from hvdsparse import ops
    rows = []
    for n in (1 << 20, 25_000_000):
        for gdt in (torch.float32, torch.bfloat16):
            gs = torch.tensor([], dtype=gdt).element_size()
            g = torch.randn(n, device=dev).to(gdt)
            r = torch.randn(n, device=dev)
            gsc = torch.tensor([0.5], device=dev)
            nf = torch.zeros(1, dtype=torch.int32, device=dev)
            cases = [
                ("residual_add_binmax L=n (flat)", lambda: ops.residual_add_binmax(g, r, n),
                 n * (gs + 8)),
                ("residual_add_binmax L=n +scale+nonfinite",
                 lambda: ops.residual_add_binmax(g, r, n, grad_scale=gsc, nonfinite=nf),
                 n * (gs + 8)),
                ("residual_add_binmax L=512 (tile)",
                 lambda: ops.residual_add_binmax(g, r, 512), n * (gs + 8) + 4 * (n // 512)),
                ("residual_add_binmax L=50 (tile)",
                 lambda: ops.residual_add_binmax(g, r, 50), n * (gs + 8) + 4 * (n // 50)),
            ]
            if gdt == torch.float32:
                acc = torch.randn(n, device=dev)
                thr = torch.tensor(2.576, device=dev)          # ~1% of N(0,1)
                cap = n // 50
                out = (torch.empty(cap, dtype=torch.int32, device=dev),
                       torch.empty(cap, device=dev), torch.empty(2, dtype=torch.int32, device=dev))
                v = torch.randn(n, device=dev)
                codes, scales = ops.quantize_pack(v, 4, 512, 1)
                P, k = 4, n // 100
                idx = torch.stack([torch.randperm(n, device=dev)[:k] for _ in range(P)]).int()
                vals = torch.randn(P, k, device=dev)
                cnt = torch.full((P, 1), k, dtype=torch.int32, device=dev)
                dense = torch.zeros(n, device=dev)
                flag = torch.zeros(1, dtype=torch.int32, device=dev)
                bits8 = torch.randint(0, 256, (n // 8,), dtype=torch.uint8, device=dev)
                one = torch.tensor(0.5, device=dev)
                cases += [
                    ("select_compact ~1% fp32 (after 1st call: 0 selected)",
                     lambda: ops.select_compact(acc, thr, cap, out=out), 4 * n),
                    ("quantize_pack 4-bit bucket 512", lambda: ops.quantize_pack(v, 4, 512, 1),
                     4 * n + n // 2 + 4 * (n // 512)),
                    ("dequantize_unpack 4-bit", lambda: ops.dequantize_unpack(codes, scales, 4,
                                                                           512, n),
                     n // 2 + 4 * n + 4 * (n // 512)),
                    ("sign_unpack", lambda: ops.sign_unpack(bits8, one, n), n // 8 + 4 * n),
                    ("philox_uniform", lambda: ops.philox_uniform(3, n, device=dev), 4 * n),
                    ("scatter_add_decode P=4 x 1% fp32 (random RMW)",
                     lambda: ops.scatter_add_decode(dense, idx, cnt, vals, error_flag=flag),
                     P * k * (4 + 4 + 8)),
                ]
            for name, fn, nbytes in cases:
                t = bench(fn)
                tc = copy_ms(nbytes, dev)
                rows.append(dict(kernel=name, n=n, grad_dtype=str(gdt).replace("torch.", ""),
                                 ms=round(t, 4), copy_ms=round(tc, 4), bytes=int(nbytes),
                                 gbps=round(nbytes / t / 1e6, 1),
                                 frac_of_copy=round(tc / t, 3)))
                print(f"{name:<52} n={n:>9} {rows[-1]['grad_dtype']:<8} {t:8.4f} ms "
                      f"copy {tc:8.4f} ms  {rows[-1]['frac_of_copy']:.2f} of copy", flush=True)
            del g, r
            torch.cuda.empty_cache()
    return rows


def topk_rows(dev):
    import hvdsparse
    rows = []
    for gdt in (torch.float32, torch.bfloat16):
        g = torch.randn(5000, 5000, device=dev).to(gdt)
        c = hvdsparse.TopK(0.01)
        step = [0]

        def f():
            c.compress("w", g, step[0])
            step[0] += 1
        for _ in range(3):
            f()
        t = bench(f, warmup=5, rep=200)
        gb = g.numel() * g.element_size()
        tc = copy_ms(2 * gb, dev)              # one read + one write of the gradient
        rows.append(dict(what="TopK(0.01).compress 5000x5000", grad_dtype=str(gdt)[6:],
                         ms=round(t, 4), read_write_ms=round(tc, 4),
                         ratio=round(t / tc, 2)))
        print(f"TopK compress 25M {gdt}: {t:.3f} ms vs read+write {tc:.3f} ms "
              f"= {t / tc:.2f}x", flush=True)
    return rows


def train_rows(dev, steps=60):
    import hvdsparse
    from hvdsparse import codec
    rows = []
    for name, make in (("TopK(0.05)", lambda: hvdsparse.TopK(0.05)),
                       ("AdaComp()", lambda: hvdsparse.AdaComp()),
                       ("QSGD(4)", lambda: hvdsparse.QSGD(4))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        comp = make()
        X = torch.randn(4096, 256, device=dev)
        W = torch.randn(256, 10, device=dev)
        y = (X @ W).argmax(1)
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        losses, mismatches = [], 0
        t0 = time.time()
        for step in range(steps):
            i = torch.randint(0, 4096, (256,), device=dev)
            loss = torch.nn.functional.cross_entropy(model(X[i]), y[i])
            opt.zero_grad()
            loss.backward()
            names = [n for n, _ in model.named_parameters()]
            params = [p for _, p in model.named_parameters()]
            pays = [comp.compress(n, p.grad, step) for n, p in zip(names, params)]
            buf = codec.encode(pays)
            outs = [torch.zeros(p.numel(), device=dev) for p in params]
            codec.accumulate(buf.unsqueeze(0), pays, outs, validate=False, error_flag=flag)
            if step % 10 == 0:          # CUDA decode == CPU decode, bit for bit
                cpu_outs = [torch.zeros(p.numel()) for p in params]
                pays_cpu = [_to_cpu(p) for p in pays]
                codec.accumulate(buf.unsqueeze(0).cpu(), pays_cpu, cpu_outs, validate=True)
                for a, b in zip(outs, cpu_outs):
                    if not torch.equal(a.cpu().view(torch.int32), b.view(torch.int32)):
                        mismatches += 1
            for p, o in zip(params, outs):
                p.grad.copy_(o.view_as(p))
            opt.step()
            losses.append(loss.detach())
        torch.cuda.synchronize()
        ls = [float(x) for x in torch.stack(losses).cpu()]
        rows.append(dict(compressor=name, steps=steps, loss_first=round(ls[0], 4),
                         loss_last=round(ls[-1], 4), error_flag=int(flag.item()),
                         gpu_vs_cpu_decode_mismatches=mismatches,
                         seconds=round(time.time() - t0, 2)))
        print(rows[-1], flush=True)
    return rows


# One DDP-sized bucket of ResNet-50's layer-3/4 shapes (~6.4M elements, ~25 MB fp32).
PROBE_SHAPES = [(1024, 256, 1, 1), (1024,), (256, 1024, 1, 1), (256,), (256, 256, 3, 3),
                (256,), (512, 1024, 1, 1), (512,), (512, 512, 3, 3), (512,),
                (2048, 512, 1, 1), (2048,), (2048, 1024, 1, 1), (2048,)]


def graph_rows(dev, probe_step=5):
    """CUDA-graph probe of one bucket's device work: the step engine's
    ``compress_group`` (residual add, selection, packing) + ``codec.encode`` +
    ``codec.accumulate(validate=False)`` of the encoded message into dense outputs, on
    ``PROBE_SHAPES``, timed eager and, if ``torch.cuda.graph`` captures it, as one graph
    replay. The captured step number is frozen into the graph (a steady-state step: no
    refresh), so the replay is a measure of what capturing would save, not a training
    path. A capture that fails reports its error (what blocks capture today).
    ``host_ms``: host wall time of each phase of the eager region (the device queue not
    waited for), and for some compressors a ``cProfile`` of 20 eager regions (the
    Python functions that cost the host most)."""
    import hvdsparse
    from hvdsparse import codec
    from hvdsparse.engine import LayerInput, StepEngine
    from hvdsparse.settings import ExchangeSettings
    rows = []
    for name, make, profile_host in (("TopK(0.01)", lambda: hvdsparse.TopK(0.01), True),
                                     ("Threshold(0.99)", lambda: hvdsparse.Threshold(0.99),
                                      False),
                                     ("QSGD(4)", lambda: hvdsparse.QSGD(4), True),
                                     ("AdaComp()", lambda: hvdsparse.AdaComp(), True)):
        row = dict(compressor=name, layers=len(PROBE_SHAPES),
                   numel=sum(int(torch.Size(s).numel()) for s in PROBE_SHAPES))
        try:
            eng = StepEngine(make(), ExchangeSettings(), None, rank=0, world_size=1,
                             prefix="probe")
            torch.manual_seed(0)
            params = [torch.randn(s, device=dev) for s in PROBE_SHAPES]
            grads = [torch.randn(s, device=dev) for s in PROBE_SHAPES]
            # views of one flat buffer, as the exchanges pass them (the bucket decode)
            flat = torch.empty(sum(p.numel() for p in params), device=dev)
            outs = list(flat.split([p.numel() for p in params]))
            flag = torch.zeros(1, dtype=torch.int32, device=dev)

            phase_s = {"step": 0.0, "compress": 0.0, "encode": 0.0, "decode": 0.0}

            def region(step, timed=False):
                # begin_step / commit bracket a step as in the doors (once per step there,
                # here once per one-bucket step: timed apart as "step")
                ts = time.perf_counter()
                eng.begin_step(step)
                t0 = time.perf_counter()
                layers = [LayerInput(f"l{i}", g, p) for i, (g, p) in
                          enumerate(zip(grads, params))]
                pays = eng.compress_group(layers, step)
                t1 = time.perf_counter()
                buf = codec.encode(pays)
                t2 = time.perf_counter()
                flat.zero_()
                codec.accumulate(buf.unsqueeze(0), pays, outs, validate=False,
                                 error_flag=flag)
                t3 = time.perf_counter()
                eng.commit()
                if timed:
                    phase_s["step"] += time.perf_counter() - t3 + t0 - ts
                    phase_s["compress"] += t1 - t0
                    phase_s["encode"] += t2 - t1
                    phase_s["decode"] += t3 - t2
            for s in range(probe_step):
                region(s)
            torch.cuda.synchronize()
            row["eager_ms"] = round(bench(lambda: region(probe_step), warmup=3, rep=50), 4)
            # host time per phase (the device queue is not waited for: host cost only)
            reps = 20
            for _ in range(reps):
                region(probe_step, timed=True)
            torch.cuda.synchronize()
            row["host_ms"] = {k: round(v * 1e3 / reps, 3) for k, v in phase_s.items()}
            if profile_host:
                import cProfile
                import io
                import pstats
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(reps):
                    region(probe_step)
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                row["host_profile"] = text.getvalue()[-6000:]
                print(row["host_profile"], flush=True)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    region(probe_step)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    region(probe_step)
            except Exception as e:
                row["capture_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.synchronize()
                rows.append(row)
                print(row, flush=True)
                continue
            graph.replay()
            torch.cuda.synchronize()
            row["replay_ms"] = round(bench(graph.replay, warmup=3, rep=50), 4)
            row["replay_over_eager"] = round(row["replay_ms"] / row["eager_ms"], 3)
            row["outputs_finite"] = bool(all(torch.isfinite(o).all() for o in outs))
            row["error_flag"] = int(flag.item())
        except Exception as e:  # the probe must not stop the report
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def _to_cpu(payload):
    import copy
    p = copy.copy(payload)
    segs = []
    for s in payload.segments:
        s2 = copy.copy(s)
        for f in ("count", "values", "indices", "scales", "bin_counts", "implicit_indices"):
            v = getattr(s, f, None)
            if isinstance(v, torch.Tensor):
                setattr(s2, f, v.cpu())
        segs.append(s2)
    p.segments = segs
    if isinstance(getattr(payload, "nonfinite", None), torch.Tensor):
        p.nonfinite = payload.nonfinite.cpu()
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    import triton
    rep = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
               triton=triton.__version__)
    for key, f in (("kernels", kernel_rows), ("topk", topk_rows), ("training", train_rows),
                   ("graph", graph_rows)):
        try:
            rep[key] = f(dev)
        except Exception as e:  # keep the other sections
            import traceback
            traceback.print_exc()
            rep[key + "_error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(a.out, "gpu_bench.json"), "w") as f:
        json.dump(rep, f, indent=1)
    md = [f"GPU check on {rep['device']} (torch {rep['torch']}, triton {rep['triton']})", "",
          "| kernel | n | grad | ms | copy ms | GB/s | frac of copy |", "|---|---|---|---|---|---|---|"]
    for r in rep.get("kernels", []):
        md.append(f"| {r['kernel']} | {r['n']} | {r['grad_dtype']} | {r['ms']} | {r['copy_ms']} "
                  f"| {r['gbps']} | {r['frac_of_copy']} |")
    md += ["", "| TopK compress 25M | grad | ms | read+write ms | ratio |", "|---|---|---|---|---|"]
    for r in rep.get("topk", []):
        md.append(f"| {r['what']} | {r['grad_dtype']} | {r['ms']} | {r['read_write_ms']} | "
                  f"{r['ratio']} |")
    md += ["", "| training (world size 1) | steps | loss first | loss last | error flag | "
           "GPU vs CPU decode mismatches |", "|---|---|---|---|---|---|"]
    for r in rep.get("training", []):
        md.append(f"| {r['compressor']} | {r['steps']} | {r['loss_first']} | {r['loss_last']} "
                  f"| {r['error_flag']} | {r['gpu_vs_cpu_decode_mismatches']} |")
    md += ["", "| CUDA-graph probe (one bucket) | eager ms | host ms step / compress / encode / "
           "decode | replay ms | replay / eager | capture error |",
           "|---|---|---|---|---|---|"]
    for r in rep.get("graph", []):
        h = r.get("host_ms") or {}
        md.append(f"| {r['compressor']} | {r.get('eager_ms')} | {h.get('step')} / {h.get('compress')} / "
                  f"{h.get('encode')} / {h.get('decode')} | {r.get('replay_ms')} | "
                  f"{r.get('replay_over_eager')} | {r.get('capture_error', r.get('error', ''))} |")
    for k in ("kernels_error", "topk_error", "training_error", "graph_error"):
        if k in rep:
            md.append(f"\n{k}: {rep[k]}")
    with open(os.path.join(a.out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
