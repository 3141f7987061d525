"""TPUEstimator.generate: a loader of prompts decoded with transformers' generate(), prompt lengths
bucketed, one static cache per bucket; CPU's tokens in loader order."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_tpu
from torch_tpu.bench.decode import tiny_llama

pytest.importorskip("transformers")

NEW = 5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_llama(layers=2, hidden=64)


def _copy(model):
    m = tiny_llama(layers=2, hidden=64)
    m.load_state_dict(model.state_dict())
    return m


def _cpu_tokens(model, ids, mask, bucket):
    """CPU's new tokens for prompts padded on the left to ``bucket``, as the estimator pads them."""
    pad = bucket - ids.shape[1]
    ids = torch.cat([torch.zeros(ids.shape[0], pad, dtype=ids.dtype), ids], 1)
    mask = torch.cat([torch.zeros(ids.shape[0], pad, dtype=torch.long), mask], 1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    new = out[:, bucket:]
    return torch.cat([new, new.new_zeros(new.shape[0], NEW - new.shape[1])], 1)


def _prompts(lengths, rows=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (rows, n), generator=g) for n in lengths]


def test_generate_gives_cpus_tokens_in_loader_order_and_compiles_once_per_bucket(model):
    """Buckets [4, 8]: prompts of lengths 5, 7, 5 and 6 share bucket 8, those of 3 bucket 4, and
    the last batch is short (padded to two rows, cut from the result). A bucket's first batch
    compiles its programs; its later batches compile nothing, whichever bucket ran between."""
    batches = _prompts([5, 7, 3, 5, 3, 3, 6]) + _prompts([6], rows=1, seed=2)
    compiles: list[int] = []

    def loader():
        for b in batches:
            compiles.append(torch_tpu.metrics()["compile_count"])
            yield b
        compiles.append(torch_tpu.metrics()["compile_count"])

    est = torch_tpu.TPUEstimator(bucket_lengths=[4, 8], verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = est.generate(_copy(model), loader(), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    expected = torch.cat([_cpu_tokens(model, b, torch.ones_like(b), 4 if b.shape[1] <= 4 else 8) for b in batches])
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert got.shape == (15, NEW)
    assert torch.equal(got, expected)
    per_batch = [b - a for a, b in zip(compiles, compiles[1:])]
    assert per_batch[0] > 0 and per_batch[2] > 0  # bucket 8's first batch, bucket 4's first
    assert per_batch[1] == per_batch[3] == per_batch[4] == per_batch[5] == per_batch[6] == per_batch[7] == 0, per_batch
    stats = est.last_generate_stats
    assert stats["batches"] == 8 and stats["prompts"] == 15 and stats["new_tokens"] == 15 * NEW
    assert stats["buckets"] == [(4, 2), (8, 2)]


def test_generate_takes_dict_batches_with_left_padded_masks_and_buckets_by_length(model):
    """A dict batch with its own attention mask (prompts of different lengths padded on the left by
    the loader); without bucket_lengths each prompt length is its own bucket."""
    ids = _prompts([6])[0]
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # the second prompt is 4 tokens long
    other = _prompts([3], seed=5)[0]
    loader = [{"input_ids": ids, "attention_mask": mask}, (other,)]
    est = torch_tpu.TPUEstimator(verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = est.generate(_copy(model), loader, max_new_tokens=NEW, pad_token_id=0, do_sample=False)
    expected = torch.cat([_cpu_tokens(model, ids, mask, 6), _cpu_tokens(model, other, torch.ones_like(other), 3)])
    assert torch.equal(got, expected)
    assert est.last_generate_stats["buckets"] == [(3, 2), (6, 2)]


_SAMPLING_SCRIPT = r"""
import warnings, torch, torch_tpu
from torch_tpu.bench.decode import tiny_llama
warnings.simplefilter("ignore")
torch.manual_seed(0)
cpu_model = tiny_llama(layers=2, hidden=64)
model = tiny_llama(layers=2, hidden=64)
model.load_state_dict(cpu_model.state_dict())
g = torch.Generator().manual_seed(1)
batches = [torch.randint(1, 256, (2, n), generator=g) for n in (5, 3, 7)]
kw = dict(max_new_tokens=6, do_sample=True, temperature=0.9, top_k=50, pad_token_id=0)
torch.manual_seed(7)
expected = []
with torch.no_grad():
    for b in batches:
        bucket = 4 if b.shape[1] <= 4 else 8
        pad = bucket - b.shape[1]
        ids = torch.cat([torch.zeros(2, pad, dtype=b.dtype), b], 1)
        mask = torch.cat([torch.zeros(2, pad, dtype=torch.long), torch.ones_like(b)], 1)
        expected.append(cpu_model.generate(ids, attention_mask=mask, **kw)[:, bucket:])
torch.manual_seed(7)
got = torch_tpu.TPUEstimator(bucket_lengths=[4, 8], verbose=False).generate(model, batches, **kw)
expected = torch.cat(expected)
assert torch.equal(got, expected), (got, expected)
torch.manual_seed(8)
assert not torch.equal(torch_tpu.TPUEstimator(bucket_lengths=[4, 8], verbose=False).generate(model, batches, **kw), got)
print("ok")
"""


def test_seeded_sampling_gives_cpus_tokens():
    """Sampling (temperature, top-k, multinomial) from the same seed gives CPU's tokens through the
    estimator, whose forward runs as compiled programs, when tpu draws from CPU's generator
    (``TORCH_TPU_RANDOM=cpu``, read at import: a fresh process); another seed, other tokens."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_RANDOM": "cpu", "TORCH_TPU_PLATFORM": "cpu"}
    r = subprocess.run([sys.executable, "-c", _SAMPLING_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_generate_refuses_what_it_cannot_decode(model):
    est = torch_tpu.TPUEstimator(bucket_lengths=[4], verbose=False)
    prompt = _prompts([3])[0]
    with pytest.raises(TypeError, match="generate\\(\\) method"):
        est.generate(torch.nn.Linear(2, 2), [prompt], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        est.generate(_copy(model), [], max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="longer than the largest bucket 4"):
        est.generate(_copy(model), _prompts([6]), max_new_tokens=2, pad_token_id=0)
    with pytest.raises(TypeError, match="'past_key_values' is the estimator's to set"):
        est.generate(_copy(model), [prompt], max_new_tokens=2, pad_token_id=0, past_key_values=None)
    with pytest.raises(TypeError, match="2-d integer tensor, got torch.float32"):
        est.generate(_copy(model), [prompt.float()], max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        est.generate(_copy(model), [prompt], max_new_tokens=0, pad_token_id=0)
    with pytest.raises(ValueError, match="attention mask's shape \\[2, 2\\] differs"):
        est.generate(_copy(model), [{"input_ids": prompt, "attention_mask": prompt[:, :2]}], max_new_tokens=2,
                     pad_token_id=0)
