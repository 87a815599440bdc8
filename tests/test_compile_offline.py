"""Offline compile test: the launches that the compressors, the decoder and DCT-MP really
make, bound as a real launch binds them, compiled for sm_80 and sm_90 without a GPU.

The work is done by ``scripts/compile_kernels.py`` in a subprocess (the test process runs
Triton's interpreter, which replaces every ``@triton.jit`` function at import time, so
real compilation needs a fresh process without ``TRITON_INTERPRET``). Its JSON report is
asserted here:

* every launch kernel of ``kernels/*.py`` (an ``ast`` scan: a ``@triton.jit`` function
  that Python code there launches as ``kernel[grid](...)``) is in the script's
  ``KERNELS`` and compiled (no compiling needed to check the list);
* every recorded launch binds and every specialisation compiles, for both targets;
  every driving scenario (compressors on a 25M-element layer, the bucket path's
  TopK / Threshold / policy-dense / QSGD / AdaComp rows, ``codec.encode`` of narrowed
  payloads, ``codec.accumulate`` with ``validate=False`` per segment and table-driven,
  meta tensors past 2**31 elements) runs and launches the kernels it is there for;
* no register spills (``ptxas -v``);
* every grid axis within CUDA's limits, and every streaming kernel that walks a
  25M-element layer (per layer, or a bucket's table holding one) launches >= 1000
  programs;
* 128-bit global loads (``ld.global.v4``) in the streaming kernels whose fp32 inputs
  are aligned (layer sizes divisible by 16);
* every global atomic says ``.relaxed`` (shared-memory ones: relaxed or no ``.sem``,
  which PTX reads as relaxed) and no fence anywhere (controls: Triton's default
  acq_rel atomic is caught);
* no ``fma.rn.f32`` in the kernels whose math is two separate roundings, and no
  approximate fp32 division (``div.full`` / ``div.approx``) there, nor in the kernels
  that state ``div_rn`` (quantiser, decoders);
* every tensor pointer offset in the Triton IR is 64-bit.

* every kernel also compiles with each specialised integer argument forced to 1 (a
  constexpr in a real launch) and to 16 (divisibility attribute).

Triton versions: the venv's Triton compiles the subset for sm_80 and sm_90; every
other Triton under ``.venv/triton-side/<version>/`` (``scripts/setup_env.sh`` puts the
oldest and the newest supported release there, wheel only, ``pip --target``) compiles
it for sm_90 in a subprocess with that directory first on ``PYTHONPATH`` (torch and the
rest from the venv), and every assertion below holds for each report.
``test_supported_range_is_covered`` checks that the Tritons compiled against are the
bounds of the range ``setup.cfg`` states.

Default: a representative subset (about 155 specialisations for the venv's Triton,
77 for each other one, plus about 46 forced-integer variants each; about 2 minutes
with a cold cache on 2 cores for the venv's Triton (AdaComp's bucket pack, unrolled
per slot, takes 5-15 s a compile), 15-25 s warm; one cache,
``~/.cache/hvdsparse/triton`` unless ``TRITON_CACHE_DIR`` is set, keyed by Triton
version). The full matrix (every compressor, encoding and bucket) runs with
``HVDSPARSE_COMPILE_FULL=1``.
"""
import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDE = os.environ.get("HVDSPARSE_TRITON_SIDE", os.path.join(REPO, ".venv", "triton-side"))


def _side_tritons():
    """{version: directory} of the Tritons installed beside the venv's."""
    return {os.path.basename(d): d for d in sorted(glob.glob(os.path.join(SIDE, "*")))
            if os.path.isdir(os.path.join(d, "triton"))}


TARGETS = ["venv"] + sorted(_side_tritons())


def _compile(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "HVDSPARSE_FORCE_TRITON")}
    path = [REPO]
    cmd = [sys.executable, os.path.join(REPO, "scripts", "compile_kernels.py"),
           "--out", str(out)]
    if target != "venv":
        # this Triton wins over the venv's; sm_90 only (the reduced run)
        path.insert(0, _side_tritons()[target])
        cmd += ["--cc", "90"]
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    print(p.stdout[-6000:])
    assert p.returncode == 0, p.stderr[-6000:]
    with open(out) as f:
        rep = json.load(f)
    if target != "venv":
        assert rep["triton"] == target, (rep["triton"], target)
    return rep


_REPORTS: dict = {}


