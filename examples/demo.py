"""`make demo`: train a small classifier on the tpu device and show what ran where.

Plain PyTorch code: the only changes from a CPU script are `import torch_tpu` and `device="tpu"`.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

import torch_tpu


def spirals(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved spirals: a small problem a linear model cannot solve."""
    t = torch.rand(n, generator=generator) * 3 * math.pi
    label = torch.randint(0, 2, (n,), generator=generator)
    r = t / (3 * math.pi)
    angle = t + label * math.pi
    x = torch.stack([r * angle.cos(), r * angle.sin()], 1) + 0.02 * torch.randn(n, 2, generator=generator)
    return x, label


def main() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x_train, y_train = spirals(2048, g)
    x_test, y_test = spirals(512, g)
    device = torch.device("tpu")

    model = nn.Sequential(nn.Linear(2, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=300)
    x, y = x_train.to(device), y_train.to(device)

    print(f"torch {torch.__version__}, torch_tpu on XLA platform '{torch_tpu.platform()}', "
          f"mode {torch_tpu.get_eager_mode().value}, device {x.device}")
    start = time.perf_counter()
    for step in range(1, 301):
        idx = torch.randint(0, x.shape[0], (256,), generator=g).to(device)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
    print(f"trained 300 steps in {elapsed:.1f} s; test accuracy {accuracy:.1%}")
    print()
    print(torch_tpu.metrics_report(top=8))


if __name__ == "__main__":
    main()
