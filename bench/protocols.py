"""``python -m bench.protocols``: one server with its defaults answering the same photos three
ways, in turns (issue #36): ``/predict/tag`` with a multipart upload, the Open Inference
Protocol's ``infer`` over HTTP with the binary tensor extension, and over gRPC.

    python -m bench.protocols                        # 1, 8 and 64 clients, 8 rounds of 2 s
    python -m bench.protocols --seconds 4 --rounds 3 --json protocols.json

For each concurrency, each round runs the three ways one after another (the order shifts by
one every round), so the drift of a shared machine hits all three alike; images/s is the
median of the rounds, p50 and p99 are over every round's requests, and each ratio to
/predict/tag is the median of the rounds' ratios. Every way sends the same JPEGs with k=5
and asks for the same answer; the load generator is ``bench.loadgen``'s closed loop, with
prebuilt requests for all three (gRPC as serialized bytes on a channel per client, as each
HTTP client has its own connection). ``python -m bench`` runs this too (not with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import grpc
import httpx

from app.settings import Settings
from app.v2.proto import inference_pb2 as pb
from app.v2.tensors import pack_bytes
from bench.loadgen import LoadResult, Response, Sender, closed_loop, multipart_request
from bench.results import PREDICT, PROTOCOLS, V2_GRPC, V2_HTTP, Point, ProtocolReport
from bench.systems import RunningServer, bench_jpegs, export_bench_model, free_port, serve
from bench.verdicts import protocol_ratios

HOST = "127.0.0.1"
MODEL = "efficientnet_lite0"
CLIENTS = (1, 8, 64)  # the levels
# Many short turns: on a shared 2-core VM the speed swings 2x within seconds, and the median
# of 8 rounds' ratios held still where 3 rounds of 4 s did not (docs/performance.md).
ROUNDS, SECONDS = 8, 2.0
K = 5
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
# A gRPC call that ends with status code c counts as status GRPC_STATUS + c: never a 200.
GRPC_STATUS = 1000


def v2_http_request(port: int, model: str, jpeg: bytes) -> bytes:
    """A complete ``POST /v2/models/<model>/infer``: its JSON, then the image as a BYTES
    tensor (the binary tensor extension), asking for both outputs in binary."""
    tensor = pack_bytes([jpeg])
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": len(tensor)},
                }
            ],
            "outputs": [
                {"name": name, "parameters": {"binary_data": True}}
                for name in ("top_k_probs", "top_k_indices")
            ],
            "parameters": {"k": K},
        },
        separators=(",", ":"),
    ).encode()
    body = header + tensor
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def grpc_request(model: str, jpeg: bytes) -> bytes:
    """A serialized ``ModelInferRequest`` for the same image and answer."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(pack_bytes([jpeg]))
    request.outputs.add(name="top_k_probs")
    request.outputs.add(name="top_k_indices")
    request.parameters["k"].int64_param = K
    return request.SerializeToString()


