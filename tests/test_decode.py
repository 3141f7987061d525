"""Decoding with transformers on tpu: the same tokens as CPU, and a fixed-shape decoding step that
compiles nothing per token."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_tpu
from torch_tpu.bench import decode
from torch_tpu.bench.decode import static_decode, tiny_llama
from torch_tpu.runtime import cache

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, hidden=64)


def _prompt(batch=2, length=6):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(3))


def _on_tpu(model, compiled):
    m = tiny_llama(layers=2, hidden=64)
    m.load_state_dict(model.state_dict())
    m = m.to("tpu")
    if compiled:
        m.forward = torch.compile(m.forward, backend="tpu")
    return m


@pytest.mark.parametrize("implementation", [None, "static"])
def test_greedy_generate_gives_cpus_tokens(model, implementation):
    prompt = _prompt()
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation=implementation)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(prompt, **kw)
        got = _on_tpu(model, compiled=False).generate(prompt.to("tpu"), **kw)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-forward"])
def test_a_static_decoding_loop_compiles_nothing_between_the_8th_and_32nd_token(model, compiled):
    """The first call: after the first tokens every step is one program already compiled, in the
    eager mode in force (fused or strict) and with a compiled forward. The tokens are CPU's."""
    prompt = _prompt(batch=2, length=8)
    m = _on_tpu(model, compiled)
    counts = []

    def on_token(step, token):
        torch_tpu.sync()  # a host read per token, as a streamer does
        counts.append(torch_tpu.metrics()["compile_count"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = static_decode(m, prompt.to("tpu"), 32, on_token=on_token)
        expected = static_decode(model, prompt, 32)
    assert counts[31] - counts[7] == 0, counts
    assert torch.equal(got.cpu(), expected)


def test_sampling_with_logits_processors_and_a_stopping_check_stays_bounded(model):
    """Temperature and top-k, multinomial sampling from a seeded generator, and a host stopping check
    per token (an end-of-sequence test): nothing compiles between the 8th and 32nd token."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    m = _on_tpu(model, compiled=False)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    generator = torch.Generator().manual_seed(0)  # a CPU generator stands in for a tpu one (see _rng)
    counts, stopped = [], []

    def on_token(step, token):
        stopped.append(bool((token == 255).all()))  # an end-of-sequence check, read on the host
        counts.append(torch_tpu.metrics()["compile_count"])

    prompt = _prompt(batch=2, length=8).to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = static_decode(m, prompt, 32, on_token=on_token, logits_processor=processors, generator=generator)
    assert counts[31] - counts[7] == 0, counts
    assert len(stopped) == 32
    # top-5 sampling: every token is among the 5 highest scores CPU gives at its position
    logits = model(got.cpu()).logits[:, 7:-1]
    top5 = logits.topk(5, dim=-1).indices
    assert (top5 == got.cpu()[:, 8:, None]).any(-1).all()


def _generate_counting(m, prompt, new, **kw):
    """generate() of ``new`` tokens, with the compile count at each token (a stopping criterion
    that reads nothing)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    counts = []

    class Count(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            counts.append(torch_tpu.metrics()["compile_count"])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                         pad_token_id=0,
                         cache_implementation="static", stopping_criteria=StoppingCriteriaList([Count()]), **kw)
    return out, counts


@pytest.mark.parametrize("how", ["default", "no-auto-compile", "compiled-forward"])
def test_generate_compiles_nothing_between_the_8th_and_32nd_token(model, how):
    """The first generate() call with a static cache: transformers' own decoding loop, unchanged.
    The ids and the mask that grow by a column per token are small integer tensors whose shapes are
    new at every call, so after a few lengths their ops run on the host (torch_tpu.dispatch.host_placement)
    and every program the step needs is already compiled. Greedy tokens are CPU's."""
    prompt = _prompt(batch=2, length=8)
    kw = dict(do_sample=False)
    if how == "no-auto-compile":
        kw["disable_compile"] = True
    m = _on_tpu(model, compiled=how == "compiled-forward")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, min_new_tokens=32,
                                  pad_token_id=0, do_sample=False)
    got, counts = _generate_counting(m, prompt.to("tpu"), 32, **kw)
    assert len(counts) == 32
    assert counts[31] - counts[7] == 0, counts
    assert torch.equal(got.cpu(), expected)
    assert torch_tpu.metrics()["host_op_counts"].get("aten.cat.default", 0) > 0


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_after_a_short_warm_up_a_long_generate_compiles_nothing(model, mode):
    """A static cache of a fixed size, made whole before the first call and reset between calls: a
    4-token call, then a 32-token one that compiles nothing. Its first tokens take the warm-up's
    paths: a line whose shapes were found to grow runs on the host also where another line compiled
    the call's signature (positions and the mask grow through cats of the same shapes); in fused
    mode a call that line recorded on the device before is recorded again, so the long call's
    prefill and first tokens make the warm-up's traces. Greedy tokens are CPU's."""
    from transformers import StaticCache

    prompt = _prompt(batch=2, length=8)
    m = _on_tpu(model, compiled=False)
    cfg = m.config
    cache = StaticCache(config=cfg, max_cache_len=48)
    cache.early_initialization(2, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, torch.float32,
                               torch.device("tpu"))
    previous = torch_tpu.get_eager_mode()
    torch_tpu.set_eager_mode(mode)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            counts = []
            for n in (4, 32):
                cache.reset()
                counts.append(torch_tpu.metrics()["compile_count"])
                got = m.generate(prompt.to("tpu"), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, past_key_values=cache)
                counts.append(torch_tpu.metrics()["compile_count"])
            expected = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    finally:
        torch_tpu.set_eager_mode(previous)
    assert counts[3] - counts[2] == 0, counts
    assert torch.equal(got.cpu(), expected)


def test_sampling_generate_with_logits_processors_stays_bounded(model):
    """Sampling with temperature and top-k and a seeded generator: bounded too, and every token is
    one of the 5 CPU scores highest at its position."""
    m = _on_tpu(model, compiled=False)
    prompt = _prompt(batch=2, length=8)
    torch.manual_seed(0)
    got, counts = _generate_counting(m, prompt.to("tpu"), 32, do_sample=True, temperature=0.7, top_k=5)
    assert counts[31] - counts[7] == 0, counts
    with torch.no_grad():
        logits = model(got.cpu()).logits[:, 7:-1]
    logits[..., model.config.eos_token_id] = float("-inf")  # min_new_tokens rules the end of sequence out
    top5 = logits.topk(5, dim=-1).indices
    assert (top5 == got.cpu()[:, 8:, None]).any(-1).all()


def test_without_the_host_path_generate_names_the_growing_sequence_as_the_cause(model, monkeypatch):
    """With TORCH_TPU_HOST_CHURN=0, generate() extends input_ids and the attention mask by one
    column per token (torch.cat): with static shapes that is a program per length, even with a
    static cache. The reasons and the warning say so, and point at the fix."""
    from torch_tpu.dispatch import host_placement as _host_placement

    monkeypatch.setattr(_host_placement, "CHURN_AFTER", 0)
    monkeypatch.setattr(cache, "RECOMPILE_WARN", 4)
    cache._warned_sites.clear()
    cache._site_recompiles.clear()
    before = len(cache.recompiles)
    m = _on_tpu(model, compiled=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.generate(_prompt().to("tpu"), max_new_tokens=7, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
    reasons = [r.reason for r in cache.recompiles[before:]]
    assert reasons and all("grows every step" in r or "grew by one" in r for r in reasons[-3:]), reasons
    messages = [str(c.message) for c in caught if "recompiled" in str(c.message)]
    assert messages and "static cache" in messages[0], messages


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_generate_with_a_dynamic_cache_warns_that_the_kv_cache_grows_and_names_the_fix(model, monkeypatch, mode):
    """The default (dynamic) cache grows the keys and values by one position per token, so every
    token compiles the model step again: the warning names the growth and points at a static
    cache, and the tokens are still CPU's."""
    monkeypatch.setattr(cache, "RECOMPILE_WARN", 4)
    cache._warned_sites.clear()
    cache._site_recompiles.clear()
    m = _on_tpu(model, compiled=False)
    prompt = _prompt(batch=3)  # a batch size no other test here decodes: its programs are new
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(prompt, **kw)
    with torch.no_grad(), torch_tpu.set_eager_mode(mode), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = m.generate(prompt.to("tpu"), **kw).cpu()
    assert torch.equal(got, want)
    messages = [str(c.message) for c in caught if "recompiled" in str(c.message)]
    assert messages, [str(c.message) for c in caught]
    assert any("KV cache" in t and "cache_implementation='static'" in t for t in messages), messages


def test_an_exported_decoding_step_keeps_its_static_cache_as_state(model, tmp_path):
    """transformers' export recipe (a StaticCache registered as buffers, written every step):
    the artifact carries the cache as state, so prefill and greedy decoding through it, then
    through the saved artifact run by JAX alone, give the tokens and logits that the same
    exported program gives run by PyTorch on CPU."""
    import numpy as np
    from transformers.integrations.executorch import convert_and_export_with_cache

    prompt, new = _prompt(batch=2, length=4), 5
    m = tiny_llama(layers=2, hidden=64)
    m.load_state_dict(model.state_dict())
    m.generation_config.cache_implementation = "static"
    m.generation_config.cache_config = {"batch_size": 2, "max_cache_len": 4 + new}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = convert_and_export_with_cache(m, torch.zeros(2, 1, dtype=torch.long), torch.tensor([0]))
    art = torch_tpu.export(ep)
    assert {"key_cache_0", "value_cache_1"} <= set(art.state_names)

    def decode(step):  # the prompt token by token, then greedy: the tokens and every step's logits
        logits = []
        for i in range(4):
            logits.append(step(prompt[:, i:i + 1], torch.tensor([i])))
        tokens = []
        for i in range(new):
            tokens.append(logits[-1][:, -1].argmax(-1, keepdim=True))
            logits.append(step(tokens[-1], torch.tensor([4 + i])))
        return torch.cat(tokens, 1), torch.stack(logits)

    cpu_module = ep.module()
    with torch.no_grad():
        want, want_logits = decode(lambda ids, pos: cpu_module(input_ids=ids, cache_position=pos))

    def check(step):
        tokens, logits = decode(step)
        assert tokens.tolist() == want.tolist()
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)

    check(lambda ids, pos: art(input_ids=ids, cache_position=pos))
    assert art.state()["key_cache_0"].abs().sum() > 0  # the cache was written
    art.reset_state()
    assert art.state()["key_cache_0"].abs().sum() == 0
    check(lambda ids, pos: art(input_ids=ids, cache_position=pos))

    art.save(tmp_path)
    run = torch_tpu.load(tmp_path)
    assert [s["name"] for s in run.meta["state"]] == art.state_names
    check(lambda ids, pos: torch.from_numpy(np.asarray(run(ids.numpy(), pos.numpy()))))
    run.reset()
    check(lambda ids, pos: torch.from_numpy(np.asarray(run(ids.numpy(), pos.numpy()))))


def test_export_refuses_a_forward_that_changes_its_input_in_place():
    class Accumulate(torch.nn.Module):
        def forward(self, total, x):
            total.add_(x)
            return total * 2

    with pytest.raises(NotImplementedError, match="USER_INPUT_MUTATION"):
        torch_tpu.export(Accumulate(), (torch.zeros(3), torch.ones(3)))


def test_the_decode_bench_export_loop_gives_the_exported_programs_tokens_on_cpu():
    kw = dict(new=3, prompt_len=2, batch=2, layers=1, hidden=32)
    served, on_cpu = decode.measure("export", "export", **kw), decode.measure("cpu", "export", **kw)
    assert served["tokens"].shape == (2, 3)
    assert torch.equal(served["tokens"], on_cpu["tokens"])
    assert served["compiles_first_call"] is None  # JAX compiles the artifact: not torch_tpu's count
    with pytest.raises(ValueError, match="export loop runs in mode 'export'"):
        decode.measure("fused", "export", **kw)


def test_the_decode_bench_jax_mode_is_the_same_llama_with_cpus_tokens(capsys):
    """``bench decode --modes jax``: the ceiling, the same Llama written in JAX with a donated static
    cache, gives CPU's greedy tokens on the fixed-shape loop (and runs no other loop); ``--json``
    prints each row as one object with the fields a report reads."""
    import json

    rows = decode.table(["cpu", "jax"], ["static", "generate"], json_rows=True, new=6, prompt_len=4, batch=2,
                        layers=1, hidden=32)
    by = {(r["loop"], r["mode"]): r for r in rows}
    assert set(by) == {("static", "cpu"), ("static", "jax"), ("generate", "cpu")}
    jax_row = by[("static", "jax")]
    assert torch.equal(jax_row["tokens"], by[("static", "cpu")]["tokens"]) and jax_row["same_tokens_as_cpu"]
    assert jax_row["compiles_after_first_call"] is None  # JAX's compiles, not torch_tpu's
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(p["loop"], p["mode"]) for p in printed] == [("static", "cpu"), ("static", "jax"), ("generate", "cpu")]
    for p in printed:
        assert {"loop", "mode", "tokens_per_s", "host_ms_per_token", "compiles_after_first_call",
                "same_tokens_as_cpu"} <= set(p)
    with pytest.raises(ValueError, match="fixed shapes"):
        decode.measure("jax", "generate", new=2, prompt_len=2, batch=1)


def test_the_decode_bench_reduce_overhead_mode_replays_with_cpus_tokens():
    """``bench decode --modes reduce-overhead``: the forward under ``torch.compile(mode=
    "reduce-overhead")`` with the default backend (gpt-fast's form) decodes CPU's tokens on both
    loops and compiles nothing after its first call."""
    rows = decode.table(["cpu", "reduce-overhead"], ["static", "generate"], new=6, prompt_len=4, batch=2,
                        layers=1, hidden=32)
    by = {(r["loop"], r["mode"]): r for r in rows}
    for loop in ("static", "generate"):
        row = by[(loop, "reduce-overhead")]
        assert torch.equal(row["tokens"], by[(loop, "cpu")]["tokens"]) and row["same_tokens_as_cpu"]
        assert row["compiles_after_first_call"] == 0


def test_the_llama_1b_config_has_llama_3_2_1b_s_shapes():
    """``bench decode --model llama-1b``: Llama-3.2-1B's sizes (built on the meta device here: its
    5 GB of random weights are the bench's to make), its 1,235,814,400 parameters, tied head."""
    with torch.device("meta"):
        m = decode.llama_1b()
    assert sum(p.numel() for p in m.parameters()) == 1_235_814_400
    assert m.lm_head.weight is m.model.embed_tokens.weight
    c = m.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (16, 2048, 32, 8)
