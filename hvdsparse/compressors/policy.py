"""Per-layer policy: which layers are compressed, and with which settings.

Rules, in order, for a layer called ``name`` with gradient shape ``shape``:

1. ``overrides`` is a dict ``{fnmatch pattern: {setting: value}}``; the *first* pattern
   (in dict order) that matches ``name`` (``fnmatch.fnmatchcase``) supplies per-layer
   settings that replace the compressor's constructor settings (e.g.
   ``{"embed*": dict(ratio=0.05)}`` or ``{"*.bias": dict(dense=True)}``). Besides the
   compressor's own settings an override may set ``dense`` (bool: force dense),
   ``compress`` (bool: force compression even under the size floor / for 1-D) and
   ``min_numel`` / ``compress_1d``. An unknown key raises ``ValueError`` naming the
   pattern and the key.
2. ``dense=True`` -> dense. ``compress=True`` -> compressed.
3. Tensors with fewer than ``min_numel`` elements (default 1024, as CGX / DGC do) are
   dense; so are 0-d and 1-D tensors (biases, norms) unless ``compress_1d=True``.
4. Otherwise compressed; the compressor may still send the layer dense when its sparse
   payload (fixed capacity) would be at least as large as the dense one
   (see ``Compressor._sparse_is_worth_it``).

Policy-dense layers travel as fp32 without error feedback (nothing is lost).

On the Adam recipe's update wire a compressor may send the layers rule 3 makes dense
*whole* instead (``whole_small``, set by ``Compressor.set_adam_update_wire``; TopK with
fp16 / bf16 values): every element, as one DENSE segment in the layer's value encoding,
the rounding kept in the layer's residual (error feedback), under every rank's own Adam
moments like the compressed layers (:meth:`LayerPolicy.is_whole`). An override's
``dense=True`` still sends a layer fp32 and exact.
"""
from __future__ import annotations

import fnmatch
from typing import Optional

__all__ = ["LayerPolicy"]

POLICY_KEYS = ("dense", "compress", "min_numel", "compress_1d")


class LayerPolicy:
    def __init__(self, min_numel: int = 1024, compress_1d: bool = False,
                 overrides: Optional[dict] = None, allowed_keys=()):
        if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
        if not isinstance(compress_1d, bool):
            raise ValueError(f"compress_1d must be a bool, got {compress_1d!r}")
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, dict):
            raise ValueError(f"overrides must be a dict {{pattern: {{setting: value}}}}, "
                             f"got {type(overrides).__name__}")
        allowed = set(allowed_keys) | set(POLICY_KEYS)
        for pat, ov in overrides.items():
            if not isinstance(pat, str):
                raise ValueError(f"overrides: pattern {pat!r} must be a str")
            if not isinstance(ov, dict):
                raise ValueError(f"overrides[{pat!r}] must be a dict of settings, got "
                                 f"{type(ov).__name__}")
            for key in ov:
                if key not in allowed:
                    raise ValueError(f"overrides[{pat!r}]: unknown setting {key!r} "
                                     f"(allowed: {sorted(allowed)})")
            for key in ("dense", "compress", "compress_1d"):
                if key in ov and not isinstance(ov[key], bool):
                    raise ValueError(f"overrides[{pat!r}][{key!r}] must be a bool")
            if "min_numel" in ov and (not isinstance(ov["min_numel"], int)
                                      or ov["min_numel"] < 0):
                raise ValueError(f"overrides[{pat!r}]['min_numel'] must be an int >= 0")
        self.min_numel = min_numel
        self.compress_1d = compress_1d
        self.overrides = {p: dict(o) for p, o in overrides.items()}
        #: the layers rule 3 makes dense travel whole (module docstring)
        self.whole_small = False

    def match(self, name: str) -> dict:
        """The override dict of the first matching pattern (empty if none)."""
        for pat, ov in self.overrides.items():
            if fnmatch.fnmatchcase(name, pat):
                return ov
        return {}

    def is_dense(self, name: str, shape) -> bool:
        ov = self.match(name)
        if ov.get("dense", False):
            return True
        return not self.whole_small and self.dense_by_shape(name, shape)

    def is_whole(self, name: str, shape) -> bool:
        """Rule 3's layer while ``whole_small`` is on (and no override sends it dense):
        every element travels in the layer's value encoding with error feedback."""
        return self.whole_small and not self.match(name).get("dense", False) and \
            self.dense_by_shape(name, shape)

    def dense_by_shape(self, name: str, shape) -> bool:
        """The size / rank rule alone (``min_numel``, ``compress_1d``, and an override's
        ``compress``), ignoring an override's ``dense``."""
        ov = self.match(name)
        if ov.get("compress", False):
            return False
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel < ov.get("min_numel", self.min_numel):
            return True
        if len(shape) <= 1 and not ov.get("compress_1d", self.compress_1d):
            return True
        return False

    def config(self) -> dict:
        return dict(min_numel=self.min_numel, compress_1d=self.compress_1d,
                    overrides={p: dict(o) for p, o in self.overrides.items()})
