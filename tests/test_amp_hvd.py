"""Mixed precision (torch.amp.GradScaler) through hvdsparse at P=2, real horovodrun:
residuals in unscaled units, an overflow step skipped by the scaler leaves residuals and
parameters untouched, and the run equals a reference run without that step, bitwise;
with and without DGC momentum correction (weight decay on).
See tests/workers/amp_worker.py."""
from pathlib import Path

from tests.hvdrun import run_horovod

WORKER = Path(__file__).parent / "workers" / "amp_worker.py"


def test_grad_scaler_recipe_p2():
    run_horovod(WORKER, np=2, timeout=240)
