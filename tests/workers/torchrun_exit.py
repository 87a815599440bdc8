"""How every torchrun test worker ends.

A worker that leaves DDP modules or hook state in module globals keeps the Gloo process
group alive into interpreter finalization (``destroy_process_group`` only drops c10d's own
reference); Gloo's threads then die with the interpreter and, about once in a few hundred
launches here, the process aborts with "terminate called without an active exception"
after every check passed and every rank printed OK. The checks are done by then, so the
worker leaves without finalization: barrier (nobody tears down while a peer still
talks), OK line, destroy, flush, ``os._exit(0)``.
"""
import os
import sys

import torch.distributed as dist


def finish(rank: int) -> None:
    dist.barrier()
    print(f"HVDSPARSE-OK rank={rank}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
