"""Autoregressive decoding: transformers' Llama with random weights, on tpu next to CPU PyTorch.

    python -m torch_tpu.bench decode [--new 32] [--prompt 16] [--batch 4] [--modes cpu,fused,compile,strict]

Each mode decodes greedily five times from the same prompt: the first call (a fresh process has
compiled nothing for these shapes) gives the first-token latency and the compiles per token; the
median of the last three, with the same lengths, gives the steady speed. ``--rounds R`` measures
each mode R times beside a CPU run of its own and reports the median ratio. Three loops are
measured:

* ``generate``: ``model.generate(..., cache_implementation="static")``. transformers grows
  ``input_ids`` and the attention mask by one column per token (``torch.cat``), so every new
  length is a new program: XLA needs static shapes.
* ``static``: the same decoding written with fixed shapes, :func:`static_decode`: a
  ``StaticCache``, the position as a tensor, and the tokens written into a preallocated buffer.
  It compiles nothing after the first tokens.
* ``export``: the decoding step exported with its static cache as state (transformers'
  ``convert_and_export_with_cache``, then :func:`torch_tpu.export`), prefilled one token at a
  time and decoded greedily by :func:`export_decode`; the artifact's own program, outside
  PyTorch's dispatcher, as a server runs it. Its mode column is ``export`` (``cpu``: the same
  exported program run by PyTorch on CPU), and its compiles are JAX's, not counted here.

``jax`` is the ceiling (``bench/jax_decode.py``): the same Llama written in JAX, one jitted step per
token with its static cache donated, the prompt fed one position per call; it runs with the
``static`` loop and gives CPU's tokens.

Modes: ``cpu`` (PyTorch eager), ``fused`` and ``strict`` (eager modes), ``compile``
(``model.forward = torch.compile(model.forward, backend="tpu")`` in strict mode) and
``compile-fused`` (the same compiled forward, with generate's own ops outside it in fused mode),
``reduce-overhead`` (``model.forward = torch.compile(model.forward, mode="reduce-overhead")``, the
default backend, as gpt-fast writes it: torch hands a tpu graph to the tpu backend, whose every mode
replays; strict mode outside the forward). Reported per
mode and loop: tokens/s (new tokens of all sequences per second), host ms per token step (process
CPU time, every thread: on an accelerator the device work per token is tiny, so this bounds the
speed), first-token latency (prefill and first token) and programs compiled.

Tokens are timed where they are made: a stopping criterion for ``generate`` (whose own stop check
reads the host at every token, so the criterion adds no sync of its own), the loops' callbacks for
the others (which sync, as nothing else in them does).

Note that transformers compiles the forward itself when the cache is static (its auto-compile), so
``fused`` and ``strict`` run a compiled forward too, through the ``inductor`` name (torch_tpu
serves it, see docs/integrations.md).
"""

from __future__ import annotations

import inspect
import json
import time
import warnings
from typing import Any

import torch

import torch_tpu
from torch_tpu.bench import jax_decode
from torch_tpu.bench.clock import host_ns
from torch_tpu.runtime import metrics as _metrics
from torch_tpu.runtime import target as _target

MODES = ("cpu", "fused", "compile", "compile-fused", "reduce-overhead", "strict", "jax")
# decodes per mode: the first gives the first-token latency and the compiles; the last ``TIMED`` the
# steady speed (their median: a single 32-token call lasts ~50 ms on CPU, short enough for the shared
# machine's hiccups to move it by half). Two warm-ups: the first call compiles, and the second is
# its first repeat, whose compiles ``compiles_after_first_call`` counts with the timed calls' (none:
# a repeat takes the first call's paths, in fused mode its traces, see dispatch/host_placement.py)
TIMED = 3
CALLS = 2 + TIMED


def tiny_llama(layers: int = 2, hidden: int = 128, vocab: int = 256, seed: int = 0) -> Any:
    """transformers' Llama with random weights: no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def llama_1b(seed: int = 0) -> Any:
    """A Llama shaped as Llama-3.2-1B (its sizes: 16 layers, d=2048, 32 heads over 8 key-value
    heads, an 8192-wide MLP, a 128,256-token vocabulary tied to the embedding, rope_theta 500,000),
    with random weights (no download) and the default rotary embedding, not the release's "llama3"
    frequency scaling: the projection needs its shapes, not its outputs. 1.24 billion parameters,
    5 GB in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
        max_position_embeddings=131072,
    )
    return LlamaForCausalLM(config).eval()


MODELS = {"tiny": None, "llama-1b": llama_1b}