@pytest.fixture(scope="module", params=TARGETS, ids=[f"triton-{t}" for t in TARGETS])
def report(request, tmp_path_factory):
    pytest.importorskip("triton")
    if request.param not in _REPORTS:
        _REPORTS[request.param] = _compile(tmp_path_factory, request.param)
    return _REPORTS[request.param]


def _script_list(name):
    """The literal ``name`` (a list or set) of ``scripts/compile_kernels.py``, read with
    ``ast`` (the script itself refuses to import under the interpreter)."""
    with open(os.path.join(REPO, "scripts", "compile_kernels.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"scripts/compile_kernels.py defines no literal {name}")


def _is_jit(dec) -> bool:
    """``@triton.jit`` / ``@triton.jit(...)`` / ``@jit`` / ``@jit(...)``."""
    f = dec.func if isinstance(dec, ast.Call) else dec
    return (isinstance(f, ast.Attribute) and f.attr == "jit" and
            isinstance(f.value, ast.Name) and f.value.id == "triton") or \
        (isinstance(f, ast.Name) and f.id == "jit")


def _scan_kernels(src_by_module):
    """``(jit functions {(module, name)}, launches {(module, name)})`` of the kernel
    sources ``{module: source}``: a launch is ``K[grid](...)`` (``K`` a name, or
    ``mod.K``) in Python code (outside every ``@triton.jit`` function) where ``K`` is a
    ``@triton.jit`` function of the launching module, or else of the one module that
    defines it."""
    trees = {m: ast.parse(src) for m, src in src_by_module.items()}
    jit = {(m, n.name) for m, t in trees.items() for n in ast.walk(t)
           if isinstance(n, ast.FunctionDef) and any(_is_jit(d) for d in n.decorator_list)}
    owners = {}
    for m, name in jit:
        owners.setdefault(name, set()).add(m)
    launches = set()

    def visit(m, node):
        if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
            return                                   # device code: calls, not launches
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            v = node.func.value
            name = v.id if isinstance(v, ast.Name) else \
                v.attr if isinstance(v, ast.Attribute) else None
            if name in owners:
                own = {m} if m in owners[name] else owners[name]
                assert len(own) == 1, (m, name, own)
                launches.add((next(iter(own)), name))
        for child in ast.iter_child_nodes(node):
            visit(m, child)
    for m, t in trees.items():
        visit(m, t)
    return jit, launches


def _kernel_sources():
    out = {}
    for path in sorted(glob.glob(os.path.join(REPO, "kernels", "*.py"))):
        with open(path) as f:
            out[os.path.splitext(os.path.basename(path))[0]] = f.read()
    return out


def test_every_launch_kernel_is_compiled_offline():
    """Every ``@triton.jit`` function that Python code in ``kernels/`` launches
    (``kernel[grid](...)``) is in the compile script's ``KERNELS`` (so the offline
    compile covers it), and every entry there is such a launch kernel. No compiling."""
    jit, launches = _scan_kernels(_kernel_sources())
    listed = set(map(tuple, _script_list("KERNELS")))
    assert len(listed) == len(_script_list("KERNELS")), "KERNELS lists a kernel twice"
    missing = sorted(launches - listed)
    assert not missing, f"launch kernels without offline compile coverage " \
                        f"(add them to KERNELS in scripts/compile_kernels.py and a " \
                        f"scenario reaching them): {missing}"
    stale = sorted(listed - launches)
    assert not stale, f"KERNELS entries that are no launch kernel of kernels/: {stale}"
    # the scan tells launches from inlined helpers (kernels/table.py's are never launched)
    assert ("table", "program_row") in jit and ("table", "program_row") not in launches


def test_kernel_scan_sees_launch_forms():
    """The scan above on a made-up module: a launch by name and by module attribute,
    a jit helper called from a kernel, a subscript-call inside a kernel (device code)."""
    src = (
        "import triton\nimport triton.language as tl\nfrom . import other\n"
        "@triton.jit\ndef _helper(x):\n    return x\n"
        "@triton.jit(do_not_specialize=['n'])\ndef _a(p, n):\n    _helper(p)\n"
        "@triton.jit\ndef _b(p):\n    q = _a[0](p)\n"
        "def go(t):\n    _a[(1,)](t, 3)\n    other._c[(2,)](t)\n")
    other = "import triton\n@triton.jit\ndef _c(p):\n    pass\n"
    jit, launches = _scan_kernels({"mod": src, "other": other})
    assert jit == {("mod", "_helper"), ("mod", "_a"), ("mod", "_b"), ("other", "_c")}
    assert launches == {("mod", "_a"), ("other", "_c")}


def _specs(rep, kernels=None):
    return [s for s in rep["specializations"] if kernels is None or s["kernel"] in kernels]


def test_every_launch_binds_and_compiles(report):
    assert not report["errors"], "\n".join(report["errors"])
    kinds = {s["kernel"] for s in report["specializations"]}
    # every kernel the script lists (the scan above: every launch kernel of kernels/)
    listed = {k for _, k in _script_list("KERNELS")}
    assert set(report["kernels"]) == listed, (report["kernels"], listed)
    assert kinds >= listed, sorted(listed - kinds)
    assert kinds >= {"_residual_flat_kernel", "_residual_tile_kernel",
                     "_select_compact_kernel", "_quantize_pack_kernel", "_unpack_kernel",
                     "_scatter_row_kernel", "_row_threshold_kernel",
                     "_philox_uniform_kernel", "_refine_count_kernel",
                     "_refine_final_kernel", "_clean_kernel",
                     "_zero_slots_kernel", "_binned_count_kernel",
                     "_binned_pack_kernel", "_accumulate_kernel", "_sample_kernel",
                     "_count_kernel", "_select_kernel", "_clamp_kernel",
                     "_mask_kernel", "_ladder_kernel", "_radix_hist_kernel",
                     "_own_step_kernel", "_dense_copy_kernel", "_qsgd_pack_kernel",
                     "_whole_cast_kernel",
                     "_ada_accumulate_kernel", "_ada_count_kernel", "_ada_pack_kernel",
                     "_check_kernel", "_scatter_kernel", "_narrow_kernel",
                     "_segment_mean_kernel", "_pick_kernel", "_gather_kernel",
                     "_split_ranges_kernel"}, kinds
    bad = [(s["kernel"], s["cc"], s.get("error")) for s in report["specializations"]
           if not s["ok"]]
    assert not bad, bad
    assert {s["cc"] for s in report["specializations"]} == set(report["ccs"])


def test_integer_specialisations_compile(report):
    """Every kernel with a specialised integer argument compiles with all of them equal
    to 1 (constexprs: ``x.to(...)`` on one fails) and equal to 16."""
    bad = [(f["kernel"], f["value"], f["args"], f["error"][-400:]) for f in report["forced"]
           if not f["ok"]]
    assert not bad, bad
    got = {(f["kernel"], f["value"]) for f in report["forced"]}
    for k in ("_residual_tile_kernel", "_select_compact_kernel", "_quantize_pack_kernel",
              "_refine_count_kernel", "_scatter_row_kernel", "_binned_pack_kernel",
              "_qsgd_pack_kernel", "_ada_count_kernel", "_ada_pack_kernel",
              "_check_kernel", "_scatter_kernel", "_narrow_kernel"):
        assert (k, 1) in got and (k, 16) in got, k
    # an argument equal to 1 really became a constexpr
    ones = [f for f in report["forced"] if f["value"] == 1]
    assert all(len(f["constexprs"]) > 0 for f in ones)


def _version(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def test_supported_range_is_covered():
    """setup.cfg's ``triton>=A,<B``: the oldest Triton compiled against is an A.x and
    every one is below B (``scripts/setup_env.sh`` installs A.x and the newest release
    below B beside the venv). Outside CI a checkout without them skips; CI fails."""
    with open(os.path.join(REPO, "setup.cfg")) as f:
        m = re.search(r"^\s*triton\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)\s*$", f.read(), re.M)
    assert m, "setup.cfg must state triton>=LOW,<HIGH"
    low, high = _version(m.group(1)), _version(m.group(2))
    triton = pytest.importorskip("triton")
    have = sorted([_version(triton.__version__)] + [_version(v) for v in _side_tritons()])
    if len(have) < 2 and not os.environ.get("CI"):
        pytest.skip(f"no Triton under {SIDE} (scripts/setup_env.sh installs them)")
    assert have[0][:len(low)] == low, (have, low)
    assert all(v < high for v in have), (have, high)


def test_no_spills(report):
    spills = [(s["kernel"], s["cc"], s["scenarios"], s["spill_store_bytes"],
               s["spill_load_bytes"]) for s in _specs(report)
              if s["spill_store_bytes"] or s["spill_load_bytes"]]
    assert not spills, spills


def test_grids(report):
    for l in report["launches"]:
        g = l["grid"]
        assert 1 <= g[0] < 2**31 and all(1 <= x <= 65535 for x in g[1:]), l
    big = [l for l in report["launches"] if l["kernel"] in report["streaming"]
           and (l.get("n") or 0) >= report["big"]]
    # residual x2, select, quantize, refinement count, clean
    assert len({l["kernel"] for l in big}) >= 6, big
    small = [l for l in big if l["grid"][0] < 1000]
    assert not small, small
    # table-driven bucket kernels (no ``n``): in a scenario whose bucket holds a
    # 25M-element layer, every launch tiles it with >= 1000 programs
    tb = [l for l in report["launches"] if l["kernel"] in report["table_streaming"]
          and "25M" in l["scenario"]]
    assert {l["kernel"] for l in tb} == set(report["table_streaming"]), tb
    small = [l for l in tb if l["grid"][0] < 1000]
    assert not small, small


def test_vector_loads_on_aligned_fp32(report):
    """On the 25M-element layer (5000 x 5000) residual add (fp32 grad), select, TopK's
    refinement count and the dense quantiser (QSGD) read their fp32 inputs with
    ld.global.v4; residual add, select and the count also on an odd-sized layer
    (4999 x 5001: full blocks are unmasked)."""
    def specs(kernel, scen):
        return [s for s in _specs(report, {kernel}) if scen in s["scenarios"]]
    for kernel, scen in (("_residual_flat_kernel", "TopK-fp32@25M"),
                         ("_select_compact_kernel", "TopK-fp32@25M"),
                         ("_refine_count_kernel", "TopK-fp32@25M"),
                         ("_refine_count_kernel", "TopK-fp32@odd25M"),
                         ("_clean_kernel", "clean-fp32@25M"),
                         ("_residual_flat_kernel", "TopK-fp32@odd25M"),   # 16 does not
                         ("_select_compact_kernel", "TopK-fp32@odd25M"),  # divide n
                         ("_quantize_pack_kernel", "QSGD-4@25M")):
        got = specs(kernel, scen)
        # every target (the refinement count: one specialisation per round each)
        assert {s["cc"] for s in got} == set(report["ccs"]), (kernel, scen)
        for s in got:
            assert s["v4_loads"] > 0, (kernel, s["cc"])


def test_atomics_relaxed_no_fence(report):
    for s in _specs(report):
        assert not s["fences"], (s["kernel"], s["fences"])
        assert not s["nonrelaxed_atomics"], (s["kernel"], s["nonrelaxed_atomics"])
    acc = _specs(report, {"_scatter_row_kernel", "_scatter_kernel"})
    assert {s["kernel"] for s in acc} == {"_scatter_row_kernel", "_scatter_kernel"}
    assert all(any(".add.f32" in a for a in s["atomics"]) for s in acc)
    # controls: Triton's default atomic (acq_rel) is reported, sem="relaxed" and the
    # shared-memory atomics of tl.histogram (no .sem: relaxed in PTX) are not
    c = report["controls"]
    assert c["acq_rel_atomic"]["nonrelaxed"], c
    assert c["relaxed_atomic"]["atomics"] and not c["relaxed_atomic"]["nonrelaxed"], c
    assert not c["histogram"]["nonrelaxed"], c


def test_no_fma_where_two_roundings(report):
    for s in _specs(report, set(report["no_fma"])):
        assert s["enable_fp_fusion"] is False, s["kernel"]
        assert s["fma_f32"] == 0, (s["kernel"], s["cc"], s["fma_f32"])


def test_no_approximate_division_where_exact(report):
    """The interpreter divides in IEEE fp32; on the GPU Triton's plain ``/`` is
    ``div.full.f32`` (about 2 ulp). Kernels whose math must match the CPU path bit for
    bit (the no-FMA set, e.g. TopK's refinement ``r * target / c``, and the quantiser /
    decoders that state ``div_rn``) use ``div_rn``. The controls show the check sees a
    plain ``/``."""
    assert report["controls"]["plain_div"] > 0, report["controls"]
    assert report["controls"]["rn_div"] == 0, report["controls"]
    exact = set(report["no_fma"]) | set(report["exact_div"])
    assert {s["kernel"] for s in _specs(report, exact)} == exact
    for s in _specs(report, exact):
        assert s["approx_div_f32"] == 0, (s["kernel"], s["cc"], s["approx_div_f32"])


def test_64bit_offsets(report):
    for s in _specs(report):
        assert not s["i32_tensor_offsets"], (s["kernel"], s["i32_tensor_offsets"])
    # the > 2**31-element meta launches bound n as a 64-bit integer and compiled
    huge = [s for s in _specs(report) if any("2^31+5" in sc for sc in s["scenarios"])]
    assert huge and all(s["signature"].get("n") == "i64" for s in huge if "n" in s["signature"])
