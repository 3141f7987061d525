"""What a failing op raises: its own exception type, with the op named.

A lowering's check raises CPU's exception (``IndexError``, ``ValueError``...); JAX raises its own.
Either may surface at the op (strict mode) or at a later sync point (a fused trace, a deferred
graph). Every runtime module re-raises through :func:`raise_named`, so the user's ``except`` clause
sees the type CPU raises, and the message still says which op failed and where it was recorded.
This module imports nothing of the runtime, so each layer can use it.
"""

from __future__ import annotations

# Exception classes raised by the code a program runs: Python's own (a lowering's checks raise
# CPU's IndexError, ValueError...), and torch's, JAX's and ours. Any other class (a test's
# timeout raised by a signal handler, a user's exception) is not an op's failure: it passes
# through untouched.
_OUR_MODULES = frozenset(("builtins", "jax", "jaxlib", "torch", "torch_tpu", "numpy"))


def named_error(e: BaseException, where: str) -> BaseException:
    """``e``'s own type with ``where`` (the op and its input signature, and for an error found at
    a later sync point the user's line that called the op) leading its message, so that a user's
    ``except IndexError:`` works as on CPU and the message still says which op failed. Returns
    ``e`` itself, with ``where`` as a note, when the type can't be rebuilt from a message, and
    unchanged when the exception is not an op's."""
    if type(e).__module__.partition(".")[0] not in _OUR_MODULES or not e.args:
        return e
    if isinstance(e, RuntimeError) and str(e).startswith("RESOURCE_EXHAUSTED") and _raised_by_jax_runtime(e):
        return _out_of_memory(e, where)
    text = f"{where}: {e}"
    if isinstance(e, TypeError) and _raised_by_jax(e) and "dtype" in str(e):
        # jax.numpy refusing a dtype (bitwise ops on floats): CPU's dtype switch says "not
        # implemented for 'Float'" as a NotImplementedError (torch 2.11 on), so a user's except
        # clause sees the type CPU raises
        return NotImplementedError(f"{where}: not implemented for this dtype: {e}")
    try:
        new = type(e)(text)
    except Exception:
        new = None
    if new is None or str(new) != text:  # a class whose constructor means something else
        e.add_note(where)
        return e
    return new


def _raised_by_jax_runtime(e: BaseException) -> bool:
    """Whether ``e`` is the XLA runtime's own error (jaxlib's ``JaxRuntimeError``/``XlaRuntimeError``)."""
    return type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError")


def _out_of_memory(e: BaseException, where: str) -> BaseException:
    """XLA's ``RESOURCE_EXHAUSTED`` as ``torch.OutOfMemoryError``, what CUDA raises: code written
    for CUDA catches that (``except torch.cuda.OutOfMemoryError``), and batch-size finders look for
    " out of memory." in a RuntimeError's one argument (accelerate's ``find_executable_batch_size``).
    It is a RuntimeError, as CPU's failed allocation is."""
    import torch  # this module imports nothing of the runtime; torch is loaded long before any op runs

    return torch.OutOfMemoryError(f"tpu out of memory. {where}: {e}")


def _raised_by_jax(e: BaseException) -> bool:
    """Whether ``e`` was raised inside JAX itself (not by a lowering's own check)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "/jax/" in tb.tb_frame.f_code.co_filename


def raise_named(e: BaseException, where: str) -> None:
    """Raises :func:`named_error` of ``e``, chained to ``e`` (whose traceback is the lowering's)."""
    new = named_error(e, where)
    if new is e:
        raise e
    raise new from e
