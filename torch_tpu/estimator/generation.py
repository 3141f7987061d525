"""``TPUEstimator.generate``: batch decoding with a transformers causal LM's ``generate()`` over a
loader of prompts, prompt lengths bucketed, one static KV cache per bucket.

Why buckets, and a cache each: XLA compiles a program per set of shapes. Every prompt is padded on
the left to its bucket's length (the attention mask is zero there, as transformers expects of a
decoder-only model: the new tokens follow the prompt's last real token), and a short last batch
gets rows repeated up to the full batch size (cut from the result on the host), so all the batches
of a bucket have one shape. Their prefill (the padded prompt in one forward) and their decode step
(one token against the cache) are then programs compiled at the bucket's first batch and run
again by the rest. The bucket's ``StaticCache`` is reset between batches, not made again, so the
decode step reads the same cache tensors every time.

The decode step is a compiled graph in every mode (transformers compiles the forward when the
cache is static), and the rest runs op by op, whatever the estimator's mode: the prompt's ids and
mask are uploaded as host values, so ``generate()``'s per-token bookkeeping on them (a column
appended, positions, stopping checks) runs on the host where its shapes grow
(:mod:`torch_tpu.dispatch.host_placement`), and a line found to grow in the first batch sends its
calls to the host in every later one. Op by op, a bucket's later batches then run the programs
its first batch compiled, or the host; recorded as fused traces, where a trace is cut would follow
those choices, and the second batch would record (and compile) other traces than the first.

The result is one CPU tensor of token ids, ``[prompts, max_new_tokens]``, in loader order: the new
tokens only, a row that stopped early (its end-of-sequence token) filled with the pad token id, as
``generate()`` fills it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torch_tpu.dispatch.host_placement import host_result
from torch_tpu.estimator.data import batch_size, bucket_for
from torch_tpu.runtime.executor import set_eager_mode

# the estimator's type, named rather than imported: estimator.py imports this module
TPUEstimator = Any


def prompts_of(raw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token ids and attention mask of a batch of prompts: a ``[batch, length]`` integer
    tensor, a dict with ``"input_ids"`` (and ``"attention_mask"``), or a tuple ``(ids[, mask])``."""
    if isinstance(raw, torch.Tensor):
        ids, mask = raw, None
    elif isinstance(raw, dict):
        if "input_ids" not in raw:
            raise TypeError(f"TPUEstimator.generate: a dict batch needs 'input_ids', got keys {sorted(raw)}")
        ids, mask = raw["input_ids"], raw.get("attention_mask")
    elif isinstance(raw, (tuple, list)) and raw and isinstance(raw[0], torch.Tensor):
        ids = raw[0]
        mask = raw[1] if len(raw) > 1 and isinstance(raw[1], torch.Tensor) else None
    else:
        raise TypeError("TPUEstimator.generate: a batch of prompts is a [batch, length] tensor of token ids, a dict "
                        f"with 'input_ids' (and 'attention_mask'), or a tuple (ids, mask); got {type(raw).__name__}")
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"TPUEstimator.generate: the prompts' token ids must be a 2-d integer tensor, got "
                        f"{ids.dtype}{list(ids.shape)}")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"TPUEstimator.generate: the attention mask's shape {list(mask.shape)} differs from the "
                         f"token ids' {list(ids.shape)}")
    return ids, mask


