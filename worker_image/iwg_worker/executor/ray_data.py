"""What crosses to and from a Ray actor: plain data only, torch tensors as their bytes.

Ray serialises actor-task arguments and results with its own pickle-based serializer; that is Ray's
transport, inside the user's own Ray cluster, not iwg's wire protocol. iwg lets only plain data cross: None,
bool, int, float, str, bytes, lists, tuples, dicts with string keys, numpy arrays and torch tensors, in calls
and in results alike. Anything else is refused with a `TypeError` naming where it was, so a call that works
on Ray also works over ZMQ. Torch tensors travel as `TensorBytes`, made and undone by the project's one
tensor codec (`protocol.tensor_bytes` / `protocol.tensor_from_bytes`, which the ZMQ wire uses too).

This module does not import Ray (nor torch, until a tensor crosses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from iwg_worker.protocol import tensor_bytes, tensor_from_bytes


def _is_torch_tensor(value: Any) -> bool:
    # Checked by name so that this module does not import torch in the caller.
    kind = type(value)
    return kind.__module__.startswith("torch") and kind.__name__ in ("Tensor", "Parameter")


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """A torch tensor on its way through Ray: its bytes as a flat uint8 numpy array, which Ray ships without
    a copy (a torch tensor itself would go through torch's own pickling, six times slower at 16 MiB), plus
    the dtype and shape to rebuild it. The ZMQ protocol sends the same bytes as a raw frame."""

    data: np.ndarray[Any, np.dtype[np.uint8]]
    dtype: str
    shape: tuple[int, ...]


def to_ray(value: Any, where: str) -> tuple[Any, int]:
    """Check that ``value`` is plain data and ready it for Ray: torch tensors become `TensorBytes`.

    Returns the converted value and the bytes its buffers hold. A `TypeError` names what is not plain data
    and where it was (a path like ``args[0]['x']``).
    """
    if value is None or isinstance(value, bool | int | float | str | np.generic):
        return value, 0
    if isinstance(value, bytes):
        return value, len(value)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(
                f"{where} is a numpy array of Python objects: only numeric arrays cross to a worker"
            )
        return value, value.nbytes
    if isinstance(value, list | tuple):
        items = [to_ray(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return [v for v, _ in items], sum(n for _, n in items)
    if isinstance(value, dict):
        out = {}
        size = 0
        for key, v in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has a key {key!r} of type {type(key).__name__}: keys must be str")
            out[key], n = to_ray(v, f"{where}[{key!r}]")
            size += n
        return out, size
    if _is_torch_tensor(value):
        dtype, shape, flat = tensor_bytes(value)
        return TensorBytes(flat, dtype, tuple(shape)), flat.nbytes
    raise TypeError(
        f"{where} is a {type(value).__qualname__}: only plain data (None, bool, int, float, str, bytes, lists, "
        f"dicts with str keys, numpy arrays, torch tensors) crosses to a worker"
    )


def from_ray(value: Any) -> Any:
    """Undo `to_ray`: `TensorBytes` become torch tensors sharing the received (read-only) memory."""
    if isinstance(value, TensorBytes):
        return tensor_from_bytes(value.data, value.dtype, list(value.shape))
    if isinstance(value, list):
        return [from_ray(v) for v in value]
    if isinstance(value, dict):
        return {k: from_ray(v) for k, v in value.items()}
    return value
