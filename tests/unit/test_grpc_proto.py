"""app/v2/proto: the committed code is what ``make grpc-code`` generates now, every message, field,
enum value and method of ``inference.proto`` is the one tritonclient knows by the same full name,
the two import side by side in either order, and tritonclient's own client decodes what a server
built on them sends."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from app.v2.proto import inference_pb2 as pb
from app.v2.proto import inference_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = Path("app", "v2", "proto")
GENERATED = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")
SERVICE = "inference.GRPCInferenceService"
RPCS = {
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
}


# --- the generated code is current ----------------------------------------------------------


def test_committed_code_is_what_make_grpc_code_generates(tmp_path: Path) -> None:
    assert importlib.util.find_spec("grpc_tools"), "grpcio-tools is missing: make install-dev"
    # The Makefile's own recipe, into a scratch folder; -o install-dev: this interpreter's
    # environment is the one under test, not something to reinstall. Without the parent make's
    # variables (its jobserver, its flags), when `make test` is what runs this.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    command = ["make", "-s", "-o", "install-dev", "grpc-code", f"GRPC_OUT={tmp_path}"]
    done = subprocess.run(
        [*command, f"PY={sys.executable}"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in GENERATED:
        fresh = (tmp_path / PROTO_DIR / name).read_bytes()
        committed = (REPO / PROTO_DIR / name).read_bytes()
        assert fresh == committed, f"{PROTO_DIR / name} is stale: run make grpc-code"


def test_our_messages_live_in_their_own_descriptor_pool() -> None:
    assert pb.DESCRIPTOR.pool is not service_pb2.DESCRIPTOR.pool
    assert pb.ModelInferRequest.DESCRIPTOR.file is pb.DESCRIPTOR


# --- wire compatibility with tritonclient's compiled protocol ---------------------------------


def _messages(descriptor: Descriptor) -> Iterator[Descriptor]:
    yield descriptor
    for nested in descriptor.nested_types:  # map entries included: their fields are the map's
        yield from _messages(nested)


def _enums(descriptor: Descriptor) -> Iterator[EnumDescriptor]:
    yield from descriptor.enum_types
    for nested in descriptor.nested_types:
        yield from _enums(nested)


def _type_name(field: FieldDescriptor) -> str:
    of = field.message_type or field.enum_type
    return of.full_name if of is not None else ""


def _oneof(field: FieldDescriptor) -> str:
    return field.containing_oneof.name if field.containing_oneof is not None else ""


def field_differences(ours: Descriptor, theirs: Descriptor) -> list[str]:
    """Where a field of ``ours`` is not encoded, or not named, as in ``theirs``."""
    differences = []
    for field in ours.fields:
        where = f"{ours.full_name}.{field.name}"
        other = theirs.fields_by_name.get(field.name)
        if other is None:
            differences.append(f"{where}: not in tritonclient's {theirs.full_name}")
            continue
        for what, mine, its in [
            ("number", field.number, other.number),
            ("type", field.type, other.type),
            ("repeated", field.is_repeated, other.is_repeated),
            ("type name", _type_name(field), _type_name(other)),
            ("oneof", _oneof(field), _oneof(other)),
        ]:
            if mine != its:
                differences.append(f"{where}: {what} {mine!r}, tritonclient has {its!r}")
    return differences


def _triton_message(full_name: str) -> Descriptor | None:
    try:
        found: Descriptor = service_pb2.DESCRIPTOR.pool.FindMessageTypeByName(full_name)
    except KeyError:
        return None
    return found


def test_every_message_and_field_matches_tritonclients() -> None:
    assert model_config_pb2.DESCRIPTOR.pool is service_pb2.DESCRIPTOR.pool  # one pool to search
    differences = []
    compared = set()
    for top in pb.DESCRIPTOR.message_types_by_name.values():
        for message in _messages(top):
            theirs = _triton_message(message.full_name)
            if theirs is None:
                differences.append(f"{message.full_name}: tritonclient has no such message")
                continue
            differences += field_differences(message, theirs)
            compared.add(message.full_name)
    assert differences == []
    assert {  # the walk reached nested messages and map entries too
        "inference.ModelInferRequest.InferInputTensor.ParametersEntry",
        "inference.ModelVersionPolicy.Latest",
        "inference.ModelConfig.ParametersEntry",
    } < compared


def test_the_comparison_sees_a_difference() -> None:
    """A check that cannot fail proves nothing: ModelOutput is not encoded like ModelInput."""
    theirs = _triton_message("inference.ModelInput")
    assert theirs is not None
    differences = field_differences(pb.DESCRIPTOR.message_types_by_name["ModelOutput"], theirs)
    assert "inference.ModelOutput.dims: number 3, tritonclient has 4" in differences
    assert any(
        line.startswith("inference.ModelOutput.label_filename: not in") for line in differences
    )


def test_every_enum_value_matches_tritonclients() -> None:
    pool = service_pb2.DESCRIPTOR.pool
    ours = list(pb.DESCRIPTOR.enum_types_by_name.values())
    for top in pb.DESCRIPTOR.message_types_by_name.values():
        ours += _enums(top)
    assert {e.full_name for e in ours} >= {
        "inference.DataType",
        "inference.ModelInput.Format",
        "inference.ModelInstanceGroup.Kind",
    }
    for enum in ours:
        theirs = {v.name: v.number for v in pool.FindEnumTypeByName(enum.full_name).values}
        assert {v.name: v.number for v in enum.values} == theirs, enum.full_name


def test_every_rpc_matches_tritonclients() -> None:
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == SERVICE  # the path a call is sent to
    assert {m.name for m in ours.methods} == RPCS
    for method in ours.methods:
        other = theirs.methods_by_name[method.name]
        assert (
            method.input_type.full_name,
            method.output_type.full_name,
            method.client_streaming,
            method.server_streaming,
        ) == (
            other.input_type.full_name,
            other.output_type.full_name,
            other.client_streaming,
            other.server_streaming,
        ), method.name


def test_bytes_from_either_side_decode_on_the_other() -> None:
    ours = pb.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"\x01\x02"])
    ours.parameters["priority"].uint64_param = 2
    ours.inputs.add(name="x", datatype="UINT8", shape=[1, 2])
    theirs = service_pb2.ModelInferRequest.FromString(ours.SerializeToString())
    assert theirs.parameters["priority"].uint64_param == 2
    assert (theirs.inputs[0].name, list(theirs.inputs[0].shape)) == ("x", [1, 2])
    assert pb.ModelInferRequest.FromString(theirs.SerializeToString()) == ours


@pytest.mark.parametrize("first", ["ours", "tritonclient"])
def test_both_import_in_one_process_in_either_order(first: str) -> None:
    imports = [
        "from app.v2.proto import inference_pb2, inference_pb2_grpc",
        "import tritonclient.grpc\nfrom tritonclient.grpc import service_pb2",
    ]
    if first == "tritonclient":
        imports.reverse()
    check = textwrap.dedent("""
        config = inference_pb2.ModelConfig(name="m", max_batch_size=4)
        decoded = service_pb2.ModelConfigResponse.FromString(
            inference_pb2.ModelConfigResponse(config=config).SerializeToString()
        )
        assert decoded.config.max_batch_size == 4, decoded
        print("ok")
    """)
    code = "\n".join([*imports, check])
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], cwd=REPO, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr


# --- a real server, tritonclient's real client ------------------------------------------------


Context = grpc.aio.ServicerContext[Any, Any]


class FixedServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Answers with fixed values; every other rpc keeps the generated UNIMPLEMENTED."""

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Context
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Context
    ) -> pb.ModelConfigResponse:
        config = pb.ModelConfig(
            name=request.name,
            platform="pytorch_libtorch",
            max_batch_size=8,
            input=[
                pb.ModelInput(
                    name="image",
                    data_type=pb.TYPE_UINT8,
                    format=pb.ModelInput.FORMAT_NCHW,
                    dims=[3, 224, 224],
                )
            ],
            output=[pb.ModelOutput(name="logits", data_type=pb.TYPE_FP32, dims=[1000])],
            dynamic_batching=pb.ModelDynamicBatching(
                preferred_batch_size=[8],
                max_queue_delay_microseconds=5000,
                default_queue_policy=pb.ModelQueuePolicy(max_queue_size=64),
            ),
            instance_group=[pb.ModelInstanceGroup(kind=pb.ModelInstanceGroup.KIND_CPU, count=2)],
            parameters={"runtime": pb.ModelParameter(string_value="torchscript")},
        )
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        stats = pb.ModelStatistics(
            name=request.name or "resnet",
            version="1",
            last_inference=1_700_000_000_000,
            inference_count=12,
            execution_count=3,
            inference_stats=pb.InferStatistics(
                success=pb.StatisticDuration(count=12, ns=120_000),
                queue=pb.StatisticDuration(count=12, ns=30_000),
            ),
            batch_stats=[
                pb.InferBatchStatistics(
                    batch_size=4, compute_infer=pb.StatisticDuration(count=3, ns=90_000)
                )
            ],
        )
        return pb.ModelStatisticsResponse(model_stats=[stats])

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: Context
    ) -> pb.ModelInferResponse:
        """Echo: the first input comes back as the output "y", raw bytes untouched."""
        tensor = request.inputs[0]
        output = pb.ModelInferResponse.InferOutputTensor(
            name="y", datatype=tensor.datatype, shape=tensor.shape
        )
        response = pb.ModelInferResponse(
            model_name=request.model_name,
            id=request.id,
            outputs=[output],
            raw_output_contents=request.raw_input_contents[:1],
        )
        response.parameters["seen"].int64_param = request.parameters["n"].int64_param
        return response


