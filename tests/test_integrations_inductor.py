"""Plain ``torch.compile(model)`` (the default backend, inductor) on tpu tensors: a graph on tpu
is compiled by the tpu backend, others by inductor as before."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # no qkv bias (nanoGPT's bias=False): a key bias has a zero gradient, which AdamW turns into noise
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, pre-norm blocks, a tied head."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 2, block: int = 16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def train(device: str, compiled: bool, steps: int = 3) -> tuple[list[float], nn.Module]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(model) if compiled else model  # the default backend, as nanoGPT's train.py writes it
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 16), generator=g)
        loss = step(idx.to(device), idx.roll(-1, 1).to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_plain_torch_compile_trains_tiny_gpt_like_cpu(monkeypatch):
    import torch_tpu.integrations.inductor as routed

    graphs = []
    original = routed.compile_tpu_graph
    monkeypatch.setattr(routed, "compile_tpu_graph",
                        lambda gm, inputs, *a, **k: graphs.append(gm) or original(gm, inputs))
    tpu_losses, mt = train("tpu", compiled=True)
    cpu_losses, mc = train("cpu", compiled=False)
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(mc.named_parameters(), mt.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-3, atol=1e-4, msg=name)
    assert graphs, "the graph did not reach the tpu backend"


def test_routing_looks_at_inputs_and_values_made_inside():
    """The switch: a tpu input, or a tpu value created in the graph; a CPU graph stays inductor's."""
    import torch._inductor.compile_fx as compile_fx

    import _torch_tpu_autoload

    assert getattr(compile_fx.compile_fx, "_torch_tpu", False)
    seen = []

    def backend(gm, example_inputs):
        seen.append(_torch_tpu_autoload._graph_on_tpu(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(3))
    torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(3, device="tpu"))
    torch.compile(lambda x: (x.to("tpu") + torch.ones(3, device="tpu")).cpu(), backend=backend)(torch.ones(3))
    assert seen == [False, True, True]


def test_plain_torch_compile_of_a_function_creating_tpu_tensors():
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.to("tpu") * 3 + torch.arange(3.0, device="tpu")).sum())
    assert f(torch.ones(3)).item() == 12.0
