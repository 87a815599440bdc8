"""Real ``horovodrun -np 2`` (Gloo, localhost): allgather encoded messages (equal and
unequal lengths), decode, accumulate, compare with a numpy reference of all ranks' raw
data; then every exchange strategy (allgather, split with fp32 / quantised / fp16
ranges, dense fp32 / fp16) through ``exchange.launch`` + ``finish`` against the same
reference, bitwise identical across ranks, with reused buffers and device-side figures. All checks live in one worker run (tests/workers/allgather_worker.py, see its
docstring) because each launch costs ~9 s."""
from pathlib import Path

import pytest

from tests.hvdrun import run_horovod

pytest.importorskip("horovod.torch", reason="Horovod not installed: run scripts/setup_env.sh")

WORKER = Path(__file__).resolve().parent / "workers" / "allgather_worker.py"


def test_allgather_encode_decode_accumulate_np2():
    out = run_horovod(WORKER, np=2, timeout=240)
    for r in range(2):
        assert f"rank {r}: message 1 ok" in out, out[-3000:]
        assert f"rank {r}: message 2 ok" in out, out[-3000:]
        assert f"rank {r}: strategies ok" in out, out[-3000:]
        assert f"rank {r}: split trusted flag ok" in out, out[-3000:]
        assert f"rank {r}: fp16 sum overflow ok" in out, out[-3000:]
    print(out[-2000:])
