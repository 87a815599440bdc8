"""``scripts/train.py --launcher torchrun``: the same workloads under ``torchrun`` +
``DistributedDataParallel``, with hvdsparse's compressors as a DDP communication hook
(:mod:`hvdsparse.ddp`).

:class:`TorchrunHvd` offers the handful of ``horovod.torch`` calls train.py makes
(``init``, ``rank``, ``size``, ``local_rank``, ``local_size``, ``allreduce``,
``broadcast_object``, ``broadcast_parameters``, ``broadcast_optimizer_state``) on
``torch.distributed`` (Gloo on CPU, NCCL on GPU), so the training loop stays one loop.
:func:`wrap_model` puts the model into DDP and registers the hook matching
``--compression`` (none: DDP's allreduce, fp16: ``fp16_compress_hook``, anything else:
``hvdsparse.ddp.hook`` with the compressor), and :func:`adapt_optimizer` gives the
plain torch optimizer the hvdsparse optimizer methods train.py reads (``stats()``,
``compression_state_dict()``, ``load_compression_state_dict()``).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


class TorchrunHvd:
    """``horovod.torch``'s calls used by train.py, on torch.distributed."""

    Sum, Max, Average = "sum", "max", "average"

    class Compression:
        none = "none"
        fp16 = "fp16"

    def __init__(self, device: str = "auto"):
        self.device = device           # train.py's --device: picks NCCL or Gloo

    def init(self):
        if not dist.is_initialized():
            cuda = self.device == "cuda" or (self.device == "auto" and
                                             torch.cuda.is_available())
            dist.init_process_group("nccl" if cuda else "gloo")

    def shutdown(self):
        """Tear the process group down before the interpreter exits. Without it, Gloo's
        worker threads can still be alive at exit and the process aborts with "terminate
        called without an active exception" after a successful run (pytorch#190489;
        seen here in CI once in a few hundred launches)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def rank(self) -> int:
        return dist.get_rank()

    def size(self) -> int:
        return dist.get_world_size()

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def local_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def allreduce(self, tensor, op=None, name=None):
        t = tensor.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == self.Max else dist.ReduceOp.SUM)
        if op in (None, self.Average):
            t /= self.size()
        return t

    def broadcast_object(self, obj, root_rank=0, name=None):
        box = [obj]
        dist.broadcast_object_list(box, src=root_rank)
        return box[0]

    def broadcast_parameters(self, state_dict, root_rank=0):
        for v in state_dict.values():
            if isinstance(v, torch.Tensor):
                dist.broadcast(v, src=root_rank)

    def broadcast_optimizer_state(self, opt, root_rank=0):
        sd = self.broadcast_object(opt.state_dict() if self.rank() == root_rank else None,
                                   root_rank)
        if self.rank() != root_rank:
            opt.load_state_dict(sd)


def wrap_model(args, model, compressor, device, optimizer=None, grad_scaler=None):
    """DDP(model) with the hook that ``--compression`` asks for; returns (ddp, state).
    ``optimizer`` (the SGD that steps the model) gives the hook DGC momentum correction
    by the same rule as the Horovod path (and ``--momentum-correction`` /
    ``--clip-grad-norm`` their meaning); ``grad_scaler``: ``--amp fp16``'s scaler."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids)
    state = None
    if args.compression == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.compression != "none":
        import hvdsparse.ddp
        state = hvdsparse.ddp.State(compressor, ddp.named_parameters(),
                                    exchange=args.exchange, optimizer=optimizer,
                                    momentum_correction=args.momentum_correction,
                                    clip_grad_norm=args.clip_grad_norm,
                                    grad_scaler=grad_scaler)
        ddp.register_comm_hook(state, hvdsparse.ddp.hook)
    return ddp, state


def adapt_optimizer(opt, state):
    """The plain optimizer with the hvdsparse optimizer methods train.py reads."""
    if state is not None:
        opt.stats = state.stats
        opt.compression_state_dict = state.state_dict
        opt.load_compression_state_dict = state.load_state_dict
    return opt


def check_args(args):
    """Options that have no meaning (or no implementation) under torchrun."""
    if args.backward_passes_per_step != 1:
        raise SystemExit("--launcher torchrun: --backward-passes-per-step is not "
                         "supported (DDP accumulates with no_sync())")
    if args.local_gradient is not None or args.sync_period is not None:
        raise SystemExit("--launcher torchrun: --local-gradient is not supported")
    if getattr(args, "record_cost_model", False):
        raise SystemExit("--launcher torchrun: --record-cost-model reads the Horovod "
                         "scheduler; not supported")
