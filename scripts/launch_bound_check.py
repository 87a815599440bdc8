"""The launch bound of the CUDA path, for every compressor through both front doors:
per steady-state step, at most ``20 * buckets + 10`` device launches (aten ops that
would be CUDA kernels + Triton launches, ``validate=False``, forced Triton through the
interpreter) beyond what the model's own backward + optimizer step issue
(``scripts/count_device_ops.py`` counts; ResNet-50's 161 parameter shapes at widths / 16,
world size 2 over Gloo).

A pytest module (``.venv/bin/python -m pytest -q scripts/launch_bound_check.py``): one
test per (door, compressor) pair, for a compressor added to ``count_device_ops.METHODS``
before ``tests/test_launch_count.py`` (which checks the counting itself and asserts the
bound for the pairs it counts) lists it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "count_device_ops", Path(__file__).resolve().with_name("count_device_ops.py"))
cdo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cdo)

#: every compressor under SGD and under AdamW (the Adam recipe)
ALL = list(cdo.METHODS) + [m + "+adamw" for m in cdo.METHODS]
#: the small configuration both this check and tests/test_launch_count.py count
SMALL = dict(div=16, image=16, batch=2, warmup=2, steps=1)
_CACHE: dict = {}


def small_counts(door: str, methods=None) -> dict:
    """Counts of ``methods`` (default: every compressor) through ``door`` (one launch of
    the job, cached)."""
    methods = ALL if methods is None else list(methods)
    key = (door, tuple(methods))
    if key not in _CACHE:
        _CACHE[key] = cdo.run_door(door, methods, np=2, **SMALL)
        print(cdo.table({door: _CACHE[key]}, methods))
    return _CACHE[key]


def over_bound(door: str, method: str, methods=None):
    """``(added, bound, buckets)`` of one pair (counted with ``methods``)."""
    r = small_counts(door, methods)["results"][method]
    return r["added"], cdo.bound(r["buckets"]), r["buckets"]


@pytest.mark.parametrize("method", ALL)
@pytest.mark.parametrize("door", cdo.DOORS)
def test_launch_bound(door, method):
    pytest.importorskip("triton")
    if door == "horovod":
        pytest.importorskip("horovod.torch")
    added, limit, nb = over_bound(door, method)
    assert nb >= 1, f"{door} / {method}: no exchange launched in the counted step"
    assert added <= limit, (f"{door} / {method}: {added:.0f} launches per step beyond the "
                            f"model's own, bound {limit:.0f} ({nb:g} buckets)")
