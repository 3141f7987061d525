"""Lightning: ``Trainer(accelerator="tpu", devices=1)`` trains a LightningModule on the torch_tpu
device (torch_xla absent) with CPU's losses, fp32 and bf16-mixed."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch")

from torch_tpu.integrations.lightning import accelerator_class  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses: list[float] = []
        self.seen: set[str] = set()  # where the steps ran (Lightning moves the model to CPU at teardown)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.seen.update({str(x.device), str(self.net[0].weight.device)})
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(accelerator, precision="32-true"):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    model = Regressor()
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, precision=precision)
    trainer.fit(model, DataLoader(data, batch_size=8))
    return model, trainer


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="with torch_xla, 'tpu' is torch_xla's")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_trainer_accelerator_tpu_matches_cpu(precision):
    mt, tt = fit("tpu", precision)
    mc, _ = fit("cpu", precision)
    assert type(tt.accelerator) is accelerator_class("lightning.pytorch")
    assert tt.strategy.root_device == torch.device("tpu", 0)
    assert mt.seen == {"tpu:0"} and mc.seen == {"cpu"}
    assert len(mt.losses) == 8
    torch.testing.assert_close(torch.tensor(mt.losses), torch.tensor(mc.losses), rtol=1e-4, atol=1e-5)
    for a, b in zip(mt.parameters(), mc.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-4, atol=1e-5)


def test_accelerator_instance_and_registered_name():
    """``accelerator="torch_tpu"`` and an instance also select it (the way in when torch_xla is installed)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    cls = accelerator_class("lightning.pytorch")
    assert AcceleratorRegistry["torch_tpu"]["accelerator"] is cls
    mt, tt = fit(cls())
    assert type(tt.accelerator) is cls and mt.seen == {"tpu:0"}


def test_single_device_strategy_on_tpu():
    """``strategy=SingleDeviceStrategy("tpu")`` with the default ``accelerator="auto"``."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    model = Regressor()
    trainer = L.Trainer(strategy=SingleDeviceStrategy("tpu"), max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
    assert type(trainer.accelerator) is accelerator_class("lightning.pytorch") and model.seen == {"tpu:0"}


def test_more_than_one_device_is_named():
    with pytest.raises(NotImplementedError, match="devices=2"):
        L.Trainer(accelerator="tpu", devices=2, logger=False)
