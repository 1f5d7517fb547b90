"""Between the v2 gRPC messages (``app.v2.proto``) and what ``app.v2.inference`` takes and
answers: a ``ModelInferRequest`` as an ``InferCall``, the outputs as a ``ModelInferResponse``
(every output's data in ``raw_output_contents``), a repository load's parameters."""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequest
from app.services.registry import ModelVersion
from app.v2.inference import InferCall, Requested
from app.v2.proto import inference_pb2 as pb
from app.v2.tensors import BYTES, Tensor, from_raw, from_values

# Where each datatype's values sit in InferTensorContents.
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    BYTES: "bytes_contents",
}


def parameter(value: Any) -> Any:
    """An ``InferParameter`` (or ``ModelRepositoryParameter``) as a Python value."""
    which = value.WhichOneof("parameter_choice")
    return getattr(value, which) if which else None


def infer_call(request: Any) -> InferCall:
    """What a ``ModelInferRequest`` asks, as ``app.v2.inference`` takes it."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one each"
        )
    inputs: list[Tensor] = []
    for index, given in enumerate(request.inputs):
        shape = list(given.shape)
        if raw:
            inputs.append(from_raw(given.name, given.datatype, shape, raw[index]))
            continue
        field = CONTENTS.get(given.datatype)
        values = list(getattr(given.contents, field)) if field else []
        inputs.append(from_values(given.name, given.datatype, shape, values))
    outputs = [
        Requested.of(output.name, {key: parameter(v) for key, v in output.parameters.items()})
        for output in request.outputs
    ]
    parameters = {key: parameter(value) for key, value in request.parameters.items()}
    return InferCall(inputs, outputs, parameters)


def infer_response(
    version: ModelVersion, number: int, request_id: str, outputs: list[Tensor]
) -> Any:
    """A ``ModelInferResponse`` of ``version`` (``number``: as admitted, should it be
    renumbered meanwhile): every output's data in ``raw_output_contents``, and the id that
    computed it in ``parameters.model_id`` (what HTTP's ``X-Model-Id`` says: the export and
    precision)."""
    response = pb.ModelInferResponse(
        model_name=version.name, model_version=str(number), id=request_id
    )
    response.parameters["model_id"].string_param = version.served_id
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.raw())
    return response
