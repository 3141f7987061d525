"""What differs between the torch and jax versions this package supports, looked up in one place.

The package declares torch 2.11–2.15 and jax 0.10.1+. Where an ATen op, a c10d hook or an API
appeared or went away inside that range, the rest of the package asks here instead of guarding with
scattered ``try``s, so that a new release means one edit.

Known differences:

* ``aten::cholesky`` was removed in torch 2.14 (``torch.cholesky`` was deprecated in 1.9).
* torch 2.11 does not register ``aten::_linalg_check_errors`` as an ordered side effect, so graphs
  drop it as dead code (see :func:`keep_linalg_checks_in_graphs`).
* torch 2.15 attaches a flight recorder to every process group, which needs the group's default
  backend to be set (see ``distributed/c10d.py``).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _version(torch.__version__)


def aten_overload(qualified: str) -> torch._ops.OpOverload | None:
    """``aten.<qualified>`` (``"cholesky.default"``), or None where this torch has no such op.

    Registration decorators skip a None target, so a lowering of an op that a torch version lacks
    is simply not registered there.
    """
    packet_name, _, overload = qualified.partition(".")
    try:
        packet = getattr(aten, packet_name)
    except AttributeError:
        return None
    if not overload:
        return packet
    return getattr(packet, overload, None)


def keep_linalg_checks_in_graphs() -> None:
    """Makes graphs keep ``aten._linalg_check_errors``, an op whose only output is its raise.

    From torch 2.13 it is an ordered side effect, so Dynamo and AOTAutograd keep it in the graph
    and the compile backend turns it into a deferred check. torch 2.11 treats it as dead code, and a
    compiled ``linalg.inv`` of a singular matrix would silently return garbage; registering it as
    torch itself later does gives those versions the same graphs.
    """
    from torch._higher_order_ops import effects

    if effects._get_effect(aten._linalg_check_errors.default) is None:
        effects._register_effectful_op("aten::_linalg_check_errors", effects._EffectType.ORDERED)
