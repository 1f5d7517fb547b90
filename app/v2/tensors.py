"""Tensors of the Open Inference Protocol as this server reads and writes them, whatever
carried them: JSON ``data``, the HTTP binary tensor extension, or gRPC contents and raw
bytes. One ``Tensor`` type, so the inference in ``app.v2.inference`` never knows which.

BYTES elements travel raw as the protocol's binary form does: each a 4-byte little-endian
length, then that many bytes. In JSON a BYTES element is a base64 string (JSON has no bytes;
the KServe SDK sends them so), except for outputs, which are text (the classification
extension's ``"score:index:label"``). Numbers are little-endian, row-major.

>>> raw = pack_bytes([b"ab", b""])
>>> raw
b'\\x02\\x00\\x00\\x00ab\\x00\\x00\\x00\\x00'
>>> unpack_bytes(raw, "image")
[b'ab', b'']
>>> from_raw("pixels", "FP32", (1, 2), bytes(8)).value.tolist()
[[0.0, 0.0]]
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.errors import InvalidRequest

# The datatypes the protocol names, as numpy reads them (little-endian); BYTES is apart.
NUMERIC: dict[str, np.dtype[Any]] = {
    name: np.dtype(kind).newbyteorder("<")
    for name, kind in {
        "BOOL": np.bool_,
        "UINT8": np.uint8,
        "UINT16": np.uint16,
        "UINT32": np.uint32,
        "UINT64": np.uint64,
        "INT8": np.int8,
        "INT16": np.int16,
        "INT32": np.int32,
        "INT64": np.int64,
        "FP16": np.float16,
        "FP32": np.float32,
        "FP64": np.float64,
    }.items()
}
BYTES = "BYTES"
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class Tensor:
    """One named tensor: a numeric array shaped ``shape``, or, for BYTES, its elements in
    row-major order (``len(value) == prod(shape)``)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    value: npt.NDArray[Any] | list[bytes]

    @classmethod
    def of(cls, name: str, array: npt.NDArray[Any], datatype: str) -> Tensor:
        return cls(name, datatype, tuple(array.shape), array)

    def raw(self) -> bytes:
        """The tensor in the protocol's binary form."""
        if isinstance(self.value, list):
            return pack_bytes(self.value)
        return np.ascontiguousarray(self.value, dtype=NUMERIC[self.datatype]).tobytes()

    def json_data(self) -> list[Any]:
        """The tensor as JSON ``data``: flat, row-major; BYTES elements as text."""
        if isinstance(self.value, list):
            return [element.decode("utf-8", "replace") for element in self.value]
        flat: list[Any] = self.value.reshape(-1).tolist()
        return flat


MAX_DIMENSION = 2**31  # a size past this is no image's (numpy refuses some even with a 0)


def _elements(shape: Sequence[int], name: str) -> int:
    if any(not isinstance(size, int) or size < 0 for size in shape):
        raise InvalidRequest(f"input {name!r}: shape {list(shape)[:8]} has a negative size")
    if len(shape) > 32 or any(size > MAX_DIMENSION for size in shape):
        raise InvalidRequest(
            f"input {name!r}: shape {list(shape)[:8]} has over 32 dimensions or one over "
            f"{MAX_DIMENSION}"
        )
    return math.prod(shape)


def _check_datatype(name: str, datatype: str) -> None:
    if datatype != BYTES and datatype not in NUMERIC:
        raise InvalidRequest(f"input {name!r}: unknown datatype {datatype!r}")


def pack_bytes(elements: Sequence[bytes]) -> bytes:
    """BYTES elements in the binary form: each its length (4 bytes, little-endian), then it."""
    return b"".join(_LENGTH.pack(len(element)) + element for element in elements)


def unpack_bytes(raw: bytes | memoryview, name: str) -> list[bytes]:
    """The elements of BYTES in the binary form; ``InvalidRequest`` if it does not parse."""
    view = memoryview(raw)
    elements: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise InvalidRequest(f"input {name!r}: BYTES data ends inside an element's length")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise InvalidRequest(
                f"input {name!r}: a BYTES element of {length} bytes runs past the data"
            )
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    return elements


def from_raw(name: str, datatype: str, shape: Sequence[int], raw: bytes | memoryview) -> Tensor:
    """A tensor from its binary form (the HTTP binary extension, gRPC raw contents)."""
    _check_datatype(name, datatype)
    count = _elements(shape, name)
    if datatype == BYTES:
        elements = unpack_bytes(raw, name)
        _check_count(name, shape, len(elements), count)
        return Tensor(name, datatype, tuple(shape), elements)
    dtype = NUMERIC[datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidRequest(
            f"input {name!r}: {len(raw)} bytes of data, but shape {list(shape)} of {datatype} "
            f"needs {count * dtype.itemsize}"
        )
    return Tensor(
        name, datatype, tuple(shape), _shaped(np.frombuffer(raw, dtype=dtype), shape, name)
    )


def from_values(name: str, datatype: str, shape: Sequence[int], values: Sequence[Any]) -> Tensor:
    """A tensor from listed values (JSON ``data``, which may be nested, or gRPC contents):
    BYTES elements as base64 text (JSON) or bytes (gRPC)."""
    _check_datatype(name, datatype)
    count = _elements(shape, name)
    if datatype == BYTES:
        elements = [_element(name, index, value) for index, value in enumerate(_flat(values))]
        _check_count(name, shape, len(elements), count)
        return Tensor(name, datatype, tuple(shape), elements)
    try:
        array = np.asarray(values, dtype=NUMERIC[datatype]).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequest(
            f"input {name!r}: its data are not all {datatype} numbers, or not a regular array"
        ) from None
    _check_count(name, shape, array.size, count)
    return Tensor(name, datatype, tuple(shape), _shaped(array, shape, name))


def _shaped(array: npt.NDArray[Any], shape: Sequence[int], name: str) -> npt.NDArray[Any]:
    """``array`` in ``shape`` (its size checked): numpy refuses some empty shapes, as too big
    (``[0, 2**31, 2**31]``)."""
    try:
        return array.reshape(tuple(shape))
    except ValueError:
        raise InvalidRequest(f"input {name!r}: shape {list(shape)[:8]} cannot be made") from None


def _flat(values: Sequence[Any]) -> list[Any]:
    flat: list[Any] = []
    for value in values:
        if isinstance(value, list):
            flat.extend(_flat(value))
        else:
            flat.append(value)
    return flat


def _element(name: str, index: int, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise InvalidRequest(f"input {name!r}: element {index} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"input {name!r}: element {index} is not base64") from None


def _check_count(name: str, shape: Sequence[int], got: int, count: int) -> None:
    if got != count:
        raise InvalidRequest(
            f"input {name!r}: shape {list(shape)} holds {count} elements, its data {got}"
        )
