"""The body of a v2 HTTP ``infer``, both ways: JSON, or JSON followed by binary tensors (the
binary tensor data extension), read whatever the ``Content-Type`` says (tritonclient sends
none, or ``application/octet-stream``).

A request with ``Inference-Header-Content-Length: n`` holds its JSON in the first ``n``
bytes; each input whose ``parameters.binary_data_size`` is set takes that many of the bytes
after it, in input order. An answer is binary where the request asks (an output's
``parameters.binary_data``, else the request's ``parameters.binary_data_output``): those
outputs carry ``parameters.binary_data_size`` and no ``data``, their bytes follow the JSON,
and the answer's ``Inference-Header-Content-Length`` says where the JSON ends.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from app.errors import InvalidRequest, PayloadTooLarge, validation_message
from app.jsonbody import dumps
from app.v2.inference import InferCall, Requested
from app.v2.tensors import Tensor, from_raw, from_values

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_TYPE = "application/octet-stream"
JSON_TYPE = "application/json"


class InputBody(BaseModel):
    name: str = Field(max_length=256)
    datatype: str = Field(max_length=16)
    shape: list[int] = Field(max_length=8)
    parameters: dict[str, Any] = Field(default_factory=dict)
    # Any: a wrong element is one short message from app.v2.tensors, not one per element.
    data: list[Any] | None = None


class OutputBody(BaseModel):
    name: str = Field(max_length=256)
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferBody(BaseModel):
    id: str | None = Field(None, max_length=128)
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InputBody] = Field(min_length=1, max_length=16)
    outputs: list[OutputBody] | None = Field(None, max_length=16)


def inlined_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` written in place, for an OpenAPI request
    body given by hand (a body read whatever its Content-Type has no FastAPI parameter)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    inlined: dict[str, Any] = walk(schema)
    return inlined


CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # deflate: zlib's format


def decoded(raw: bytes, coding: str | None, limit: int) -> bytes:
    """The body before its ``Content-Encoding`` (tritonclient's
    ``request_compression_algorithm``: gzip or deflate), at most ``limit`` bytes once
    decompressed (``PayloadTooLarge`` past it: a small body may inflate a thousandfold)."""
    name = (coding or "identity").strip().lower()
    if name == "identity":
        return raw
    if name not in CODINGS:
        raise InvalidRequest(f"Content-Encoding {name[:20]!r}: send identity, gzip or deflate")
    inflating = zlib.decompressobj(CODINGS[name])
    try:
        body = inflating.decompress(raw, limit + 1)
    except zlib.error as error:
        raise InvalidRequest(f"the body is not {name} data: {error}") from None
    if len(body) > limit:
        raise PayloadTooLarge(f"the body decompresses past {limit} bytes (MAX_UPLOAD_BYTES)")
    if not inflating.eof:
        raise InvalidRequest(f"the body's {name} data end before their end")
    return body


def read_json(raw: bytes, what: str = "body") -> Any:
    """A JSON document; ``InvalidRequest`` (one line) if it is not one."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidRequest(f"the {what} is not JSON: {error}") from None
    except (ValueError, RecursionError) as error:  # an integer of 4,300 digits, deep nesting
        raise InvalidRequest(
            f"the {what} is not JSON this server reads: {str(error)[:100]}"
        ) from None


def validated(model: type[BaseModel], document: Any) -> Any:
    """``document`` as ``model``; a mistake is answered in one short line (the first three
    problems), never a list as long as the data."""
    try:
        return model.model_validate(document)
    except ValidationError as error:
        raise InvalidRequest(validation_message(error.errors())) from None


def _flag(parameters: dict[str, Any], name: str) -> bool | None:
    value = parameters.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"parameters.{name} must be true or false")
    return value


def parse(raw: bytes, header_length: str | None) -> tuple[InferBody, InferCall]:
    """The request body as sent, and what it asks."""
    binary = memoryview(b"")
    if header_length is not None:
        if not re.fullmatch(r"[0-9]{1,12}", header_length) or int(header_length) > len(raw):
            raise InvalidRequest(
                f"{HEADER_LENGTH} must be the JSON's length in bytes, at most the body's "
                f"{len(raw)}, got {header_length[:20]!r}"
            )
        binary = memoryview(raw)[int(header_length) :]
        raw = raw[: int(header_length)]
    try:
        document = read_json(raw)
    except InvalidRequest as error:
        if header_length is None and raw[:1] == b"{":
            error.message += f"; binary tensors need the {HEADER_LENGTH} header"
            error.args = (error.message,)
        raise
    body: InferBody = validated(InferBody, document)
    inputs: list[Tensor] = []
    offset = 0
    for given in body.inputs:
        size = given.parameters.get("binary_data_size")
        if size is None:
            if given.data is None:
                raise InvalidRequest(f"input {given.name!r} has no data and no binary_data_size")
            inputs.append(from_values(given.name, given.datatype, given.shape, given.data))
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequest(f"input {given.name!r}: binary_data_size must be a byte count")
        if offset + size > len(binary):
            raise InvalidRequest(
                f"input {given.name!r}: binary_data_size {size} runs past the body's binary part "
                f"({len(binary)} bytes; is {HEADER_LENGTH} set?)"
            )
        piece = binary[offset : offset + size]
        offset += size
        inputs.append(from_raw(given.name, given.datatype, given.shape, piece))
    if offset != len(binary):
        raise InvalidRequest(
            f"{len(binary) - offset} bytes after the JSON belong to no input's binary_data_size"
        )
    _flag(body.parameters, "binary_data_output")  # checked before the model runs, not after
    for output in body.outputs or ():
        _flag(output.parameters, "binary_data")
    outputs = [Requested.of(output.name, output.parameters) for output in body.outputs or ()]
    return body, InferCall(inputs, outputs, body.parameters)


def answer(
    body: InferBody, outputs: Sequence[Tensor], head: dict[str, Any]
) -> tuple[bytes, int | None]:
    """The answer's bytes, and the JSON's length when binary tensors follow it (``None``:
    all JSON). ``head`` holds the answer's other fields (model name, version, id)."""
    default = bool(_flag(body.parameters, "binary_data_output"))
    wants = {output.name: _flag(output.parameters, "binary_data") for output in body.outputs or ()}
    listed: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for tensor in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        binary = wants.get(tensor.name)
        if binary if binary is not None else default:
            blob = tensor.raw()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = tensor.json_data()
        listed.append(entry)
    document = dumps({**head, "outputs": listed}, allow_nan=True, ensure_ascii=True)
    if not blobs:
        return document, None
    return b"".join([document, *blobs]), len(document)
