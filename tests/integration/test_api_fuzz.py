"""API fuzz against a real server (``python -m app``, one tiny-model worker): no answer is a
server error, every error keeps the one JSON error shape, and the server outlives it all.

Two fuzzers, both deterministic (derandomized Hypothesis, fixed example counts):

* schemathesis reads the server's own ``/openapi.json`` and, for every operation in it (a new
  route is fuzzed without touching this file), sends its coverage cases (boundary values,
  missing and malformed inputs, undeclared methods) and Hypothesis-generated requests, valid
  and invalid, multipart and raw-image bodies included; the ``{name}`` routes also get the
  served model's name, so their handlers run past the 404. Its built-in response checks
  apply, except ``positive_data_acceptance``: a schema says "binary" where the server needs
  a decodable image, and cannot say that a v2 input's shape must match its data.
* Hypothesis alone for what the schema does not describe: the ``X-Request-Timeout`` and
  ``Accept`` headers, wrong or missing API keys, forms with any field names and several
  images, hand-built (and broken) multipart bodies, and damaged images in every accepted
  format, posted to the prediction routes and the v2 ``infer`` route.

About 1,100 requests, some 20 s with the server start-ups. What they found (a boundary over
the first form parser's limit, a client leaving mid-upload: both were 500s) is pinned at the end,
on a server of their own.

Borrowed from schemathesis 4.32 (pinned in constraints.txt): ``openapi.from_url``,
``Config.from_dict``, ``APIOperation.as_strategy``, ``Case.call`` / ``validate_response``
(documented), and ``BaseSchema.iter_coverage_cases`` (public, undocumented: what its CLI's
coverage phase runs). Its pytest plugin (``from_fixture``) is not used: with pytest 9.2 it
fails on ``Function._nodeid``, which pytest no longer has.
"""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from PIL import Image
from schemathesis import Case, GenerationMode, checks
from schemathesis.core.errors import InvalidSchema
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok, Result
from schemathesis.schemas import APIOperation, BaseSchema

from tests.forms import multipart_form
from tests.server import ServerProcess, alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny-test"  # the name tests.models.export_tiny gives the model
MAX_EXAMPLES = 30  # per operation and generation mode
HTTP_TIMEOUT_S = 20
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,  # the same requests on every run and machine
    database=None,
    deadline=None,  # the time limit is the module's timeout; answers vary on 2 shared cores
    # too_slow is timing-based: a busy CI machine would fail where a quiet one passes.
    # filter_too_much: negative mode for an operation with no constrained input (a lone free
    # string) filters everything out; `fuzz` then sees Unsatisfiable and accepts it.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
Operation = APIOperation[Any, Any, Any, Any]  # what get_all_operations gives


def readable(result: Result[Operation, InvalidSchema]) -> Operation:
    """The operation; one that schemathesis cannot read fails the test here."""
    assert isinstance(result, Ok), f"schemathesis cannot read an operation: {result.err()}"
    return result.ok()


@pytest.fixture(scope="module")
def server(tiny_store: Path) -> Iterator[ServerProcess]:
    with ServerProcess(MODEL_STORE=str(tiny_store), MB_WORKER_NUM="1", API_KEY=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "seed": 1,
            "headers": AUTH,  # the fuzzed requests pass the key; coverage cases also go without
            "request-timeout": HTTP_TIMEOUT_S,
            "generation": {"deterministic": True, "database": "none"},
            "checks": {
                "positive_data_acceptance": {"enabled": False},
                # 503 answers overload, start-up and shutdown; `check_answer` holds it to its
                # contract (Retry-After, our error body) instead.
                "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]},
            },
        }
    )
    return schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", config=config)


# --- what every answer must look like -------------------------------------------------------


def is_error_body(body: object, path: str = "") -> bool:
    """``{"error": {"type": str, "message": str}}``, nothing more (FastAPI's ``{"detail": ...}``
    is what an error that missed ``app.routers.errors`` would look like); on ``/v2`` the
    protocol's ``{"error": str, "type": str}``."""
    if path.startswith("/v2"):
        return (
            isinstance(body, dict)
            and sorted(body) == ["error", "type"]
            and all(isinstance(v, str) for v in body.values())
        )
    if not (isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], dict)):
        return False
    error = body["error"]
    return sorted(error) == ["message", "type"] and all(isinstance(v, str) for v in error.values())


