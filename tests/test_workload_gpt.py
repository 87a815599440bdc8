"""The transformer convergence workload (scripts/workloads.py ``text-gpt``) and the
benchmark's learning-rate schedule: causality against a perturbed future, the parameter
groups, the corpus, and the warm-up + cosine factor against its formula."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import workloads  # noqa: E402
from bench_convergence import _split_top, lr_factor  # noqa: E402


def _small():
    return workloads.GPT(vocab=256, d=32, layers=2, heads=4, seq=16)


def test_gpt_is_causal():
    """The logits at position t depend on tokens 0..t only: changing the tokens after a
    random t leaves positions <= t unchanged and changes a later one."""
    torch.manual_seed(torch.seed() % 2**31)
    m = _small().eval()
    x = torch.randint(0, 256, (3, 16))
    t = int(torch.randint(0, 14, ()))
    y = x.clone()
    y[:, t + 1:] = torch.randint(0, 256, y[:, t + 1:].shape)
    y[:, t + 1] = (x[:, t + 1] + 1) % 256                  # surely different
    with torch.no_grad():
        a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], rtol=1e-5, atol=1e-5)
    assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 1e-4


def test_gpt_groups_cover_every_parameter():
    m = _small()
    groups = {n: workloads.gpt_group(n) for n, _ in m.named_parameters()}
    assert set(groups.values()) == {"embedding", "attention", "mlp", "layernorm", "head",
                                    "bias"}
    assert groups["tok_emb.weight"] == groups["pos_emb.weight"] == "embedding"
    assert groups["head.weight"] == "head"
    assert all(groups[n] == "layernorm" for n in groups if ".ln" in n or "ln_f" in n)
    # the benchmark's layer kind is the group
    assert all(workloads.layer_kind(m, n) == g for n, g in groups.items())
    # the head is the last registered parameter (TopK's output-layer rule picks it)
    assert list(groups)[-1] == "head.weight"
    with pytest.raises(ValueError, match="unknown GPT parameter"):
        workloads.gpt_group("blocks.0.mystery.weight")


def test_gpt_corpus_is_deterministic_english_bytes():
    a, b = workloads.gpt_corpus(), workloads.gpt_corpus()
    assert a == b and len(a) > 100_000
    text = a.decode("utf-8")
    assert "statement" in text and "expression" in text


def test_lr_factor_matches_formula():
    total = int(torch.randint(50, 500, ()))
    frac = float(torch.rand(())) * 0.3
    w = int(round(frac * total))
    for step in range(total):
        want = (step + 1) / w if step < w else \
            0.5 * (1 + math.cos(math.pi * (step - w) / (total - w)))
        assert lr_factor(step, total, frac) == pytest.approx(want)
    assert lr_factor(total, total, frac) == pytest.approx(0.0, abs=1e-12)


def test_split_top_keeps_bracketed_commas():
    s = "overrides={'a*':{'dense':True},'b':{'ratio':0.1}},opt.adam_warmup=50,x=(1,2)"
    assert _split_top(s) == ["overrides={'a*':{'dense':True},'b':{'ratio':0.1}}",
                             "opt.adam_warmup=50", "x=(1,2)"]