def static_decode(model: Any, prompt: torch.Tensor, new_tokens: int, on_token: Any = None,
                  logits_processor: Any = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Decoding with fixed shapes: greedy by default, the same tokens as ``generate(do_sample=False)``.

    Every step has the same shapes: a ``StaticCache`` sized for the whole reply, the position as a
    one-element tensor (a Python int would be a compile-time constant), and the tokens written
    into a buffer of the final length with ``index_copy_`` at that position. ``on_token(step, token)``
    runs after each token is chosen, with the new tokens (a ``[batch, 1]`` tensor): a streamer's host
    read, a stopping check, a timer. (Reading ``buffer[:, step]`` there instead would be a view at
    a Python-int offset: a compile-time constant, a program per step.)

    With ``generator`` it samples (``torch.multinomial``) from the scores that ``logits_processor``
    (transformers' ``LogitsProcessorList``: temperature, top-k, ...) makes of the logits; the
    processors see the whole fixed-size buffer as ``input_ids``, zeros past the current token."""
    from transformers import StaticCache

    batch, length = prompt.shape
    device = prompt.device
    cache = StaticCache(config=model.config, max_cache_len=length + new_tokens)
    out = torch.zeros(batch, length + new_tokens, dtype=prompt.dtype, device=device)
    out[:, :length] = prompt
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # renamed in 5.x
    with torch.no_grad():
        logits = model(input_ids=prompt, **{name: cache}, use_cache=True,
                       cache_position=torch.arange(length, device=device)).logits
        token = _choose(logits, out, logits_processor, generator)
        position = torch.tensor([length], device=device)
        for step in range(new_tokens):
            out.index_copy_(1, position, token)
            if on_token is not None:
                on_token(step, token)
            if step + 1 == new_tokens:
                break
            logits = model(input_ids=token, **{name: cache}, use_cache=True, cache_position=position).logits
            token = _choose(logits, out, logits_processor, generator)
            position = position + 1
    return out


def export_step(model: Any, batch: int, max_len: int) -> Any:
    """The model's one-token decoding step exported with a static cache of ``max_len`` positions:
    the ``torch.export`` program (transformers' recipe), whose cache buffers are its state."""
    from transformers.integrations.executorch import convert_and_export_with_cache

    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": batch, "max_cache_len": max_len}
    with torch.no_grad():
        return convert_and_export_with_cache(model, torch.zeros(batch, 1, dtype=torch.long), torch.tensor([0]))


def export_decode(step: Any, prompt: torch.Tensor, new_tokens: int, on_token: Any = None) -> torch.Tensor:
    """Greedy decoding through an exported step ``step(input_ids=[batch, 1], cache_position=[1])``
    (a :func:`torch_tpu.export` artifact, or the ``torch.export`` module on CPU): the prompt one
    position per call, then one token per call. Returns the new tokens."""
    length = prompt.shape[1]
    with torch.no_grad():
        for i in range(length):
            logits = step(input_ids=prompt[:, i:i + 1], cache_position=torch.tensor([i]))
        tokens = []
        for i in range(new_tokens):
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
            if on_token is not None:
                on_token(i, tokens[-1])
            if i + 1 < new_tokens:
                logits = step(input_ids=tokens[-1], cache_position=torch.tensor([length + i]))
    return torch.cat(tokens, 1)


def _choose(logits: torch.Tensor, ids: torch.Tensor, processor: Any, generator: torch.Generator | None) -> Any:
    scores = logits[:, -1].float()
    if processor is not None:
        scores = processor(ids, scores)
    if generator is None:
        return scores.argmax(-1, keepdim=True)
    return torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)


def _compiles() -> int:
    """Programs compiled so far, with what is still recorded run first (``metrics()`` settles)."""
    return torch_tpu.metrics()["compile_count"]


def _compiled_so_far() -> int:
    """Programs compiled so far, without running what is recorded: a token's mark must not add a
    sync that the user's loop does not have (``metrics()`` would run the pending trace at every
    token, a flush more per token in fused mode). What is pending is counted at a later mark or
    at the settled count after the call."""
    return _metrics.compile_totals[0]


class _Clock:
    """Marks the time, CPU time and compile count at each token (a stopping criterion's call, or
    ``static_decode``'s ``on_token``), reading the token count on the host so each step ends there."""

    def __init__(self, device: str, sync: bool = True) -> None:
        self.device = device
        self.sync = sync
        self.marks: list[tuple[float, float, int]] = []

    def mark(self) -> None:
        if self.device == "tpu" and self.sync:
            torch_tpu.sync()
        self.marks.append((time.perf_counter(), time.process_time(), _compiled_so_far() if self.device == "tpu" else 0))


def _run(model: Any, loop: str, prompt: torch.Tensor, new: int, clock: _Clock) -> torch.Tensor:
    if isinstance(model, jax_decode.Decoder):  # each token read on the host where it is made
        return model.decode(prompt, new, on_token=lambda step, token: (token.block_until_ready(), clock.mark()))
    if loop == "export":
        if hasattr(model, "reset_state"):
            model.reset_state()  # a fresh request: the exported cache empty again
        return export_decode(model, prompt, new, on_token=lambda step, token: clock.mark())
    if loop == "static":
        return static_decode(model, prompt, new, on_token=lambda step, token: clock.mark())
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Mark(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            clock.mark()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                              cache_implementation="static", stopping_criteria=StoppingCriteriaList([Mark()]))


def measure(mode: str, loop: str = "generate", new: int = 32, prompt_len: int = 16, batch: int = 4,
            layers: int = 2, hidden: int = 128, target: str | None = None, model: str = "tiny") -> dict:
    """One mode and loop: two decodes from the same prompt (see the module docstring). ``target``
    (a TPU chip, tpu modes and the export loop): every program of the run is also compiled for it,
    and the row gains a ``"target"`` object projecting the timed calls' tokens on that chip."""
    if target is None or mode == "cpu":
        return _measure(mode, loop, new, prompt_len, batch, layers, hidden, None, model)
    with torch_tpu.set_target(target):
        return _measure(mode, loop, new, prompt_len, batch, layers, hidden, target, model)


def _measure(mode: str, loop: str, new: int, prompt_len: int, batch: int, layers: int, hidden: int,
             target: str | None, model_name: str = "tiny") -> dict:
    # each mode compiles a fresh model: without a reset, Dynamo keeps every earlier mode's entries
    # for the same forward code, checks their guards at each call, and past its recompile limit runs
    # the forward eagerly, so a mode's figure would depend on the modes measured before it
    torch._dynamo.reset()
    if model_name not in MODELS:
        raise ValueError(f"model {model_name!r}: expected one of {', '.join(MODELS)}")
    make = MODELS[model_name]
    model = tiny_llama(layers, hidden) if make is None else make()
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    if loop == "export":
        if mode not in ("cpu", "export"):
            raise ValueError(f"the export loop runs in mode 'export' (the artifact) or 'cpu', not {mode!r}")
        step = export_step(model, batch, prompt_len + new)
        model = step.module() if mode == "cpu" else torch_tpu.export(step)
    if mode == "jax":
        if loop != "static":
            raise ValueError(f"the jax mode (the ceiling) decodes with fixed shapes: loop 'static', not {loop!r}")
        watch = None
        if target:
            def watch(run: Any, fn: Any, donated: tuple) -> Any:
                return _target.watch(run, kind="jax", name="jax decode step", fn=fn, ops=["jax decode step"],
                                     site=lambda: None, donate=donated)
        model = jax_decode.Decoder(model, batch, prompt_len + new, watch)
    device = "cpu" if mode in ("cpu", "export", "jax") else "tpu"
    previous = torch_tpu.get_eager_mode()
    if device == "tpu":
        model = model.to("tpu")
        prompt = prompt.to("tpu")
        if mode.startswith("compile"):
            model.forward = torch.compile(model.forward, backend="tpu")
        elif mode == "reduce-overhead":
            model.forward = torch.compile(model.forward, mode="reduce-overhead")
        torch_tpu.set_eager_mode("fused" if mode.endswith("fused") else "strict")
    try:
        runs = []
        for call in range(CALLS):
            if call == CALLS - TIMED:  # the timed calls begin: what the target projects
                snap, host0 = _target.snapshot() if target else {}, host_ns()
            clock = _Clock(device, sync=loop != "generate")
            start = (time.perf_counter(), time.process_time(), _compiles() if device == "tpu" else 0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tokens = _run(model, loop, prompt, new, clock)
            tokens = tokens.cpu()
            # settled after the call: what the last marks left pending (the last step's) is counted
            end = _compiles() if device == "tpu" else 0
            runs.append((start, clock.marks, tokens, end))
        host_s = (host_ns() - host0) / 1e9
    finally:
        if device == "tpu":
            torch_tpu.set_eager_mode(previous)
    (start0, marks0, tokens, end0), (_, marks1, _, end1) = runs[0], runs[-1]
    timed = []
    for _, marks, _, _ in runs[-TIMED:]:
        steady = marks[1:]  # token 2 onwards: the steady per-token step
        timed.append((steady[-1][0] - steady[0][0], steady[-1][1] - steady[0][1], len(steady) - 1))
    seconds, cpu, steps = sorted(timed)[len(timed) // 2]
    first = marks0[0]
    later = marks0[min(8, len(marks0) - 1)]
    row = {
        "mode": mode, "loop": loop, "tokens_per_s": round(batch * steps / seconds, 1),
        "host_ms_per_token": round(1000 * cpu / steps, 2), "wall_ms_per_token": round(1000 * seconds / steps, 2),
        "first_token_s": round(first[0] - start0[0], 3),
        "first_call_s": round(marks0[-1][0] - start0[0], 2),
        # torch_tpu's counts; None for the export loop, whose program JAX compiles
        "compiles_first_call": None if device != "tpu" else end0 - start0[2],
        "compiles_after_token_8": None if device != "tpu" else end0 - later[2],
        "compiles_last_call": None if device != "tpu" else end1 - marks1[0][2],
        "compiles_after_first_call": None if device != "tpu" else sum(e - st[2] for st, _, _, e in runs[1:]),
        "tokens": tokens,
    }
    if target:
        # per token step of the timed calls, their prefill included: the device's time from the
        # programs they ran as XLA:TPU compiled them, the host's measured here (this thread and
        # autograd's, not XLA:CPU's compute threads)
        token_steps = TIMED * new
        t = _target.since(snap, token_steps, host_s / token_steps)
        t["projected_tokens_per_s"] = batch * t["projected_steps_per_s"]
        row["target"] = {k: round(v, 6) if isinstance(v, float) else v for k, v in t.items()}
    return row


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def table(modes: list[str], loops: list[str], rounds: int = 1, json_rows: bool = False, **kw: Any) -> list[dict]:
    """Every mode and loop in one process, CPU first; prints a table (``json_rows``: also a JSON
    object per row), returns the rows.

    ``rounds`` > 1 measures each mode that many times, each right after a CPU run of its own, and
    reports the round with the median ratio: a shared machine's speed drifts (by up to 1.6x within
    minutes here), so a ratio is only sound against CPU measured beside it."""
    rows = []
    cpu: dict[str, dict] = {}
    print("| loop | mode | tokens/s | x CPU | host ms/token | wall ms/token | first token s | first call s "
          "| compiles (first call) | compiles after token 8 | same tokens as CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for loop in loops:
        # the export loop has two modes of its own: the artifact, and its program on CPU
        for mode in (("cpu", "export") if loop == "export" else modes):
            if loop == "export" and "cpu" not in modes and mode == "cpu":
                continue
            if mode == "jax" and loop != "static":  # the ceiling is a fixed-shape loop
                continue
            if mode == "cpu":
                r = ref = cpu[loop] = measure(mode, loop, **kw)
                ratios = [1.0]
            else:
                measured = []
                for _ in range(rounds):
                    ref = measure("cpu", loop, **kw) if rounds > 1 else cpu.get(loop)
                    r = measure(mode, loop, **kw)
                    measured.append((r["tokens_per_s"] / ref["tokens_per_s"] if ref else 0.0, r, ref))
                measured.sort(key=lambda m: m[0])
                ratios = [m[0] for m in measured]
                _, r, ref = measured[len(measured) // 2]
            ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-"
            if len(ratios) > 1:
                ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
            same = "-" if ref is None or mode == "cpu" else str(torch.equal(r["tokens"], ref["tokens"]))
            print(f"| {loop} | {mode} | {r['tokens_per_s']} | {ratio} | {r['host_ms_per_token']} | "
                  f"{r['wall_ms_per_token']} | {r['first_token_s']} | {r['first_call_s']} | "
                  f"{_count(r['compiles_first_call'])} | {_count(r['compiles_after_token_8'])} | {same} |", flush=True)
            r["same_tokens_as_cpu"] = None if same == "-" else same == "True"
            if json_rows:
                print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
            rows.append(r)
    projected = [r for r in rows if r.get("target")]
    if projected:
        t0 = projected[0]["target"]
        print(f"\nprojected on {t0['chip']} (per token step of the timed calls, prefill included):")
        print("| loop | mode | device ms | host ms | tokens/s | bound | peak HBM MiB | failed programs |")
        print("|---|---|---|---|---|---|---|---|")
        for r in projected:
            t = r["target"]
            print(f"| {r['loop']} | {r['mode']} | {t['device_ms_per_step']:.4f} ({t['device_ms_source']}) | "
                  f"{t['host_ms_per_step']:.3f} | {t['projected_tokens_per_s']:.0f} | {t['bound']} | "
                  f"{t['peak_hbm_bytes'] / 2**20:.1f} | {t['failed_programs']} |")
    return rows