def check_answer(
    status: int,
    headers: httpx.Headers | dict[str, str],
    body: bytes,
    *,
    timeout_asked: bool,
    path: str = "",
) -> None:
    """No server error (a 503 with Retry-After, or a 504 the client asked for with
    X-Request-Timeout, excepted); every JSON error exactly ``{"error": {"type", "message"}}``."""
    content_type = headers.get("content-type", "")
    if status >= 400 and "json" in content_type:
        try:
            error = json.loads(body)
        except ValueError:
            raise AssertionError(f"{status} says JSON but is not: {body[:200]!r}") from None
        assert is_error_body(error, path), f"{status} not in our error shape: {body[:500]!r}"
    if status == 503:
        assert "json" in content_type, f"503 without our JSON error body: {body!r}"
        assert headers.get("retry-after", "").isdigit(), "503 without a Retry-After in seconds"
    elif status == 504 and timeout_asked:
        answer = json.loads(body)
        kind = answer["type"] if path.startswith("/v2") else answer["error"]["type"]
        assert "json" in content_type and kind == "deadline_exceeded"
    else:
        assert status < 500, f"server error {status}: {body[:500]!r}"


def error_shape(ctx: Any, response: schemathesis.Response, case: Case[Operation]) -> None:
    """schemathesis check: ``check_answer`` (not_a_server_error runs beside it)."""
    headers = {name: values[0] for name, values in response.headers.items()}
    check_answer(
        response.status_code, headers, response.content, timeout_asked=False, path=case.path
    )


def two_ks(case: Case[Operation]) -> bool:
    """``k`` both as a form field and in the query, with different values: each valid by the
    schema (which cannot relate the two), and refused together (documented)."""
    form_k = case.body.get("k") if isinstance(case.body, dict) else None
    query_k = (case.query or {}).get("k")
    return form_k is not None and query_k is not None and str(form_k) != str(query_k)


def call_and_check(case: Case[Operation], headers: dict[str, str] | None = None) -> None:
    excluded = [checks.positive_data_acceptance] if two_ks(case) else []
    try:
        case.call_and_validate(
            headers=headers, additional_checks=[error_shape], excluded_checks=excluded
        )
    except FailureGroup as exc:  # a BaseExceptionGroup: let pytest and Hypothesis see a failure
        raise AssertionError(str(exc)) from None


# --- schemathesis over the OpenAPI schema ---------------------------------------------------


def fuzz(operation: Operation, mode: GenerationMode, **path_parameters: str) -> None:
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters or None)

    @FUZZ_SETTINGS
    @given(case=strategy)
    def run(case: Case[Operation]) -> None:
        call_and_check(case)

    try:
        run()
    except Unsatisfiable:
        # Every input of the operation is unconstrained (no parameters, or one free string):
        # there is no invalid request to make. Positive mode always has cases.
        assert mode is GenerationMode.NEGATIVE


def coverage_cases(schema: BaseSchema, operation: Operation) -> Iterator[Case[Operation]]:
    yield from schema.iter_coverage_cases(
        operation,
        generation_modes=list(GenerationMode),
        generation_config=schema.config.generation_for(operation=operation),
    )


def test_schema_covers_every_route(api_schema: BaseSchema) -> None:
    """The fuzz reaches what the server serves: every route below is in its schema."""
    labels = {readable(result).label for result in api_schema.get_all_operations()}
    assert labels >= {
        "POST /predict/embedding",
        "POST /predict/tag",
        "GET /healthz",
        "GET /readyz",
        "GET /metrics",
        "GET /info",
        "GET /tags",
        "GET /v2",
        "GET /v2/health/live",
        "GET /v2/health/ready",
        "GET /v2/models/{name}",
        "GET /v2/models/{name}/ready",
        "POST /v2/models/{name}/infer",
        "GET /v2/models/{name}/config",
        "GET /v2/models/stats",
        "GET /v2/models/{name}/stats",
    }


def test_fuzz_every_operation(api_schema: BaseSchema, subtests: pytest.Subtests) -> None:
    for result in api_schema.get_all_operations():
        operation = readable(result)  # an operation schemathesis cannot read fails the test here
        with subtests.test(msg=f"{operation.label} coverage"):
            for case in coverage_cases(api_schema, operation):
                # The key replaces the token the case made up, but is not added where the
                # case leaves the header out on purpose (it expects a 401).
                sends_token = "authorization" in {name.lower() for name in case.headers or {}}
                call_and_check(case, AUTH if sends_token else None)
        for mode in GenerationMode:
            with subtests.test(msg=f"{operation.label} {mode.value}"):
                fuzz(operation, mode)
            if "{name}" in operation.path:
                with subtests.test(msg=f"{operation.label} {mode.value}, name={MODEL}"):
                    fuzz(operation, mode, name=MODEL)


