"""Shared pytest configuration.

TRITON_INTERPRET must be set before anything imports triton (Triton's helpers such as
tl.sum are jit functions created at import time), so it is set here, at the very top.
It only matters for tests that run Triton kernels on CPU tensors (tests/test_kernels.py
forces them with HVDSPARSE_FORCE_TRITON=1); every other test takes the CPU reference
path, which hvdsparse.ops picks for CPU tensors anyway.

Every Horovod job a test starts (through tests/hvdrun.py or any launcher that copies this
process's environment) runs with ``tests.hvdrun.REPEATABLE_HOROVOD_ENV`` (tensor fusion
off), so a dense allreduce sums every element in the same order in every launch, whatever
the machine's load.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import random  # noqa: E402  (after TRITON_INTERPRET, which must come first)

import pytest  # noqa: E402

from tests.hvdrun import REPEATABLE_HOROVOD_ENV  # noqa: E402

os.environ.update(REPEATABLE_HOROVOD_ENV)


@pytest.fixture
def seed():
    """A fresh random seed per test, printed (``HVDSPARSE_TEST_SEED`` replays one)."""
    s = int(os.environ.get("HVDSPARSE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"HVDSPARSE_TEST_SEED={s}")
    return s
