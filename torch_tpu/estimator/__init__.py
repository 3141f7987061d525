"""TPUEstimator: ``fit``, ``evaluate`` and ``predict`` on the tpu device (see issue 5)."""

from torch_tpu.estimator.estimator import BatchError, Callback, EarlyStopping, TPUEstimator
from torch_tpu.estimator.history import History

__all__ = ["BatchError", "Callback", "EarlyStopping", "History", "TPUEstimator"]
