"""Hugging Face models (small configs, random weights, nothing downloaded) on tpu: eager and
torch.compile(backend="tpu") against CPU."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def batch(kind):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 16), generator=g)
    if kind == "gpt2":
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 2])}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_training_step_matches_cpu(kind, compiled):
    torch._dynamo.reset()
    mc = {"gpt2": gpt2, "bert": bert}[kind]()
    mt = copy.deepcopy(mc).to("tpu")
    run_t = torch.compile(mt, backend="tpu") if compiled else mt
    b = batch(kind)
    oc = torch.optim.AdamW(mc.parameters(), lr=1e-3)
    ot = torch.optim.AdamW(mt.parameters(), lr=1e-3)
    for _ in range(2):
        lc = mc(**b).loss
        lt = run_t(**{k: v.to("tpu") for k, v in b.items()}).loss
        torch.testing.assert_close(lt.detach().cpu(), lc.detach(), rtol=1e-4, atol=1e-4)
        for o, loss in ((oc, lc), (ot, lt)):
            o.zero_grad()
            loss.backward()
            o.step()
    for (name, a), b_ in zip(mc.named_parameters(), mt.parameters()):
        torch.testing.assert_close(b_.detach().cpu(), a.detach(), rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_compiled_training_on_varying_lengths_matches_cpu(kind):
    """Batches padded to their own length: after the second length Dynamo traces the model with a
    symbolic sequence length (``sym_size`` nodes, sizes saved for the backward)."""
    torch._dynamo.reset()
    model = gpt2() if kind == "gpt2" else bert()
    mt = copy.deepcopy(model).to("tpu")
    step = torch.compile(mt, backend="tpu")
    g = torch.Generator().manual_seed(2)
    for length in (8, 12, 6):
        ids = torch.randint(0, 97, (2, length), generator=g)
        b = {"input_ids": ids, "labels": ids} if kind == "gpt2" else {
            "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([1, 2])}
        lt = step(**{k: v.to("tpu") for k, v in b.items()}).loss
        lt.backward()
        loss = model(**b).loss
        loss.backward()
        torch.testing.assert_close(lt.detach().cpu(), loss.detach(), rtol=1e-4, atol=1e-5)
    for a, t in zip(model.parameters(), mt.parameters()):
        torch.testing.assert_close(t.grad.cpu(), a.grad, rtol=1e-3, atol=1e-5)