class GrpcCall:
    """A :class:`bench.loadgen.Sender` for ``ModelInfer``: serialized requests in, the
    serialized answer out (no message objects on either side, as the HTTP load generator
    parses no JSON). Its own channel, with a subchannel pool of its own: one HTTP/2
    connection per client, as each HTTP client has one TCP connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] | None = None

    async def send(self, request: bytes) -> Response:
        if self._call is None:  # in the running event loop: grpc.aio binds to it
            self._channel = grpc.aio.insecure_channel(
                f"{HOST}:{self.port}", options=[("grpc.use_local_subchannel_pool", 1)]
            )
            self._call = self._channel.unary_unary(MODEL_INFER)  # bytes in, bytes out
        try:
            body = await self._call(request, wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise ConnectionError(error.details()) from error
            return Response(GRPC_STATUS + error.code().value[0], {}, b"")
        return Response(200, {}, body)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._call = None


class Ways:
    """The three ways to one running server: each one's requests (one per JPEG), how it
    sends them, and a check that an answer holds ``K`` probabilities."""

    def __init__(self, server: RunningServer, grpc_port: int, jpegs: list[bytes]) -> None:
        self.server, self.grpc_port = server, grpc_port
        index = httpx.get(f"http://{HOST}:{server.port}/v2/repository/index", timeout=10)
        self.model = str(index.json()[0]["name"])
        self.requests = {
            PREDICT: [
                multipart_request(HOST, server.port, "/predict/tag", jpeg, fields=[("k", str(K))])
                for jpeg in jpegs
            ],
            V2_HTTP: [v2_http_request(server.port, self.model, jpeg) for jpeg in jpegs],
            V2_GRPC: [grpc_request(self.model, jpeg) for jpeg in jpegs],
        }

    def _connect(self, way: str) -> Callable[[], Sender] | None:
        return (lambda: GrpcCall(self.grpc_port)) if way == V2_GRPC else None

    async def run(self, way: str, clients: int, seconds: float) -> LoadResult:
        return await closed_loop(
            HOST,
            self.server.port,
            self.requests[way],
            clients=clients,
            duration_s=seconds,
            connect=self._connect(way),
        )

    async def check(self) -> None:
        """One request each way: every answer a 200 with K probabilities, or RuntimeError."""
        for way in PROTOCOLS:
            answer = await self._one(way)
            if answer is None or answer.status != 200 or _probabilities(way, answer) != K:
                raise RuntimeError(f"{way}: no valid answer ({answer})")

    async def _one(self, way: str) -> Response | None:
        answers: list[Response] = []
        await closed_loop(
            HOST,
            self.server.port,
            self.requests[way][:1],
            clients=1,
            total=1,
            check=lambda _, response: answers.append(response),
            connect=self._connect(way),
        )
        return answers[0] if answers else None


def _probabilities(way: str, response: Response) -> int:
    """How many probabilities an answer of ``way`` holds."""
    if way == PREDICT:
        return len(json.loads(response.body))  # [{"name": ..., "prob": ...}, ...]
    if way == V2_HTTP:
        length = int(response.headers["inference-header-content-length"])
        outputs = json.loads(response.body[:length])["outputs"]
        probs = next(o for o in outputs if o["name"] == "top_k_probs")
        return int(probs["parameters"]["binary_data_size"]) // struct.calcsize("<f")
    answer = pb.ModelInferResponse.FromString(response.body)
    names = [output.name for output in answer.outputs]
    return len(answer.raw_output_contents[names.index("top_k_probs")]) // struct.calcsize("<f")


async def _measure(
    ways: Ways, clients_list: list[int], seconds: float, rounds: int
) -> ProtocolReport:
    server = ways.server
    report = ProtocolReport(ways.model, serving=server.serving())
    for way in PROTOCOLS:  # connections, the event loop's and the worker's first calls
        await ways.run(way, 8, 1.0)
    for clients in clients_list:
        results: dict[str, list[LoadResult]] = {way: [] for way in PROTOCOLS}
        cpu_s = dict.fromkeys(PROTOCOLS, 0.0)
        http_cpu_s = dict.fromkeys(PROTOCOLS, 0.0)
        batches = dict.fromkeys(PROTOCOLS, (0, 0))
        for turn in range(rounds):
            for way in PROTOCOLS[turn % 3 :] + PROTOCOLS[: turn % 3]:
                cpu, http_cpu = server.cpu_seconds(), server.cpu_seconds(http_only=True)
                before = server.batches_and_items() or (0, 0)
                results[way].append(await ways.run(way, clients, seconds))
                cpu_s[way] += server.cpu_seconds() - cpu
                http_cpu_s[way] += server.cpu_seconds(http_only=True) - http_cpu
                after = server.batches_and_items() or (0, 0)
                batches[way] = (
                    batches[way][0] + after[0] - before[0],
                    batches[way][1] + after[1] - before[1],
                )
        for way in PROTOCOLS:
            runs = results[way]
            report.rounds.setdefault(way, {})[clients] = [r.rate for r in runs]
            answered = max(1, sum(r.requests for r in runs))
            report.http_cpu_ms.setdefault(way, {})[clients] = 1000 * http_cpu_s[way] / answered
            together = LoadResult(
                requests=sum(r.requests for r in runs),
                seconds=sum(r.seconds for r in runs),
                statuses=sum((r.statuses for r in runs), start=Counter()),
                latencies_s=[s for r in runs for s in r.latencies_s],
                client_cpu_s=sum(r.client_cpu_s for r in runs),
            )
            report.points.append(
                Point(
                    system=way,
                    clients=clients,
                    images_per_s=statistics.median(r.rate for r in runs),
                    p50_ms=together.percentile_ms(50),
                    p99_ms=together.percentile_ms(99),
                    mean_batch=batches[way][1] / max(1, batches[way][0]),
                    errors=sum(n for status, n in together.statuses.items() if status != 200),
                    client_cpu_pct=100 * together.client_cpu_s / together.seconds,
                    server_cpu_ms=1000 * cpu_s[way] / answered,
                    serving=report.serving,
                )
            )
        print(table(report, [clients], header=clients == clients_list[0]), flush=True)
    return report


def measure(
    store: Path,
    jpegs: list[bytes],
    *,
    clients: list[int],
    seconds: float,
    rounds: int,
    threads: int,
) -> ProtocolReport:
    """Serve ``store`` with every setting at its default (and gRPC on a free port) and
    measure the three ways at each of ``clients``: ``rounds`` turns of ``seconds`` each."""
    defaults = Settings.model_fields
    grpc_port = free_port()
    with serve(
        "ours",
        store,
        batch_size=str(defaults["mb_batch_size"].default),
        max_latency=defaults["mb_max_latency"].default,
        threads=threads,
        settings={"MB_RUNTIME": "auto", "MB_DTYPE": "auto", "MB_GRPC_PORT": str(grpc_port)},
    ) as server:
        ways = Ways(server, grpc_port, jpegs)

        async def everything() -> ProtocolReport:
            # One event loop for every turn: grpc.aio binds to the loop it first ran in.
            await ways.check()
            return await _measure(ways, clients, seconds, rounds)

        return asyncio.run(everything())


def table(report: ProtocolReport, clients: list[int] | None = None, *, header: bool = True) -> str:
    """The report's points as a text table, with each way's ratio to /predict/tag."""
    lines = []
    if header:
        lines.append(
            f"{'clients':>7}  {'way':<12} {'images/s':>9} {'ratio':>6} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'batch':>6} {'server CPU ms/img':>17} {'of it HTTP':>10} "
            f"{'client CPU %':>12} {'non-200':>7}"
        )
    for point in report.points:
        if clients is not None and point.clients not in clients:
            continue
        r = report.ratio(point.system, point.clients) if point.system != PREDICT else None
        http_ms = report.http_cpu_ms.get(point.system, {}).get(point.clients, float("nan"))
        lines.append(
            f"{point.clients:>7}  {point.system:<12} {point.images_per_s:9.1f} "
            f"{'' if r is None else f'x{r:.2f}':>6} {point.p50_ms:8.1f} {point.p99_ms:8.1f} "
            f"{point.mean_batch:6.1f} {point.server_cpu_ms:17.2f} {http_ms:10.2f} "
            f"{point.client_cpu_pct:12.0f} {point.errors:7d}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.protocols",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--clients", default=",".join(map(str, CLIENTS)))
    parser.add_argument("--seconds", type=float, default=SECONDS, help="per turn of one way")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="turns of each way per level")
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument(
        "--store",
        type=Path,
        help="the model store to serve (default: the benchmark's export of EfficientNet-Lite0)",
    )
    parser.add_argument("--json", type=Path, help="write the figures as JSON")
    args = parser.parse_args(argv)
    jpegs = bench_jpegs()
    print(
        f"bench.protocols: {len(jpegs)} JPEGs, k={K}, {args.rounds} rounds of {args.seconds:g} s "
        f"per way and concurrency, {args.threads} threads",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="microbatch-protocols-") as scratch:
        store = args.store or export_bench_model(MODEL, Path(scratch) / MODEL)
        report = measure(
            store,
            jpegs,
            clients=[int(c) for c in args.clients.split(",")],
            seconds=args.seconds,
            rounds=args.rounds,
            threads=args.threads,
        )
    print(f"\nserving: {report.serving}; ratios to {PREDICT} (median of the rounds' ratios):")
    for line in protocol_ratios(report):
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
