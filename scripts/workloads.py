"""The convergence workloads: data, models and metrics, offline only.

Three workloads, each a :class:`Workload` (one object per process, data loaded once):

* ``digits-mlp``: MLP 64-512-512-10 (301 K parameters) on scikit-learn's 8x8 digits,
  SGD momentum 0.9, lr 0.1, batch 32 per rank. Metric: held-out accuracy.
* ``digits-wide``: the same with MLP 64-2048-2048-10 (4.35 M parameters: train.py's
  ``wide`` model, the network benchmark's), same optimizer and batches.
* ``digits-cnn``: CNN on the same images as 1x8x8: conv 1->16 3x3 (144 weights: under
  the 1024-element size floor, travels dense), conv 16->32 3x3 (4608), max-pool to 4x4,
  conv 32->64 3x3 (18432), max-pool to 2x2, FC 256->10 (2560); 26 K parameters, two
  compressed conv layers (AdaComp's 50-element conv bins) and one FC. SGD momentum 0.9,
  lr 0.05, batch 32 per rank. Metric: held-out accuracy.
* ``text-lm``: character LM, embedding V x 32 -> LSTM(32, 128) -> linear 128 -> V
  (V = 98 printable-ASCII symbols + newline + unknown; 99 K parameters: embedding 3.1 K,
  LSTM 16.4 K + 65.5 K, head 12.5 K), Adam lr 3e-3, batch 16 windows of 64 characters
  per rank. Metric: held-out loss (nats per character) and perplexity exp(loss).
  Corpus: the docstrings (``inspect.getdoc``) of a fixed, sorted list of standard-library
  modules and their public members, gathered once and cached in
  ``~/.cache/hvdsparse/docstrings_corpus.txt`` (deterministic for one Python version);
  the last 10% is held out.
* ``text-gpt``: GPT-style causal byte LM (pre-norm transformer): token embedding
  256 x d, learned position embedding seq x d, ``layers`` blocks of
  ``x + attn(LN(x))``, ``x + MLP(LN(x))`` (causal softmax attention with ``heads``
  heads, MLP d -> 4d -> d with GELU, no dropout), a final LayerNorm and an untied head
  d -> 256. Default (CPU-sized) config: 2 layers, d = 128, 4 heads, seq 64, batch 16
  windows per rank (0.47 M parameters), AdamW lr 3e-3, weight decay 0.01 (the
  transformer issue's setting); :data:`GPT_CONFIG` / ``bench_convergence.py --gpt
  key=value,...`` select a larger one. Metric: held-out loss (nats per byte).
  Corpus: the Python language reference as shipped with the interpreter
  (``pydoc_data.topics.topics``, the text ``help("topics")`` prints), its entries in
  sorted key order, UTF-8 bytes (deterministic for one Python version); the last 10%
  is held out. Parameter groups (:func:`gpt_group`): embedding (token, position),
  attention (qkv, output projection), mlp, layernorm, head, bias.

Data split (digits): fixed stratified 80/20 split (``random_state=0``), independent of
the training seed; the training seed sets the initial weights and the batch order.
Each rank trains on its own shard (``arange(rank, n, P)``), reshuffled every epoch.
"""
from __future__ import annotations

import inspect
import importlib
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["WORKLOADS", "Workload", "make_workload", "layer_kind", "text_corpus",
           "gpt_corpus", "gpt_group", "GPT_CONFIG"]

#: modules whose docstrings make the text corpus (fixed, sorted before use)
CORPUS_MODULES = ("argparse", "bisect", "calendar", "collections", "csv", "dataclasses",
                  "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
                  "functools", "heapq", "http.client", "inspect", "ipaddress", "itertools",
                  "json", "logging", "pathlib", "pickle", "pprint", "queue", "random", "re",
                  "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile",
                  "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid",
                  "zipfile")
VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\x00"]   # \x00: unknown
CORPUS_CACHE = Path(os.path.expanduser("~/.cache/hvdsparse/docstrings_corpus.txt"))


def text_corpus() -> str:
    """The docstring corpus (cached). Non-vocabulary characters become ``\\x00``."""
    if CORPUS_CACHE.exists():
        return CORPUS_CACHE.read_text()
    chunks = []
    for modname in sorted(CORPUS_MODULES):
        mod = importlib.import_module(modname)
        doc = inspect.getdoc(mod)
        if doc:
            chunks.append(doc)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if getattr(obj, "__module__", None) != mod.__name__:
                continue                        # re-exports and constants: skip
            doc = inspect.getdoc(obj)
            if doc:
                chunks.append(doc)
    known = set(VOCAB)
    text = "\n\n".join(chunks)
    text = "".join(ch if ch in known else "\x00" for ch in text)
    CORPUS_CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = CORPUS_CACHE.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, CORPUS_CACHE)
    return text


