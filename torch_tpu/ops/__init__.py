"""The lowering table, one module per op family. Importing this package fills ``LOWERINGS``."""

from torch_tpu.ops import (  # noqa: F401  (imported for their registrations)
    amp,
    closeness,
    conv,
    elementwise,
    factories,
    fft,
    graph,
    indexing,
    linalg,
    nn,
    optim,
    random,
    reduction,
    shape,
    special,
    transformer,
)
from torch_tpu.ops._registry import LOWERINGS, Lowering, lower

graph.register_foreach()  # after every single-tensor lowering is in the table

__all__ = ["LOWERINGS", "Lowering", "lower"]
