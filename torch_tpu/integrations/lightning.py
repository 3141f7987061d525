"""Lightning: ``Trainer(accelerator="tpu", devices=1)`` trains on the torch_tpu device.

Lightning's own "tpu" accelerator is torch_xla's (``XLAAccelerator``). When torch_xla is not
installed, :class:`TPUAccelerator` (built from whichever of ``lightning.pytorch`` and
``pytorch_lightning`` is imported) is registered under "tpu"; it is always registered under
"torch_tpu", and an instance can be passed as ``Trainer(accelerator=TPUAccelerator())``, so with
torch_xla installed the user chooses.

Two things Lightning decides from the accelerator's *name* rather than through the registry:
``_AcceleratorConnector._choose_strategy`` builds torch_xla's ``SingleDeviceXLAStrategy`` for
"tpu", and ``_check_and_init_precision`` runs mixed precision under CUDA's autocast for every
accelerator but cpu and mps. For our accelerator both are wrapped to give a plain
``SingleDeviceStrategy`` on ``tpu:0`` and autocast on "tpu"; every other accelerator keeps
Lightning's choice. ``accelerator="auto"`` keeps Lightning's order (torch_xla, MPS, CUDA, CPU):
there is no public way to join it, so a user writes ``accelerator="tpu"``; only a strategy the
user placed on tpu (``strategy=SingleDeviceStrategy("tpu")``) makes "auto" pick this accelerator,
where Lightning would pick CPU and then reject the strategy's device.

Installed by a post-import hook (``_torch_tpu_autoload``) when the connector module finishes
importing; Lightning is never imported by torch_tpu itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any

import torch

_classes: dict[str, type] = {}


def _torch_xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def _tpu_count(devices: Any) -> int:
    """``devices`` as Lightning accepts it (int, "auto", "1", [0]) as a count of tpu devices."""
    if devices == "auto" or devices == -1 or devices == "-1":
        return 1
    if isinstance(devices, str):
        devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    if isinstance(devices, (list, tuple)):
        if list(devices) != [0]:
            raise NotImplementedError(f"Trainer(accelerator='tpu', devices={devices!r}): torch_tpu's Lightning "
                                      "accelerator runs on tpu:0 only (devices=1)")
        return 1
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"Trainer(accelerator='tpu', devices={devices!r}): expected a positive number of devices")
    if devices > 1:
        raise NotImplementedError(
            f"Trainer(accelerator='tpu', devices={devices}): torch_tpu's Lightning accelerator runs on one device "
            "(devices=1); tensors live on tpu:0, and more devices are used through torch_tpu.distributed sharding")
    return devices


def accelerator_class(prefix: str = "lightning.pytorch") -> type:
    """The tpu ``Accelerator`` subclass for ``prefix`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    if prefix in _classes:
        return _classes[prefix]
    base = importlib.import_module(f"{prefix}.accelerators").Accelerator

    class TPUAccelerator(base):  # type: ignore[misc, valid-type]
        """torch_tpu's device (XLA through JAX) for Lightning; not torch_xla's."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != "tpu":
                raise ValueError(f"TPUAccelerator: device should be tpu, got {device} instead")
            torch.tpu.set_device(device)

        def get_device_stats(self, device: Any) -> dict[str, Any]:
            """XLA's memory statistics; none where the platform keeps none (XLA:CPU)."""
            try:
                return dict(torch.tpu.memory_stats(device))
            except RuntimeError:
                return {}

        def teardown(self) -> None:
            pass

        @staticmethod
        def parse_devices(devices: Any) -> int:
            return _tpu_count(devices)

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            return [torch.device("tpu", i) for i in range(_tpu_count(devices))]

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def is_available() -> bool:
            return torch.tpu.is_available()

        @staticmethod
        def name() -> str:
            return "tpu"

        @classmethod
        def register_accelerators(cls, accelerator_registry: Any) -> None:
            accelerator_registry.register("torch_tpu", cls, description=cls.__doc__, override=True)
            if not _torch_xla_installed():
                accelerator_registry.register("tpu", cls, description=cls.__doc__, override=True)

    TPUAccelerator.__module__ = __name__
    TPUAccelerator.__qualname__ = "TPUAccelerator"
    _classes[prefix] = TPUAccelerator
    return TPUAccelerator


def _wrap_connector(connector_module: types.ModuleType, prefix: str, cls: type) -> None:
    connector = connector_module._AcceleratorConnector
    if getattr(connector, "_torch_tpu", False):
        return
    strategies = importlib.import_module(f"{prefix}.strategies")
    precision_module = importlib.import_module(f"{prefix}.plugins.precision")
    choose_strategy = connector._choose_strategy
    init_precision = connector._check_and_init_precision
    choose_auto = connector._choose_auto_accelerator  # a staticmethod: the plain function

    def _choose_auto_accelerator(self: Any = None) -> str:
        """``accelerator="auto"`` with a strategy the user put on tpu (``SingleDeviceStrategy("tpu")``)."""
        device = getattr(getattr(self, "_strategy_flag", None), "_root_device", None)
        if isinstance(device, torch.device) and device.type == "tpu":
            return "torch_tpu"
        return choose_auto()

    def _choose_strategy(self: Any) -> Any:
        if isinstance(getattr(self, "accelerator", None), cls) and self._num_nodes_flag == 1:
            return strategies.SingleDeviceStrategy(device=self._parallel_devices[0])
        return choose_strategy(self)

    def _check_and_init_precision(self: Any) -> Any:
        plugin = init_precision(self)
        if isinstance(self.accelerator, cls) and type(plugin) is precision_module.MixedPrecision:
            return precision_module.MixedPrecision(self._precision_flag, "tpu")
        return plugin

    connector._choose_strategy = _choose_strategy
    connector._choose_auto_accelerator = _choose_auto_accelerator
    connector._check_and_init_precision = _check_and_init_precision
    connector._torch_tpu = True


def install(connector_module: types.ModuleType) -> None:
    """Registers :class:`TPUAccelerator` and adapts the connector (idempotent)."""
    prefix = connector_module.__name__.split(".trainer.", 1)[0]
    cls = accelerator_class(prefix)
    cls.register_accelerators(importlib.import_module(f"{prefix}.accelerators").AcceleratorRegistry)
    _wrap_connector(connector_module, prefix, cls)
