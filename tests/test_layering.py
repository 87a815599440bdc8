"""The package's layering, read from the source (``ast``, nothing imported): every
``import`` / ``from ... import`` of every module under ``hvdsparse/`` and ``kernels/``
(installed as ``hvdsparse.kernels``), at module level and inside functions alike.

Rules (README, "Dependency rules"):

* no import cycle among the package's modules (a function-level import closes a cycle
  as surely as a module-level one: it only moves the failure to the first call);
* the floor imports nothing of hvdsparse above it: ``kernels/``, ``oracle.py``,
  ``payload.py`` and ``native/`` nothing at all (``kernels/`` only its own modules),
  ``philox.py`` only ``native/``, ``cpu.py`` and its ``cpu_*.py`` parts only ``philox.py``,
  ``native/``, ``payload.py`` and each other;
* ``compressors/`` never import ``exchange/``, a front door (``optimizer``,
  ``scheduler``, ``ddp``, ``engine``), ``native/`` or ``kernels/`` (compiled loops and
  kernels are reached through ``ops``);
* ``exchange/`` never imports ``compressors/``;
* no module (in ``hvdsparse/``, ``kernels/``, ``scripts/``) imports another module's
  private name (``from m import _x`` or ``m._x``); tests may.

The checker itself is tested on a small planted tree (:func:`test_checker_sees_planted_
violations`), so a rule that silently matches nothing fails too.
"""
import ast
import os
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "hvdsparse"

FLOOR_ALLOWED = {
    # module prefix -> the hvdsparse modules (prefixes) it may import
    "hvdsparse.kernels": ("hvdsparse.kernels",),
    "hvdsparse.oracle": (),
    "hvdsparse.payload": (),
    "hvdsparse.native": (),
    "hvdsparse.philox": ("hvdsparse.native",),
    "hvdsparse.cpu": ("hvdsparse.philox", "hvdsparse.native", "hvdsparse.payload"),
}
#: cpu.py gathers the CPU path from its parts, each on the floor with it
CPU_PARTS = ("hvdsparse.cpu_checks", "hvdsparse.cpu_chunking", "hvdsparse.cpu_residual",
             "hvdsparse.cpu_select", "hvdsparse.cpu_quantize", "hvdsparse.cpu_decode")
for _m in ("hvdsparse.cpu",) + CPU_PARTS:
    FLOOR_ALLOWED[_m] = FLOOR_ALLOWED["hvdsparse.cpu"] + CPU_PARTS
FRONT_DOORS = ("hvdsparse.optimizer", "hvdsparse.scheduler", "hvdsparse.ddp",
               "hvdsparse.engine")
FORBIDDEN = {
    "hvdsparse.compressors": ("hvdsparse.exchange", "hvdsparse.native", "hvdsparse.kernels")
    + FRONT_DOORS,
    "hvdsparse.exchange": ("hvdsparse.compressors",),
}

#: The one place for known exceptions: ``(rule, module) -> why``. The front doors
#: (scheduler.py, ddp.py, optimizer.py, engine.py, local.py, transport.py) are being
#: rewritten onto one step engine; an import of theirs that breaks a rule is listed here,
#: by name, until that rewrite lands, and nowhere else. Empty: none breaks one today.
KNOWN_EXCEPTIONS = {}


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def module_files(repo: str = REPO):
    """``{module name: path}`` of the package (``kernels/`` as ``hvdsparse.kernels``)."""
    out = {}
    for top, pkg in (("hvdsparse", "hvdsparse"), ("kernels", "hvdsparse.kernels")):
        base = os.path.join(repo, top)
        for dp, dn, fn in os.walk(base):
            dn[:] = sorted(d for d in dn if d != "__pycache__")
            for f in sorted(fn):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dp, f), base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join([pkg] + rel)] = os.path.join(dp, f)
    return out