def gpt_corpus() -> bytes:
    """The Python language reference shipped with the interpreter
    (``pydoc_data.topics.topics``, entries in sorted key order, blank line between),
    as UTF-8 bytes."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


# ------------------------------------------------------------------------------- models

class MLP(nn.Module):
    def __init__(self, width=512):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, width), nn.Linear(width, width), \
            nn.Linear(width, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 2 * 2, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)   # 32 x 4 x 4
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)                        # 64 x 2 x 2
        return self.fc(x.flatten(1))


class CharLSTM(nn.Module):
    def __init__(self, vocab=len(VOCAB), emb=32, hidden=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        h, _ = self.lstm(self.embed(x))
        return self.head(h)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(LN(x))``, ``x + MLP(LN(x))``."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=256, d=128, layers=2, heads=4, seq=64):
        super().__init__()
        if d % heads:
            raise ValueError(f"GPT: d={d} is not a multiple of heads={heads}")
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():            # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok_emb(x) + self.pos_emb(pos)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))


def gpt_group(name: str) -> str:
    """A :class:`GPT` parameter's group: ``embedding`` / ``attention`` / ``mlp`` /
    ``layernorm`` / ``head`` / ``bias``."""
    if name.startswith(("tok_emb", "pos_emb")):
        return "embedding"
    if ".ln" in name or name.startswith("ln_f"):
        return "layernorm"
    if name.endswith(".bias"):
        return "bias"
    if name.startswith("head"):
        return "head"
    if ".qkv." in name or ".proj." in name:
        return "attention"
    if ".fc." in name or ".out." in name:
        return "mlp"
    raise ValueError(f"gpt_group: unknown GPT parameter {name!r}")


def layer_kind(model: nn.Module, name: str) -> str:
    """``conv`` / ``fc`` / ``lstm`` / ``embedding`` / ``bias`` for a parameter name
    (:class:`GPT`: its :func:`gpt_group`)."""
    if isinstance(model, GPT):
        return gpt_group(name)
    if name.endswith("bias") or ".bias" in name:
        return "bias"
    mod = model.get_submodule(name.rsplit(".", 1)[0])
    return {nn.Conv2d: "conv", nn.Linear: "fc", nn.LSTM: "lstm",
            nn.Embedding: "embedding"}.get(type(mod), type(mod).__name__)


# ---------------------------------------------------------------------------- workloads

class Workload:
    """Data + model + optimizer + metric of one workload, for one rank of ``world``.

    ``batches(seed, epoch)`` yields this rank's mini-batches of one epoch;
    ``evaluate(model)`` -> dict(loss=..., acc=... or ppl=...); ``quality`` names the
    metric the benchmark reports (``acc``: higher is better, ``loss``: lower is better).
    """

    name = ""
    quality = "acc"

    def __init__(self, rank=0, world=1):
        self.rank, self.world = rank, world

    def model(self, seed):
        torch.manual_seed(seed)
        return self._model()

    def steps_per_epoch(self):
        raise NotImplementedError


class _Digits(Workload):
    batch = 32
    lr = 0.1

    def __init__(self, rank=0, world=1):
        super().__init__(rank, world)
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        X, y = load_digits(return_X_y=True)
        X = (X / 16.0).astype(np.float32)
        Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=0,
                                              stratify=y)
        self.Xtr, self.ytr = torch.from_numpy(Xtr), torch.from_numpy(ytr).long()
        self.Xte, self.yte = torch.from_numpy(Xte), torch.from_numpy(yte).long()
        self.shard = torch.arange(rank, len(self.Xtr), world)

    def steps_per_epoch(self):
        return len(torch.arange(0, len(self.Xtr), self.world)) // self.batch

    def batches(self, seed, epoch):
        g = torch.Generator().manual_seed(seed * 100003 + epoch * 101 + self.rank)
        perm = self.shard[torch.randperm(len(self.shard), generator=g)]
        for b in range(self.steps_per_epoch()):
            idx = perm[b * self.batch:(b + 1) * self.batch]
            yield self.Xtr[idx], self.ytr[idx]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def optimizer(self, model, kind="sgd"):
        if kind != "sgd":
            raise ValueError(f"{self.name}: optimizer {kind!r} not supported (sgd)")
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)

    @torch.no_grad()
    def evaluate(self, model):
        out = model(self.Xte)
        return dict(loss=F.cross_entropy(out, self.yte).item(),
                    acc=(out.argmax(1) == self.yte).float().mean().item())


class DigitsMLP(_Digits):
    name = "digits-mlp"

    def _model(self):
        return MLP(512)


class DigitsWide(_Digits):
    """train.py's ``wide`` model (the network benchmark's): MLP 64-2048-2048-10."""
    name = "digits-wide"

    def _model(self):
        return MLP(2048)


class DigitsCNN(_Digits):
    name = "digits-cnn"
    lr = 0.05

    def _model(self):
        return CNN()


class TextLM(Workload):
    name = "text-lm"
    quality = "loss"
    batch = 16
    seq = 64
    lr = 3e-3
    eval_windows = 128
    #: one "epoch" is a fixed number of steps (random windows, not a pass over the text)
    epoch_steps = 25

    def __init__(self, rank=0, world=1):
        super().__init__(rank, world)
        text = text_corpus()
        lut = {ch: i for i, ch in enumerate(VOCAB)}
        ids = torch.tensor([lut[ch] for ch in text], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]
        # fixed held-out windows, evenly spaced
        starts = torch.linspace(0, len(self.test_ids) - self.seq - 2, self.eval_windows).long()
        w = torch.stack([self.test_ids[s:s + self.seq + 1] for s in starts.tolist()])
        self.eval_x, self.eval_y = w[:, :-1], w[:, 1:]

    def _model(self):
        return CharLSTM()

    def steps_per_epoch(self):
        return self.epoch_steps

    def batches(self, seed, epoch):
        g = torch.Generator().manual_seed(seed * 100003 + epoch * 101 + self.rank)
        for _ in range(self.epoch_steps):
            s = torch.randint(0, len(self.train_ids) - self.seq - 1, (self.batch,), generator=g)
            w = torch.stack([self.train_ids[i:i + self.seq + 1] for i in s.tolist()])
            yield w[:, :-1], w[:, 1:]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).reshape(-1, len(VOCAB)), y.reshape(-1))

    def optimizer(self, model, kind="adam"):
        if kind == "adam":
            return torch.optim.Adam(model.parameters(), lr=self.lr)
        if kind == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)
        raise ValueError(f"{self.name}: optimizer {kind!r} not supported (adam, adamw)")

    @torch.no_grad()
    def evaluate(self, model):
        out = model(self.eval_x)
        loss = F.cross_entropy(out.reshape(-1, len(VOCAB)), self.eval_y.reshape(-1)).item()
        return dict(loss=loss, ppl=math.exp(loss))


#: :class:`TextGPT`'s model and batch (``bench_convergence.py --gpt`` replaces entries;
#: the defaults are the CPU-sized transformer issue's setting)
GPT_CONFIG = dict(d=128, layers=2, heads=4, seq=64, batch=16, lr=3e-3, weight_decay=0.01)


class TextGPT(TextLM):
    """GPT-style causal byte LM on the Python language reference (module docstring)."""
    name = "text-gpt"
    epoch_steps = 50

    def __init__(self, rank=0, world=1):
        Workload.__init__(self, rank, world)
        c = self.config = dict(GPT_CONFIG)
        self.batch, self.seq, self.lr = int(c["batch"]), int(c["seq"]), float(c["lr"])
        ids = torch.frombuffer(bytearray(gpt_corpus()), dtype=torch.uint8).long()
        cut = int(0.9 * len(ids))
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]
        starts = torch.linspace(0, len(self.test_ids) - self.seq - 2, self.eval_windows).long()
        w = torch.stack([self.test_ids[s:s + self.seq + 1] for s in starts.tolist()])
        self.eval_x, self.eval_y = w[:, :-1], w[:, 1:]
        self.vocab = 256

    def _model(self):
        c = self.config
        return GPT(self.vocab, int(c["d"]), int(c["layers"]), int(c["heads"]), self.seq)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).reshape(-1, self.vocab), y.reshape(-1))

    def optimizer(self, model, kind="adamw"):
        if kind == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=self.lr,
                                     weight_decay=float(self.config["weight_decay"]))
        if kind == "adam":
            return torch.optim.Adam(model.parameters(), lr=self.lr)
        raise ValueError(f"{self.name}: optimizer {kind!r} not supported (adamw, adam)")

    @torch.no_grad()
    def evaluate(self, model):
        out = model(self.eval_x)
        loss = F.cross_entropy(out.reshape(-1, self.vocab), self.eval_y.reshape(-1)).item()
        return dict(loss=loss, ppl=math.exp(loss))


WORKLOADS = {w.name: w for w in (DigitsMLP, DigitsWide, DigitsCNN, TextLM, TextGPT)}


def make_workload(name, rank=0, world=1) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r} (choose from {sorted(WORKLOADS)})")
    return WORKLOADS[name](rank, world)
