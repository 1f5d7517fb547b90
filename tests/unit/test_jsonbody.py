"""``app.jsonbody``: answers written fast, reading back exactly as the standard library's."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from starlette.responses import JSONResponse

from app.jsonbody import JsonBody, dumps


def standard(document: object, *, allow_nan: bool = False) -> bytes:
    """What Starlette's JSONResponse (the standard library) writes."""
    listed = document.tolist() if isinstance(document, np.ndarray) else document
    return json.dumps(
        listed, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan
    ).encode()


@pytest.mark.parametrize("scale", [1e-30, 1e-9, 1e-3, 1.0, 1e3, 1e20])
def test_an_embedding_reads_back_bit_for_bit_as_the_standard_librarys(scale: float) -> None:
    rng = np.random.default_rng(48)
    vectors = (rng.standard_normal((3, 1280)) * scale).astype(np.float32)
    for document in (vectors, vectors[0]):
        fast = dumps(document)
        assert json.loads(fast) == json.loads(standard(document))  # every float equal
        back = np.asarray(json.loads(fast), dtype=np.float32)
        assert back.tobytes() == document.tobytes()


def test_text_and_structure_are_written_as_the_standard_library_writes_them() -> None:
    document = [
        {"name": "tabby, tabby cat", "prob": 0.8123},
        {"name": 'café ✓ "quoted" \\ \n', "prob": 0.25},
        {"name": "ints", "prob": [0, -1, 2**63, 1.5]},
    ]
    assert dumps(document) == standard(document)


def test_nan_and_infinity_are_refused_as_before_or_written_as_tokens() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="not JSON compliant"):
            dumps([1.0, bad])
        assert dumps([1.0, bad], allow_nan=True) == standard([1.0, bad], allow_nan=True)
    with pytest.raises(ValueError, match="not JSON compliant"):
        dumps(np.array([0.5, np.nan], dtype=np.float32))


def test_null_and_what_orjson_refuses_take_the_standard_librarys_way() -> None:
    assert dumps({"a": None, "b": [1.0]}) == b'{"a":null,"b":[1.0]}'
    lone_surrogate = "\ud800"  # orjson refuses it; the standard library writes it escaped
    with pytest.raises(UnicodeEncodeError):  # as Starlette's JSONResponse fails on it too
        standard(lone_surrogate)
    with pytest.raises(UnicodeEncodeError):
        dumps(lone_surrogate)
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps({"a": object()})


def test_ensure_ascii_escapes_as_the_standard_library_does() -> None:
    # v2's answers: the request's id and BYTES outputs echoed, escaped as they always were.
    document = {"id": "café \ud800", "outputs": [{"data": ["✓", "plain"]}], "n": [0.5]}
    expected = json.dumps(document, separators=(",", ":")).encode()  # ensure_ascii=True
    assert dumps(document, ensure_ascii=True) == expected
    assert dumps({"id": "plain", "n": [0.5]}, ensure_ascii=True) == b'{"id":"plain","n":[0.5]}'


def test_the_response_carries_the_same_body_and_headers_as_starlettes() -> None:
    document = [{"name": "x", "prob": 0.5}]
    ours, theirs = JsonBody(document), JSONResponse(document)
    assert ours.body == theirs.body
    assert ours.headers["content-type"] == theirs.headers["content-type"] == "application/json"
