"""DGC momentum correction, masking and local clipping at P=2 (real horovodrun) against
a plain-torch replay of DGC's update rule: see tests/workers/momentum_worker.py."""
from pathlib import Path

from tests.hvdrun import run_horovod

WORKER = Path(__file__).parent / "workers" / "momentum_worker.py"


def test_momentum_correction_matches_dgc_replay_p2():
    run_horovod(WORKER, np=2, timeout=240)
