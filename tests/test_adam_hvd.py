"""The Adam recipe at P=3 under real horovodrun and at P=2 in the DDP hook under real
torchrun, against Horovod's dense Adam and an independent plain-torch replay of the
recipe: see tests/workers/adam_worker.py and tests/workers/adam_ddp_worker.py."""
from pathlib import Path

from tests.hvdrun import run_horovod
from tests.torchrun import run_torchrun

WORKERS = Path(__file__).parent / "workers"


def test_adam_recipe_p3_horovod():
    run_horovod(WORKERS / "adam_worker.py", np=3, timeout=300)


def test_adam_recipe_p2_ddp_hook():
    run_torchrun(WORKERS / "adam_ddp_worker.py", 2, timeout=300)
