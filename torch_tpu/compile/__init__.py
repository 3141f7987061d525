"""``torch.compile(backend="tpu")``: Dynamo and AOTAutograd graphs, lowered through the same table."""

from torch_tpu.compile.backend import tpu_backend

__all__ = ["tpu_backend"]
