"""The packed bytes of a u4 constant as a u8 constant on the same memory.

Why: the CPU plugin widens a u4 constant to u8 at compile time unless one of its own
decompression patterns reads it, so a rewrite that hands u4 weights to something else (a `Loop`
body's byte gather, an extension op) passes their bytes typed u8 instead: no widened copy to read
or to hold, and no copy while the model is built.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


def u8_view(const: Any, shape: tuple[int, ...]) -> Any:
    """A u8 Constant of `shape` over the bytes of the u4 Constant node `const` (two values per
    byte, the first in the low nibble); `shape` must hold exactly its byte count."""
    from openvino import opset15 as op

    data = const.get_data()  # the packed bytes: a read-only view of the constant's buffer
    if data.dtype != np.uint8 or not data.flags.c_contiguous or data.size != int(np.prod(shape)):
        raise ValueError(f"{const.get_friendly_name()}: {data.size} packed bytes are not {shape}")
    # OpenVINO shares only writeable arrays; a ctypes view of the same bytes is one, and it
    # keeps the constant (and so its buffer) alive. The graph never writes to constants.
    buf = (ctypes.c_uint8 * data.size).from_address(data.ctypes.data)
    buf._owner = (data, const)  # type: ignore[attr-defined]
    return op.constant(np.ctypeslib.as_array(buf).reshape(shape), shared_memory=True)
