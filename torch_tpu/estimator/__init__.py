"""TPUEstimator: ``fit``, ``evaluate`` and ``predict`` on the tpu device (see issue 5)."""

from torch_tpu.estimator.estimator import (
    BatchError,
    BatchLoss,
    Callback,
    EarlyStopping,
    LossConfigError,
    ReplayFallback,
    TPUEstimator,
    batch_loss,
)
from torch_tpu.estimator.history import History

__all__ = ["BatchError", "BatchLoss", "Callback", "EarlyStopping", "History", "LossConfigError", "ReplayFallback",
           "TPUEstimator", "batch_loss"]
