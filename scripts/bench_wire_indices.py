"""Encode / decode cost of the wire's index narrowing on the CPU, side by side in one run.

Not a network measurement (``scripts/bench_network.py`` makes those): one process, one
thread, the TopK 1% payloads of the per-node benchmark's 4.35 M-parameter MLP (784-2048-
2048-10) as one bucket. Per repetition, narrowed and int32 indices alternate
(``hvdsparse.payload.NARROW_INDICES`` switched in-process), for ``codec.encode`` into a
reused buffer and for the validated ``codec.accumulate`` of P copies of the message.
Prints a table (medians, ms) and saves JSON.

    .venv/bin/python scripts/bench_wire_indices.py --out results/bench_wire_indices.json
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hvdsparse
from hvdsparse import codec, payload

SHAPES = [("0.weight", (2048, 784)), ("2.weight", (2048, 2048)), ("4.weight", (10, 2048))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--np", type=int, default=4, help="messages decoded (ranks)")
    ap.add_argument("--out", default="results/bench_wire_indices.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    comp = hvdsparse.TopK(0.01, seed=1)
    comp.register_layers(SHAPES)
    comp.bind(0, a.np)
    comp.begin_step(0)
    pls = [comp.compress(n, torch.randn(s), 0) for n, s in SHAPES]
    modes = {"narrowed": True, "int32": False}
    bufs, enc, dec = {}, {m: [] for m in modes}, {m: [] for m in modes}
    for m, flag in modes.items():
        payload.NARROW_INDICES = flag
        bufs[m] = codec.new_message(pls)
    for _ in range(a.reps):
        for m, flag in modes.items():
            payload.NARROW_INDICES = flag
            t = time.perf_counter()
            codec.encode(pls, out=bufs[m])
            enc[m].append(time.perf_counter() - t)
    for _ in range(a.reps):
        for m, flag in modes.items():
            payload.NARROW_INDICES = flag
            rows = torch.stack([bufs[m]] * a.np)
            outs = [torch.zeros(p.numel) for p in pls]
            t = time.perf_counter()
            codec.accumulate(rows, pls, outs, validate=True)
            dec[m].append(time.perf_counter() - t)
    payload.NARROW_INDICES = True
    res = {m: dict(message_bytes=int(bufs[m].numel()),
                   encode_ms=statistics.median(enc[m]) * 1e3,
                   accumulate_ms=statistics.median(dec[m]) * 1e3) for m in modes}
    print(f"TopK 1% bucket of a 4.35 M-parameter MLP, {a.reps} interleaved repetitions, "
          f"1 thread, validated decode of {a.np} messages")
    print("| indices | message bytes | encode ms | accumulate ms |")
    print("|---|---:|---:|---:|")
    for m, r in res.items():
        print(f"| {m} | {r['message_bytes']} | {r['encode_ms']:.3f} | {r['accumulate_ms']:.3f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(reps=a.reps, np=a.np, results=res), indent=1))


if __name__ == "__main__":
    main()
