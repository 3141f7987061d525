"""Train a small character-level transformer language model with TPUEstimator, then sample from it.

The text is the repository's own README.md. Run from the repository root:

    python examples/estimator_lm.py --steps 300

Every step (forward, backward, AdamW, the cosine schedule, gradient clipping) runs as one XLA
program; sampling keeps a fixed window so it compiles once.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import torch_tpu


class CharWindows(Dataset):
    """Windows of ``block`` characters and the same window shifted by one (the targets)."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A random offset each time, so every epoch sees fresh windows.
        start = torch.randint(0, len(self.ids) - self.block - 1, ()).item()
        chunk = self.ids[start : start + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("positions", torch.arange(block), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = self.positions[: idx.shape[1]]
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


@torch.no_grad()
def sample(model: nn.Module, est: torch_tpu.TPUEstimator, prompt: str, stoi: dict, itos: list, block: int,
           length: int = 200, temperature: float = 0.8) -> str:
    """Generates ``length`` characters. The context is always ``block`` long (left-padded with
    spaces), so every call of the model has the same shape: one compiled program."""
    model.eval()
    ids = [stoi.get(c, 0) for c in prompt]
    pad = stoi.get(" ", 0)
    for _ in range(length):
        ctx = ids[-block:]
        window = torch.tensor([[pad] * (block - len(ctx)) + ctx]).to(est)
        logits = model(window)[0, -1].float().cpu()
        ids.append(int(torch.multinomial(F.softmax(logits / temperature, -1), 1)))
    model.train()
    return "".join(itos[i] for i in ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "README.md"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mode", default="auto", choices=["auto", "fused", "compile", "strict"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--plot", default=None, help="save the loss curve to this PNG")
    args = parser.parse_args()

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = torch.tensor([stoi[c] for c in text])
    print(f"{len(text)} characters, vocabulary {len(itos)}")

    est = torch_tpu.TPUEstimator(mode=args.mode, precision=args.precision, seed=0)
    print(est)
    model = TinyGPT(len(itos), args.block).to(est)
    loader = DataLoader(CharWindows(ids, args.block), batch_size=args.batch, shuffle=True, drop_last=True)
    epochs = math.ceil(args.steps / len(loader))
    t0 = time.perf_counter()
    history = est.fit(
        model,
        loader,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
        scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=args.steps),
        clip_grad_norm=1.0,
        epochs=epochs,
        max_steps=args.steps,
        log_every=10,
    )
    seconds = time.perf_counter() - t0
    print(
        f"{len(history.loss)} steps in {seconds:.1f} s; loss {history.loss[0]:.3f} -> {history.loss[-1]:.3f}; "
        f"{history.samples_per_s:.0f} samples/s; {history.programs_compiled} programs compiled in "
        f"{history.compile_seconds:.1f} s; steps run as {history.execution}"
        + (f" ({history.replay_fallback})" if history.replay_fallback else "")
    )
    if args.plot:
        history.plot(args.plot)
    for prompt in ("torch_tpu ", "The "):
        print("-" * 60)
        print(sample(model, est, prompt, stoi, itos, args.block))


if __name__ == "__main__":
    main()
