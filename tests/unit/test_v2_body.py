"""A compressed v2 body (``Content-Encoding``, tritonclient's
``request_compression_algorithm``): inflated within the body limit, or refused by type."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from app.errors import InvalidRequest, PayloadTooLarge
from app.v2.http_body import decoded

BODY = b'{"inputs": []}'


def test_gzip_deflate_and_identity_give_the_body_as_sent() -> None:
    assert decoded(gzip.compress(BODY), "gzip", 100) == BODY
    assert decoded(zlib.compress(BODY), "Deflate", 100) == BODY
    assert decoded(BODY, None, 100) == decoded(BODY, "identity", 100) == BODY


def test_a_body_that_inflates_past_the_limit_is_413_however_small_it_came() -> None:
    bomb = gzip.compress(bytes(10_000_000))  # 10 KB on the wire
    assert len(bomb) < 20_000
    with pytest.raises(PayloadTooLarge, match="decompresses past 1000000 bytes"):
        decoded(bomb, "gzip", 1_000_000)


@pytest.mark.parametrize(
    ("raw", "coding", "says"),
    [
        (gzip.compress(BODY)[:-12], "gzip", "end before their end"),
        (BODY, "gzip", "not gzip data"),
        (BODY, "br", "send identity, gzip or deflate"),
    ],
    ids=["truncated", "corrupt", "unknown"],  # gzip stamps its time: ids of bytes would differ
)
def test_a_truncated_corrupt_or_unknown_coding_is_a_422(raw: bytes, coding: str, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says):
        decoded(raw, coding, 100)


@pytest.mark.parametrize(
    "extra",
    [
        {"parameters": {"binary_data_output": "yes"}},
        {"outputs": [{"name": "embedding", "parameters": {"binary_data": 1}}]},
    ],
)
def test_a_binary_flag_that_is_not_a_bool_is_refused_before_the_model_runs(
    extra: dict[str, object],
) -> None:
    """Found by a review: checked only as the answer was written, after the model ran (the
    422 was right, the compute and the quota spent)."""
    from app.v2.http_body import parse

    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["eA=="]}]}
    with pytest.raises(InvalidRequest, match="must be true or false"):
        parse(json.dumps(body | extra).encode(), None)