# --- Hypothesis: what the schema does not describe ------------------------------------------


def _image(fmt: str, **params: Any) -> bytes:
    pixels = np.random.default_rng(len(fmt)).integers(0, 256, size=(16, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **params)
    return buffer.getvalue()


SEED_IMAGES = [
    _image("PNG"),
    _image("JPEG", quality=80),
    _image("JPEG", progressive=True),
    _image("GIF"),
    _image("BMP"),
    _image("WEBP", quality=70),
    _image("WEBP", lossless=True),
]


def _damaged(seed: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    data = bytearray(seed)
    for position, value in flips:
        data[position % len(data)] = value
    return bytes(data if cut is None else data[: cut % (len(data) + 1)])


images = st.one_of(
    st.sampled_from(SEED_IMAGES),
    st.builds(
        _damaged,
        st.sampled_from(SEED_IMAGES),
        st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), max_size=6),
        st.none() | st.integers(0, 4096),
    ),
    st.binary(max_size=64),
)
short_text = st.text(max_size=12)
# What a header value can be (printable ASCII, no space at either end); query values and
# form fields take any text.
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12).map(
    str.strip
)
numbers = st.one_of(
    st.integers(-5, 2000).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["", "1e-9", "1e-300", "0x10", "1_0", "inf", "-0", "9" * 5000]),
    header_text,
)
headers = st.fixed_dictionaries(
    {
        "Authorization": st.sampled_from(
            [AUTH["Authorization"]] * 6
            + ["Bearer nope", "Basic eDp5", "Bearer", f"bearer  {API_KEY}"]
        )
    },
    optional={
        "X-Request-Timeout": numbers,
        "Accept": st.sampled_from(["application/octet-stream", "application/json", "*/*", "x"]),
    },
)
# (field name, file name or None for a text field, content)
form_parts = st.lists(
    st.tuples(
        st.sampled_from(["image", "image", "k"]) | short_text,
        st.none() | short_text,
        images | (numbers | short_text).map(str.encode),
    ),
    max_size=5,
)
# Boundaries of every length; the longest: test_long_multipart_boundary.
boundaries = (
    st.sampled_from(["fuzzboundary", "x" * 70, "x" * 256, "x" * 300, "-", '"quoted"']) | header_text
)
raw_types = st.sampled_from(
    ["image/png", "image/jpeg", "application/octet-stream", "image/x-nope", "text/plain", ""]
)


@st.composite
def uploads(draw: st.DrawFn) -> tuple[str, bytes]:
    """(Content-Type, body): a multipart form, maybe cut short, or a raw body."""
    if draw(st.booleans()):
        boundary = draw(boundaries)
        body = multipart_form(draw(form_parts), boundary)
        if draw(st.integers(0, 9)) == 0:
            body = body[: draw(st.integers(0, len(body)))]
        return f"multipart/form-data; boundary={boundary}", body
    return draw(raw_types), draw(images)


@st.composite
def infer_bodies(draw: st.DrawFn) -> bytes:
    data = [base64.b64encode(image).decode() for image in draw(st.lists(images, max_size=3))]
    data += draw(st.lists(short_text, max_size=1))  # not base64
    shape = draw(st.sampled_from([len(data), len(data), 0, -1, 2**40]))
    body: dict[str, Any] = {
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [shape], "data": data}]
    }
    if draw(st.booleans()):
        names = st.sampled_from(["embedding", "top_k_probs", "top_k_indices"]) | short_text
        body["outputs"] = [{"name": name} for name in draw(st.lists(names, max_size=4))]
    if draw(st.booleans()):
        k = st.integers(-2, 1200) | st.booleans() | st.floats() | short_text | st.none()
        body["parameters"] = {"k": draw(k)}
    return json.dumps(body).encode()


