"""app.client against httpx.MockTransport: what it sends, how it reads answers, when it retries."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.client import AsyncClient, Client, ServerReplyError, Tag

CLIENT_FILE = Path(__file__).resolve().parents[2] / "app" / "client.py"
MODEL_ID = "tiny@0123456789ab"
Handler = Callable[[httpx.Request], httpx.Response]


def client(handler: Handler, **options: object) -> Client:
    return Client("http://server", transport=httpx.MockTransport(handler), **options)  # type: ignore[arg-type]


def unavailable(retry_after: str | None = "0", kind: str = "queue_full") -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    body = {"error": {"type": kind, "message": "try later"}}
    return httpx.Response(503, json=body, headers=headers)


def vectors(rows: np.ndarray) -> httpx.Response:
    shape = ",".join(map(str, rows.shape))
    headers = {"X-Embedding-Shape": shape, "X-Model-Id": MODEL_ID}
    return httpx.Response(200, content=rows.astype("<f4").tobytes(), headers=headers)


def image_parts(request: httpx.Request) -> list[bytes]:
    """The bytes of each multipart ``image`` part, in order."""
    boundary = request.headers["content-type"].split("boundary=")[1].encode()
    parts = request.content.split(b"--" + boundary)[1:-1]
    return [p.split(b"\r\n\r\n", 1)[1][:-2] for p in parts if b'name="image"' in p]


def test_embed_sends_the_images_in_order_and_reads_the_float32_rows() -> None:
    seen: list[httpx.Request] = []
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return vectors(rows)

    with client(handler, api_key="secret", timeout_s=2.5) as c:
        got = c.embed([b"a", b"bb", b"ccc"], request_id="my-id")
    request = seen[0]
    assert request.url.path == "/predict/embedding"
    assert image_parts(request) == [b"a", b"bb", b"ccc"]
    assert request.headers["accept"] == "application/octet-stream"
    assert request.headers["x-request-id"] == "my-id"
    assert request.headers["x-request-timeout"] == "2.5"
    assert request.headers["authorization"] == "Bearer secret"
    assert got.dtype == np.float32 and got.flags.writeable
    np.testing.assert_array_equal(got, rows)
    assert c.model_id == MODEL_ID


def test_one_image_gives_a_vector_from_a_path_or_a_file_object(tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert image_parts(request) == [b"pixels"]
        return vectors(np.ones((1, 4), np.float32)[0])

    path = tmp_path / "cat.jpg"
    path.write_bytes(b"pixels")
    with client(handler) as c:
        for image in (str(path), path, io.BytesIO(b"pixels"), b"pixels"):
            assert c.embed(image).shape == (4,)


def test_a_list_of_one_image_gives_a_list_though_the_server_answers_one() -> None:
    one = [{"name": "cat", "prob": 0.75}]

    def handler(request: httpx.Request) -> httpx.Response:
        assert image_parts(request) == [b"pixels"]
        if request.url.path == "/predict/tag":
            return httpx.Response(200, json=one)
        return vectors(np.arange(4, dtype=np.float32))  # one image: the server's 1-D answer

    with client(handler) as c:
        rows = c.embed([b"pixels"])
        np.testing.assert_array_equal(rows, np.arange(4, dtype=np.float32)[None])
        assert c.tag((b"pixels",)) == [[Tag("cat", 0.75)]]
        assert c.tag(b"pixels") == [Tag("cat", 0.75)]


def test_each_call_gets_a_fresh_request_id_without_one_given() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=["a", "b"])

    with client(handler) as c:
        assert c.tags() == ["a", "b"]
        c.tags()
    ids = [request.headers["x-request-id"] for request in seen]
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    assert all("authorization" not in request.headers for request in seen)
    assert seen[0].headers["x-request-timeout"] == "30"


@pytest.mark.parametrize(
    ("shape", "rows", "several"),
    [
        (None, np.zeros(4), False),  # no header
        ("4", np.zeros(5), False),  # the bytes do not fit the shape
        ("1,4", np.zeros((1, 4)), False),  # one image answered as a matrix
        ("4", np.zeros(4), True),  # several images answered as one vector
        ("4x", np.zeros(4), False),
    ],
)
def test_an_embedding_answer_that_does_not_fit_raises(
    shape: str | None, rows: np.ndarray, several: bool
) -> None:
    headers = {"X-Embedding-Shape": shape} if shape is not None else {}
    body = rows.astype("<f4").tobytes()
    with client(lambda _: httpx.Response(200, content=body, headers=headers)) as c:
        with pytest.raises(ValueError, match="X-Embedding-Shape"):
            c.embed([b"a", b"b"] if several else b"a")


def test_tag_reads_tags_for_one_image_and_lists_for_several() -> None:
    forms: list[bytes] = []
    one = [{"name": "cat", "prob": 0.75}, {"name": "dog", "prob": 0.25}]

    def handler(request: httpx.Request) -> httpx.Response:
        forms.append(request.content)
        several = len(image_parts(request)) > 1
        return httpx.Response(200, json=[one, one[::-1]] if several else one)

    with client(handler) as c:
        assert c.tag(b"x", k=2) == [Tag("cat", 0.75), Tag("dog", 0.25)]
        assert c.tag((b"x", b"y")) == [
            [Tag("cat", 0.75), Tag("dog", 0.25)],
            [Tag("dog", 0.25), Tag("cat", 0.75)],
        ]
    assert b'name="k"\r\n\r\n2\r\n' in forms[0] and b'name="k"\r\n\r\n5\r\n' in forms[1]


def test_ready_is_false_on_503_and_info_is_the_json() -> None:
    answers = iter([httpx.Response(200, json={}), httpx.Response(503, json={})])
    with client(lambda _: next(answers)) as c:
        assert c.ready() is True
        assert c.ready() is False
    with client(lambda _: httpx.Response(200, json={"model_id": MODEL_ID})) as c:
        assert c.info() == {"model_id": MODEL_ID}


def test_a_503_with_retry_after_is_retried_at_most_retries_times() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["x-request-id"])
        return unavailable("0")

    with client(handler, retries=2) as c, pytest.raises(ServerReplyError) as caught:
        c.embed(b"x")
    assert len(calls) == 3 and len(set(calls)) == 1  # one call, one id through its retries
    error = caught.value
    assert (error.status, error.type, error.message) == (503, "queue_full", "try later")
    assert error.retry_after_s == 0.0 and error.request_id is None


def test_a_429_with_retry_after_is_retried_as_a_503_is() -> None:
    over = {"error": {"type": "over_quota", "message": "tenant bulk is over its quota"}}
    answers = iter(
        [httpx.Response(429, json=over, headers={"Retry-After": "0"}), vectors(np.ones(2))]
    )
    with client(lambda _: next(answers), retries=1) as c:
        assert c.embed(b"x").tolist() == [1.0, 1.0]


def test_a_retry_that_succeeds_returns_the_answer() -> None:
    answers = iter([unavailable("0", "worker_died"), unavailable("0"), vectors(np.ones(3))])
    with client(lambda _: next(answers), retries=2) as c:
        assert c.embed(b"x").tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "answer",
    [
        unavailable("11"),  # longer than max_retry_wait_s
        unavailable(None),  # no Retry-After
        unavailable("soon"),  # unreadable
        unavailable("Wed, 21 Oct 2015 07:28:00 -0000"),  # a date without a zone: unreadable too
        httpx.Response(500, json={"error": {"type": "inference_error", "message": "x"}}),
        httpx.Response(429),  # over quota, but no Retry-After
    ],
)
def test_other_failures_are_not_retried(answer: httpx.Response) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return answer

    with client(handler, retries=5, max_retry_wait_s=10) as c, pytest.raises(ServerReplyError):
        c.tags()
    assert calls == 1


def test_an_error_body_not_in_the_servers_shape_keeps_the_status_and_text() -> None:
    with client(lambda _: httpx.Response(502, text="<h1>Bad gateway</h1>")) as c:
        with pytest.raises(ServerReplyError) as caught:
            c.info()
    assert (caught.value.status, caught.value.type) == (502, "http_error")
    assert "Bad gateway" in caught.value.message
    assert str(caught.value).startswith("502 http_error")


def test_retry_after_as_an_http_date_is_read() -> None:
    answers = iter([unavailable("Wed, 21 Oct 2015 07:28:00 GMT"), httpx.Response(200, json=[])])
    with client(lambda _: next(answers)) as c:
        assert c.tags() == []  # a date in the past: retry at once


@pytest.mark.parametrize(
    ("option", "value"), [("timeout_s", 0), ("retries", -1), ("max_retry_wait_s", -1.0)]
)
def test_bad_settings_fail_at_construction_naming_the_setting(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        Client("http://server", **{option: value})  # type: ignore[arg-type]


def test_no_images_and_text_mode_files_are_refused(tmp_path: Path) -> None:
    with client(lambda _: httpx.Response(200)) as c:
        with pytest.raises(ValueError, match="no images"):
            c.embed([])
        with open(tmp_path / "x.txt", "w+") as text, pytest.raises(TypeError, match="binary"):
            c.embed(text)  # type: ignore[arg-type]


async def test_async_client_retries_and_parses_like_the_sync_one() -> None:
    answers = iter([unavailable("0"), vectors(np.eye(2, dtype=np.float32))])
    transport = httpx.MockTransport(lambda _: next(answers))
    async with AsyncClient("http://server", transport=transport, retries=1) as c:
        got = await c.embed([b"a", b"b"])
        assert c.model_id == MODEL_ID
    np.testing.assert_array_equal(got, np.eye(2))


async def test_async_client_gives_up_after_its_retries() -> None:
    transport = httpx.MockTransport(lambda _: unavailable("0", "not_ready"))
    async with AsyncClient("http://server", transport=transport, retries=0) as c:
        with pytest.raises(ServerReplyError) as caught:
            await c.ready()  # a 503 from /readyz is an answer, not an error
            await c.tag(b"x")
    assert caught.value.type == "not_ready"


async def test_the_async_client_has_the_sync_ones_methods_awaited() -> None:
    for name in ("embed", "tag", "info", "ready", "tags"):
        method = getattr(AsyncClient, name)
        assert inspect.iscoroutinefunction(method) and method.__name__ == name
        assert inspect.signature(method) == inspect.signature(getattr(Client, name))
        assert method.__doc__ and method.__doc__ == getattr(Client, name).__doc__

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/predict/tag":
            one = [{"name": "cat", "prob": 0.75}]
            return httpx.Response(200, json=[one, one] if len(image_parts(request)) > 1 else one)
        answers = {"/info": {"model_id": MODEL_ID}, "/tags": ["cat"]}
        return httpx.Response(200, json=answers[request.url.path], headers={"X-Model-Id": MODEL_ID})

    async with AsyncClient("http://server", transport=httpx.MockTransport(handler)) as c:
        assert await c.tag(b"x", k=1) == [Tag("cat", 0.75)]
        assert await c.tag([b"x", b"y"]) == [[Tag("cat", 0.75)], [Tag("cat", 0.75)]]
        assert await c.info() == {"model_id": MODEL_ID}
        assert await c.tags() == ["cat"] and c.model_id == MODEL_ID
        with pytest.raises(TypeError, match="binary"):
            await c.embed(io.StringIO("text"))  # type: ignore[arg-type]


def test_the_module_can_be_copied_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = ast.parse(CLIENT_FILE.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert {name.split(".")[0] for name in imported} <= {"httpx", "numpy", *sys.stdlib_module_names}
    copy = tmp_path / "their_client.py"
    copy.write_text(CLIENT_FILE.read_text())
    spec = importlib.util.spec_from_file_location("their_client", copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "their_client", module)  # dataclasses look themselves up
    spec.loader.exec_module(module)
    answer = httpx.Response(200, json=[{"name": "cat", "prob": 1.0}])
    with module.Client("http://server", transport=httpx.MockTransport(lambda _: answer)) as c:
        assert c.tag(b"x")[0] == module.Tag("cat", 1.0)


def test_model_chooses_the_model_for_every_call_or_one() -> None:
    """``model=`` on the client is every call's ``?model=``; on a call, that call's."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/predict/embedding":
            return vectors(np.zeros(2, np.float32))
        if request.url.path == "/tags":
            return httpx.Response(200, json=["a"])
        return httpx.Response(200, json=[{"name": "a", "prob": 1.0}])

    with client(handler, model="tagger") as c:
        c.embed(b"x")
        c.tag(b"x", k=1, model="other")
        c.tags()
    with client(handler) as c:
        c.embed(b"x")
    assert [r.url.params.get("model") for r in seen] == ["tagger", "other", "tagger", None]


async def test_the_async_client_chooses_a_model_too() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return vectors(np.zeros(2, np.float32))

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://server", transport=transport, model="a") as c:
        await c.embed(b"x")
        await c.embed(b"x", model="b")
    assert [r.url.params["model"] for r in seen] == ["a", "b"]