def _call_with_tritonclient(port: int) -> dict[str, Any]:
    """Blocking calls, as a user makes them; run in a thread beside the event loop's server."""
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        image = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
        tensor = triton.InferInput("x", list(image.shape), "FP32")
        tensor.set_data_from_numpy(image)
        result = client.infer("resnet", [tensor], request_id="42", parameters={"n": 5})
        with pytest.raises(InferenceServerException) as unimplemented:
            client.get_system_shared_memory_status()  # not in our service
        return {
            "live": client.is_server_live(),
            "config": client.get_model_config("resnet", as_json=True),
            "stats": client.get_inference_statistics("resnet", as_json=True),
            "echo": result.as_numpy("y"),
            "response": result.get_response(as_json=True),
            "unimplemented": unimplemented.value.status(),
        }
    finally:
        client.close()


async def test_tritonclient_decodes_what_a_servicer_sends() -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(FixedServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        got = await asyncio.to_thread(_call_with_tritonclient, port)
    finally:
        await server.stop(None)

    assert got["live"] is True
    config = got["config"]["config"]
    assert config["name"] == "resnet" and config["max_batch_size"] == 8
    assert config["input"][0] == {
        "name": "image",
        "data_type": "TYPE_UINT8",
        "format": "FORMAT_NCHW",
        "dims": ["3", "224", "224"],  # int64 is a string in protobuf's JSON
    }
    assert config["output"][0]["dims"] == ["1000"]
    assert config["dynamic_batching"] == {
        "preferred_batch_size": [8],
        "max_queue_delay_microseconds": "5000",
        "default_queue_policy": {"max_queue_size": 64},
    }
    assert config["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]
    assert config["parameters"] == {"runtime": {"string_value": "torchscript"}}

    (stats,) = got["stats"]["model_stats"]
    assert (stats["name"], stats["inference_count"], stats["execution_count"]) == (
        "resnet",
        "12",
        "3",
    )
    assert stats["inference_stats"]["success"] == {"count": "12", "ns": "120000"}
    assert stats["batch_stats"] == [
        {"batch_size": "4", "compute_infer": {"count": "3", "ns": "90000"}}
    ]

    np.testing.assert_array_equal(got["echo"], np.arange(6, dtype=np.float32).reshape(1, 2, 3))
    assert got["response"]["id"] == "42"
    assert got["response"]["parameters"] == {"seen": {"int64_param": "5"}}
    assert got["unimplemented"] == "StatusCode.UNIMPLEMENTED"
