"""hvdsparse's DDP communication hook under real ``torchrun`` (Gloo, localhost) at P = 2
and P = 3: TopK(1.0) equals DDP's allreduce (SGD-momentum, Adam; every exchange; static
graph; rebuilt buckets), every compressor trains with bitwise identical replicas,
no_sync accumulation, unused parameters, checkpoint/resume, Join, DGC momentum correction
against a plain-torch replay, mismatched settings.
See tests/workers/ddp_worker.py (one launch per world size runs every check)."""
import json
from pathlib import Path

import pytest

from tests.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "ddp_worker.py"


def test_ddp_hook_p2():
    out = run_torchrun(WORKER, nproc=2, timeout=300)
    assert out.count("passed check_") == 12, out[-3000:]


def test_ddp_hook_p3():
    # no_sync, resume and the disagreement check run at P=2 only (no P dependence)
    out = run_torchrun(WORKER, nproc=3, timeout=300,
                       args=["check_transport", "check_equivalence",
                             "check_every_compressor", "check_unused", "check_join",
                             "check_balanced_feedback", "check_grad_scaler"])
    assert out.count("passed check_") == 7, out[-3000:]


def test_state_refuses_unsupported_settings():
    import torch.distributed as dist
    import hvdsparse
    from hvdsparse.ddp import State
    from hvdsparse.transport import Transport

    class One(Transport):          # a world of one: the State needs no process group
        def rank(self):
            return 0

        def size(self):
            return 1
    net = __import__("torch").nn.Linear(2, 2)
    for kw, word in ((dict(backward_passes_per_step=2), "no_sync"),
                     (dict(fusion_threshold=1 << 20), "bucket_cap_mb"),
                     (dict(local_gradient="sum"), "local_gradient"),
                     (dict(nonfinite="skip"), "nonfinite"),
                     (dict(exchange="ring"), "exchange")):
        with pytest.raises(ValueError, match=word):
            State(hvdsparse.TopK(0.1), net.named_parameters(), transport=One(), **kw)
    with pytest.raises(TypeError, match="grad_scaler"):
        State(hvdsparse.TopK(0.1), net.named_parameters(), transport=One(),
              grad_scaler=object())
    with pytest.raises(ValueError, match="named_parameters"):
        State(hvdsparse.TopK(0.1), None, transport=One())
    with pytest.raises(TypeError, match="instance"):
        State(hvdsparse.TopK, net.named_parameters(), transport=One())
    assert not dist.is_initialized()


def test_train_script_under_torchrun(tmp_path):
    """scripts/train.py --launcher torchrun (DDP + hvdsparse.ddp.hook) against the same
    command under horovodrun, both with ``--amp fp16`` (GradScaler handed to hvdsparse)
    and the default momentum-correction rule: the same figures, epoch by epoch -- the
    two front doors share compressors, seeds and codec, and moving between launchers
    does not change how gradients are compressed."""
    from tests.hvdrun import run_horovod
    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    args = ["--compression", "topk", "--ratio", "0.05", "--epochs", "2", "--width", "64",
            "--amp", "fp16", "--no-progress"]
    out = run_torchrun(script, nproc=2, timeout=300,
                       args=["--launcher", "torchrun", *args,
                             "--json", str(tmp_path / "ddp.json")])
    assert "epoch   2" in out and "vs dense fp32 allreduce" in out, out[-3000:]
    run_horovod(script, np=2, timeout=300, args=[*args, "--json", str(tmp_path / "hvd.json")])
    ddp = json.loads((tmp_path / "ddp.json").read_text())["summary"]
    hvd = json.loads((tmp_path / "hvd.json").read_text())["summary"]
    assert ddp["steps"] == hvd["steps"] > 0
    for key in ("final_test_loss", "final_test_acc"):
        assert ddp[key] == hvd[key], (key, ddp[key], hvd[key])
    assert ddp["final_test_loss"] < 2.0, ddp["final_test_loss"]     # it trained