def left_pad(ids: torch.Tensor, mask: torch.Tensor | None, length: int, rows: int,
             pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` padded on the left to ``length`` columns with ``pad_id`` (mask 0 there), and to
    ``rows`` rows by repeating its first row (cut from the result later), on the host."""
    ids = ids.cpu()
    mask = torch.ones_like(ids) if mask is None else mask.cpu().to(ids.dtype)
    n, width = ids.shape
    if width < length:
        ids = torch.cat([ids.new_full((n, length - width), pad_id), ids], 1)
        mask = torch.cat([mask.new_zeros((n, length - width)), mask], 1)
    if n < rows:
        ids = torch.cat([ids, ids[:1].expand(rows - n, -1)], 0)
        mask = torch.cat([mask, mask[:1].expand(rows - n, -1)], 0)
    return ids, mask


def pad_token_id(model: nn.Module, kwargs: dict) -> int:
    """The id padding prompts and finished rows: ``generate``'s ``pad_token_id``, else the model's
    generation config's pad (or end-of-sequence) token."""
    pid = kwargs.get("pad_token_id")
    config = getattr(model, "generation_config", None)
    if pid is None and config is not None:
        pid = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pid, (list, tuple)):
        pid = pid[0] if pid else None
    if isinstance(pid, torch.Tensor):
        pid = int(pid.reshape(-1)[0])
    if pid is None:
        raise ValueError("TPUEstimator.generate needs a pad token id to pad prompts and finished rows: pass "
                         "pad_token_id=..., or set the model's generation_config.pad_token_id")
    return int(pid)


class BatchGenerator:
    """One ``generate`` call over a loader: the buckets' caches and the results in loader order."""

    def __init__(self, est: TPUEstimator, model: nn.Module, max_new_tokens: int, kwargs: dict) -> None:
        if not callable(getattr(model, "generate", None)):
            raise TypeError(f"TPUEstimator.generate needs a model with a generate() method (a transformers causal "
                            f"LM), got {type(model).__name__}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"TPUEstimator.generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        for k in ("input_ids", "attention_mask", "past_key_values", "max_new_tokens", "max_length",
                  "cache_implementation"):
            if k in kwargs:
                raise TypeError(f"TPUEstimator.generate: {k!r} is the estimator's to set (the loader gives the "
                                "prompts, and each bucket has its own static cache)")
        self.est, self.model, self.max_new = est, model, max_new_tokens
        self.kwargs = kwargs
        self.pad = pad_token_id(model, kwargs)
        self.caches: dict[tuple[int, int], Any] = {}  # (bucket length, rows) -> its StaticCache

    def cache_for(self, length: int, rows: int) -> Any:
        """The bucket's static cache, made at its first batch, and reset for every batch.

        The cache is made whole before its first use (transformers' ``early_initialization``,
        where the installed version has it), so that every batch of the bucket, the first
        included, runs the same ops: reset, prefill, decode steps. A fused trace or a compiled
        graph of the first batch is then the one the others run; a cache made inside the first
        batch's prefill would make that prefill a program of its own."""
        from transformers import StaticCache

        cache = self.caches.get((length, rows))
        if cache is None:
            cache = self.caches[(length, rows)] = StaticCache(config=self.model.config,
                                                              max_cache_len=length + self.max_new)
            if hasattr(cache, "early_initialization"):
                cfg = self.model.config
                cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
                heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
                head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
                cache.early_initialization(rows, heads, head_dim, self._cache_dtype(), self.est.device)
        cache.reset()
        return cache

    def _cache_dtype(self) -> torch.dtype:
        """The keys' and values' dtype: bfloat16 under the estimator's bf16 autocast, else the model's."""
        if self.est.precision == "bf16":
            return torch.bfloat16
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)

    def one(self, raw: Any, full: int) -> torch.Tensor:
        """The new tokens of one batch of prompts, ``[its rows, max_new_tokens]``, on the host."""
        ids, mask = prompts_of(raw)
        n, width = ids.shape
        buckets = self.est.bucket_lengths
        length = bucket_for(width, buckets) if buckets else width
        rows = full if self.est.pad_last_batch and n < full else n
        ids, mask = left_pad(ids, mask, length, rows, self.pad)
        kw = {"pad_token_id": self.pad, **self.kwargs}
        cache = self.cache_for(length, rows)
        with self.est.execution.autocast():
            out = self.model.generate(input_ids=host_result(ids), attention_mask=host_result(mask),
                                      max_new_tokens=self.max_new, past_key_values=cache, **kw)
        if isinstance(out, torch.Tensor):
            seqs = out
        else:  # return_dict_in_generate=True: a ModelOutput holding the sequences
            seqs = out["sequences"]
        new = seqs.cpu()[:n, length:]
        if new.shape[1] < self.max_new:  # every row stopped early
            new = torch.cat([new, new.new_full((n, self.max_new - new.shape[1]), self.pad)], 1)
        return new

    def run(self, loader: Iterable) -> torch.Tensor:
        est = self.est
        full = est._loader_batch_size(loader)
        total = len(loader) if hasattr(loader, "__len__") else None
        bar = _progress(est, total)
        outs: list[torch.Tensor] = []
        t0 = time.perf_counter()
        with set_eager_mode("strict"), torch.no_grad():  # in every mode: see the module docstring
            for raw in loader:
                if full is None:
                    full = batch_size(raw)
                outs.append(self.one(raw, full))
                bar.update(1)
        bar.close()
        if not outs:
            raise ValueError("the generation loader is empty: it yields no batches")
        seconds = time.perf_counter() - t0
        result = torch.cat(outs, 0)
        est.last_generate_stats = {
            "batches": len(outs),
            "prompts": result.shape[0],
            "new_tokens": result.numel(),
            "buckets": sorted(self.caches),
            "seconds": seconds,
            "tokens_per_s": result.numel() / seconds if seconds > 0 else float("nan"),
        }
        return result


def _progress(est: TPUEstimator, total: int | None) -> Any:
    from tqdm.auto import tqdm

    quiet = not est.verbose or not sys.stderr.isatty()
    return tqdm(total=total, desc="generate", disable=quiet, leave=True, unit="batch")
