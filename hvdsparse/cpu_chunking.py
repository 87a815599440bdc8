"""How the CPU passes walk memory: the chunk size, the minimum work per thread, the
numpy switch and the per-thread scratch buffers.

The residual add (:mod:`hvdsparse.cpu_residual`) and the selections
(:mod:`hvdsparse.cpu_select`) walk a layer in chunks of :data:`CHUNK` elements (rounded
to whole bins), each chunk's temporaries in :func:`chunk_scratch`, so every element is
read from DRAM once per operation; contiguous ranges of whole chunks go to up to
``torch.get_num_threads()`` threads once there are :data:`CHUNK_PAR_MIN` elements per
thread. :data:`USE_NUMPY` off sends the CPU passes (and the quantiser,
:mod:`hvdsparse.cpu_quantize`) down the torch steps used on other devices -- same bits;
tests flip it. The users read these names from this module at call time, so a test may
set them here.
"""
from __future__ import annotations

import threading

import numpy as np


#: elements per chunk of the CPU path (1 MiB of fp32: stays in L2/L3; the per-op
#: dispatch overhead of smaller chunks costs more than the cache misses it saves)
CHUNK = 1 << 18
#: at least this many elements per worker thread before the residual add and the
#: selections are split across threads (whole chunks per thread; smaller inputs run inline)
CHUNK_PAR_MIN = 1 << 19
#: CPU passes of the residual add, the selections and the quantiser in numpy
#: (False: the torch steps used off-CPU; for tests)
USE_NUMPY = True

_tls = threading.local()


def chunk_scratch(m: int):
    """Per-thread scratch of the residual add and the selections: (fp32[m], bool[m]), reused."""
    s = getattr(_tls, "c", None)
    if s is None or s[0].shape[0] < m:
        s = (np.empty(m, np.float32), np.empty(m, np.bool_))
        _tls.c = s
    return s[0][:m], s[1][:m]