def _resolve(mod: str, path: str, node: ast.ImportFrom) -> str:
    """Absolute module name of a ``from`` import in module ``mod``."""
    if not node.level:
        return node.module or ""
    pkg = mod if os.path.basename(path) == "__init__.py" else mod.rpartition(".")[0]
    parts = pkg.split(".")
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(mod: str, path: str, mods):
    """``[(line, imported module, name or None)]``: every import of package modules in
    ``path`` (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            tgt = _resolve(mod, path, node)
            if not _under(tgt, PKG):
                continue
            for a in node.names:
                if f"{tgt}.{a.name}" in mods:
                    out.append((node.lineno, f"{tgt}.{a.name}", None))
                else:
                    out.append((node.lineno, tgt, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _under(a.name, PKG):
                    out.append((node.lineno, a.name, None))
    return out


def graph(repo: str = REPO):
    mods = module_files(repo)
    return mods, {m: imports_of(m, p, mods) for m, p in mods.items()}


def cycles(edges) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    adj = {m: sorted({t for _, t, _ in imps if t in edges and t != m})
           for m, imps in edges.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return out


def floor_violations(mods, edges):
    bad = []
    for m, imps in edges.items():
        for prefix, allowed in FLOOR_ALLOWED.items():
            if not _under(m, prefix):
                continue
            for line, t, _ in imps:
                if not any(_under(t, a) for a in allowed):
                    bad.append(f"{mods[m]}:{line}: {m} imports {t}")
    return bad


def forbidden_imports(mods, edges):
    bad = []
    for m, imps in edges.items():
        for prefix, forbidden in FORBIDDEN.items():
            if not _under(m, prefix):
                continue
            for line, t, _ in imps:
                if any(_under(t, f) for f in forbidden):
                    bad.append(f"{mods[m]}:{line}: {m} imports {t}")
    return bad


def private_names(paths, mods):
    """``from m import _x`` and ``m._x`` (``m`` bound by an import of a package module)
    in ``paths``, where ``m`` is another module. Dunder names are public."""
    def private(name):
        return name.startswith("_") and not name.startswith("__")

    bad = []
    for mod, path in paths.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        bound = {}                  # local name -> imported package module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                tgt = _resolve(mod, path, node) if mod else (node.module or "")
                if not _under(tgt, PKG):
                    continue
                for a in node.names:
                    sub = f"{tgt}.{a.name}"
                    if sub in mods:
                        bound[a.asname or a.name] = sub
                    elif private(a.name) and tgt != mod:
                        bad.append(f"{path}:{node.lineno}: from {tgt} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if _under(a.name, PKG) and a.asname:
                        bound[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr) and \
                    isinstance(node.value, ast.Name) and node.value.id in bound and \
                    bound[node.value.id] != mod:
                bad.append(f"{path}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return bad


def script_files(repo: str = REPO):
    d = os.path.join(repo, "scripts")
    names = sorted(os.listdir(d)) if os.path.isdir(d) else []
    return {f"scripts/{f}": os.path.join(d, f) for f in names if f.endswith(".py")}


def _known(rule: str, found):
    """``found`` less the listed exceptions of ``rule`` (those must still occur)."""
    listed = {m for (r, m) in KNOWN_EXCEPTIONS if r == rule}
    stale = [m for m in listed if not any(m in f for f in found)]
    assert not stale, f"KNOWN_EXCEPTIONS lists {rule} for {stale}, which no longer occur"
    return [f for f in found if not any(m in f for m in listed)]


@pytest.fixture(scope="module")
def tree():
    return graph()


def test_no_import_cycles(tree):
    mods, edges = tree
    found = _known("cycle", [" -> ".join(c) for c in cycles(edges)])
    assert not found, "import cycles:\n" + "\n".join(found)


def test_floor_imports_nothing_above_it(tree):
    mods, edges = tree
    found = _known("floor", floor_violations(mods, edges))
    assert not found, "\n".join(found)


def test_compressors_and_exchange_stay_in_their_lanes(tree):
    mods, edges = tree
    found = _known("forbidden", forbidden_imports(mods, edges))
    assert not found, "\n".join(found)


def test_no_module_imports_a_private_name(tree):
    mods, _ = tree
    paths = dict(mods, **script_files())
    found = _known("private", private_names(paths, mods))
    assert not found, "\n".join(found)


def test_checker_sees_planted_violations(tmp_path):
    """Each rule fires on a planted tree: a function-level cycle, a floor module reaching
    up, a compressor importing the exchange, a private name, a private attribute."""
    files = {
        "hvdsparse/__init__.py": "",
        "hvdsparse/payload.py": "def f():\n    from . import codec\n",
        "hvdsparse/codec.py": "from .payload import f\ndef _arange(n):\n    return n\n",
        "hvdsparse/ops.py": "from . import codec\nx = codec._arange(3)\n",
        "hvdsparse/compressors/__init__.py": "",
        "hvdsparse/compressors/topk.py": "from ..exchange import split\n"
                                          "from ..codec import _arange\n",
        "hvdsparse/exchange/__init__.py": "",
        "hvdsparse/exchange/split.py": "import hvdsparse.ops\n",
        "kernels/__init__.py": "",
        "scripts/tool.py": "from hvdsparse import ops\nops._kernels()\n",
    }
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))
    mods, edges = graph(str(tmp_path))
    assert ["hvdsparse.codec", "hvdsparse.payload"] in cycles(edges)
    assert any("hvdsparse.payload imports hvdsparse.codec" in v
               for v in floor_violations(mods, edges))
    assert any("hvdsparse.compressors.topk imports hvdsparse.exchange.split" in v
               for v in forbidden_imports(mods, edges))
    paths = dict(mods, **script_files(str(tmp_path)))
    priv = private_names(paths, mods)
    assert any("from hvdsparse.codec import _arange" in v for v in priv)
    assert any("hvdsparse.codec._arange" in v for v in priv)
    assert any("hvdsparse.ops._kernels" in v for v in priv)
    # the module's own private names are its own business
    assert not any(v.startswith(str(tmp_path / "hvdsparse/codec.py")) for v in priv)