@st.composite
def predictions(draw: st.DrawFn) -> dict[str, Any]:
    """``httpx.Client.build_request`` arguments for a prediction or a v2 inference."""
    sent_headers = draw(headers)
    route = draw(st.sampled_from(["/predict/embedding", "/predict/tag", "/v2/models/{}/infer"]))
    if route.startswith("/v2"):
        url = route.format(draw(st.sampled_from([MODEL, MODEL, "resnet50"])))
        sent_headers["Content-Type"] = "application/json"
        return {"url": url, "headers": sent_headers, "content": draw(infer_bodies())}
    sent_headers["Content-Type"], body = draw(uploads())
    params = draw(st.fixed_dictionaries({}, optional={"k": numbers | short_text}))
    return {"url": route, "headers": sent_headers, "params": params, "content": body}


def test_fuzz_uploads_headers_and_infer_bodies(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:

        @settings(FUZZ_SETTINGS, max_examples=400)
        @given(request=predictions())
        def run(request: dict[str, Any]) -> None:
            response = client.send(client.build_request("POST", **request))
            timeout_asked = "X-Request-Timeout" in request["headers"]
            check_answer(
                response.status_code,
                response.headers,
                response.content,
                timeout_asked=timeout_asked,
                path=response.request.url.path,
            )

        run()


def test_server_outlived_the_fuzz(server: ServerProcess) -> None:
    """Still serving, with its worker, and it stops cleanly, having logged no traceback."""
    assert alive(server.pid)
    status, readiness = server.readiness()
    assert status == 200, readiness
    assert all(alive(pid) for pid in server.worker_pids())
    assert server.stop() == 0, server.output
    assert "Traceback" not in server.output, server.output


# --- what the fuzzers found, fixed, kept as tests on a server of their own ------------------


@pytest.fixture(scope="module")
def findings_server(tiny_store: Path) -> Iterator[ServerProcess]:
    with ServerProcess(MODEL_STORE=str(tiny_store), MB_WORKER_NUM="1", API_KEY=API_KEY) as server:
        yield server


@pytest.mark.parametrize("route", ["/predict/embedding", "/predict/tag"])
def test_long_multipart_boundary(findings_server: ServerProcess, route: str) -> None:
    """Once a 500 (python-multipart refused a boundary over 256 characters with an error of
    its own); a long boundary is parsed like any other: a form without the image is a 422
    that says so, a form with it is answered."""
    boundary = "b" * 300
    content_type = f"multipart/form-data; boundary={boundary}"
    empty = httpx.post(
        f"{findings_server.base_url}{route}",
        content=f"--{boundary}--\r\n".encode(),
        headers={**AUTH, "Content-Type": content_type},
        timeout=HTTP_TIMEOUT_S,
    )
    check_answer(empty.status_code, empty.headers, empty.content, timeout_asked=False)
    assert empty.status_code == 422, empty.text
    assert "the form field 'image' is missing" in empty.json()["error"]["message"]
    image = multipart_form([("image", "cat.png", SEED_IMAGES[0])], boundary)
    answered = httpx.post(
        f"{findings_server.base_url}{route}",
        content=image,
        headers={**AUTH, "Content-Type": content_type},
        timeout=HTTP_TIMEOUT_S,
    )
    assert answered.status_code == 200, answered.text


def _answers(server: ServerProcess, route: str) -> dict[str, float]:
    """``microbatch_http_requests_total`` for ``route``, by status (every model together)."""
    pattern = re.compile(
        rf'^microbatch_http_requests_total\{{model="[^"]*",route="{re.escape(route)}",'
        rf'status="(\d+)",version="[^"]*"\}} (\S+)$'
    )
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=HTTP_TIMEOUT_S).text
    counts: dict[str, float] = {}
    for match in map(pattern.match, metrics.splitlines()):
        if match is not None:
            counts[match[1]] = counts.get(match[1], 0.0) + float(match[2])
    return counts


@pytest.mark.parametrize(
    "content_type, part",
    [
        ("image/png", b"\x89PNG"),
        ("multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="image"'),
    ],
    ids=["raw", "multipart"],
)
def test_client_leaving_mid_upload(
    findings_server: ServerProcess, content_type: str, part: bytes
) -> None:
    route = "/predict/embedding"
    before = _answers(findings_server, route)
    head = (
        f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {AUTH['Authorization']}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", findings_server.port)) as sock:
        sock.sendall(head.encode() + part)  # then leave, 1000 bytes promised
    deadline = time.monotonic() + 10
    while (after := _answers(findings_server, route)) == before and time.monotonic() < deadline:
        time.sleep(0.05)  # the server counts the request once it gave up on it
    counted = {s: n - before.get(s, 0) for s, n in after.items() if n != before.get(s, 0)}
    assert counted == {"499": 1.0}  # the client left: not a server error
