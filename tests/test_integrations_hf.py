"""Hugging Face: ``transformers.Trainer`` with default ``TrainingArguments`` and
``accelerate.Accelerator()`` train on tpu with CPU's losses, with nothing but torch_tpu installed
(tiny random GPT-2, nothing downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8):
        self.ids = torch.randint(0, 97, (n, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(tmp_path, use_cpu: bool) -> tuple[list[float], torch.device]:
    AcceleratorState._reset_state(reset_partial_state=True)
    model = gpt2()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / ("cpu" if use_cpu else "tpu")),
                                          per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                                          report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=use_cpu)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, next(model.parameters()).device


def test_trainer_with_default_arguments_trains_on_tpu_like_cpu(tmp_path):
    tpu_losses, tpu_device = train(tmp_path, use_cpu=False)
    cpu_losses, cpu_device = train(tmp_path, use_cpu=True)
    assert tpu_device.type == "tpu" and cpu_device.type == "cpu"
    assert len(tpu_losses) == 3
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-4)


def accelerate_losses(cpu: bool) -> tuple[list[float], torch.device]:
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=cpu)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for b in loader:
        loss = model(**b).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, acc.device


def test_accelerator_picks_tpu_and_trains_like_cpu():
    tpu_losses, tpu_device = accelerate_losses(cpu=False)
    cpu_losses, cpu_device = accelerate_losses(cpu=True)
    assert tpu_device.type == "tpu" and cpu_device.type == "cpu"
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-4)


def test_accelerate_env_variable_still_wins():
    """``ACCELERATE_TORCH_DEVICE``, accelerate's own switch, is left in charge."""
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    try:
        assert accelerate.Accelerator().device == torch.device("cpu")
    finally:
        del os.environ["ACCELERATE_TORCH_DEVICE"]


def test_accelerator_with_explicit_import_and_autoload_off():
    """Without autoload, ``import torch_tpu`` (after accelerate here) is what installs the integration."""
    script = ("import accelerate.state, torch, torch_tpu, accelerate\n"
              "print(accelerate.Accelerator().device)\n")
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TORCH_TPU_CACHE_DIR": "off"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "tpu"


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
                    reason="shared weights are found by data_ptr(), which needs torch >= 2.13 on tpu")
def test_save_pretrained_from_tpu_round_trips(tmp_path):
    """``save_pretrained`` finds tied weights by their storages' ``data_ptr()`` and sizes: on tpu
    every weight once looked shared with every other of its size, and saving raised. GPT-2 ties its
    head to its embedding, so the tie must survive and nothing else may be taken for one."""
    from safetensors.torch import load_file, save_model

    model = gpt2().to("tpu")
    reference = {k: v.cpu() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    save_model(model, str(tmp_path / "plain.safetensors"))  # safetensors' own shared-tensor check
    saved = load_file(str(tmp_path / "plain.safetensors"))
    assert len(saved) == len(reference) - 1  # the tied head is stored once
    for name, value in saved.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
