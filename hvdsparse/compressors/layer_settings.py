"""Per-layer settings of a compressor: :class:`LayerSettings` merges the constructor's
settings with the ``overrides`` that match a layer (:mod:`.policy`), validates them
(``_validate_cfg``, a subclass hook) and caches the result per layer; it checks that
every override pattern matches some parameter name.

:class:`LayerSettings` is a mixin of :class:`~hvdsparse.compressors.base.Compressor`:
``_settings`` names the per-layer settings (each an attribute of the compressor),
``policy`` is its :class:`~hvdsparse.compressors.policy.LayerPolicy` and ``_cfg_cache``
a dict.
"""
from __future__ import annotations

import fnmatch


class LayerSettings:
    """Settings per layer (see the module docstring)."""

    def _base_cfg(self) -> dict:
        return {k: getattr(self, k) for k in self._settings}

    def _validate_cfg(self, cfg: dict, where: str = "") -> dict:
        """Validate (and normalise) a settings dict; raise ValueError naming the argument
        (prefixed by ``where`` for overrides)."""
        return cfg

    def _validate_overrides(self):
        base = self._base_cfg()
        for pat, ov in self.policy.overrides.items():
            merged = dict(base)
            merged.update({k: v for k, v in ov.items() if k in self._settings})
            self._validate_cfg(merged, where=f"overrides[{pat!r}]: ")

    def _all_cfgs(self) -> list:
        """The base settings and every override's merged settings."""
        base = self._base_cfg()
        out = [base]
        for pat, ov in self.policy.overrides.items():
            merged = dict(base)
            merged.update({k: v for k, v in ov.items() if k in self._settings})
            out.append(self._validate_cfg(merged, where=f"overrides[{pat!r}]: "))
        return out

    def layer_cfg(self, name: str) -> dict:
        cfg = self._cfg_cache.get(name)
        if cfg is None:
            cfg = self._base_cfg()
            ov = self.policy.match(name)
            cfg.update({k: v for k, v in ov.items() if k in self._settings})
            cfg = self._validate_cfg(cfg, where=f"layer {name!r}: ")
            self._cfg_cache[name] = cfg
        return cfg

    def register_layers(self, named_shapes) -> None:
        """Called once by the front door with every optimised ``(name, shape)`` in the
        optimizer's order (the same on every rank): :meth:`check_names`, then the
        compressor's own per-layer derivations (``_register_layers``)."""
        named_shapes = [(str(n), tuple(int(d) for d in s)) for n, s in named_shapes]
        self.check_names([n for n, _ in named_shapes])
        self._register_layers(named_shapes)

    def _register_layers(self, named_shapes) -> None:
        """Subclass hook of :meth:`register_layers` (default: nothing)."""

    def check_names(self, names) -> None:
        """Raise ``ValueError`` when an ``overrides`` pattern matches none of ``names``
        (the model's parameter names), naming the pattern and a few parameter names --
        e.g. a pattern written without the ``module.`` prefix that DDP-style wrappers
        add. Call once with every parameter name the compressor will see."""
        names = [str(n) for n in names]
        for pat in self.policy.overrides:
            if any(fnmatch.fnmatchcase(n, pat) for n in names):
                continue
            hint = ""
            if any(fnmatch.fnmatchcase(n, "*" + pat) for n in names):
                hint = " (it matches with a prefix: add e.g. 'module.' or a leading '*')"
            few = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(f"{type(self).__name__}: overrides pattern {pat!r} matches no "
                             f"parameter name{hint}; parameter names are {few or '(none)'}")
