"""The benchmark workloads, defined as in ``shared/bench/workloads.py`` so figures agree.

* ``mlp``: 784-1024-1024-10, batch 128, SGD;
* ``gpt``: 2 layers, d=128, seq 64, batch 8, AdamW (dispatch-bound: shows what fusion buys);
* ``gpt-issue``: 4 layers, d=256, seq 128, batch 8, AdamW (compute-bound);
* ``gpt-xl``: 8 layers, d=1024, seq 512, batch 16 (for accelerators).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.h)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 128, layers: int = 2, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


SIZES = {  # (vocab, d_model, layers, heads, seq, batch)
    "gpt": (1000, 128, 2, 4, 64, 8),
    "gpt-issue": (1000, 256, 4, 4, 128, 8),
    "gpt-xl": (32000, 1024, 8, 16, 512, 16),
    # host-bound: so little math that a step's time is the host's work (dispatch, tracing, calls)
    "gpt-tiny": (128, 32, 2, 2, 16, 2),
}
NAMES = ("mlp", *SIZES)


def make(name: str, dev: torch.device | str, seed: int = 0, bf16: bool = False) -> tuple[nn.Module, Callable, int]:
    """Returns (model, step_fn, tokens_per_step) for one training step on fixed data."""
    dev = torch.device(dev)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        model: nn.Module = nn.Sequential(
            nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )
        x, y = torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)
        make_opt = lambda p: torch.optim.SGD(p, lr=0.01)
        loss_of = lambda m, x, y: F.cross_entropy(m(x), y)
        tokens = 128
    else:
        V, d, L, H, T, B = SIZES[name]
        model = GPT(vocab=V, d=d, layers=L, heads=H, seq=T)
        x = torch.randint(0, V, (B, T), generator=g)
        y = torch.randint(0, V, (B, T), generator=g)
        make_opt = lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01)
        loss_of = lambda m, x, y: F.cross_entropy(m(x).reshape(-1, V).float(), y.reshape(-1))
        tokens = B * T
    model = model.to(dev)
    x, y = x.to(dev), y.to(dev)
    opt = make_opt(model.parameters())

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        return loss

    step.data = (x, y)  # the fixed batch (the estimator benchmark feeds it through a loader)
    step.make_optimizer = make_opt
    step.optimizer = opt  # graph capture makes it capturable
    return model, step, tokens
