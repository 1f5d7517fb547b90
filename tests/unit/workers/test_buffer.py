"""The shared buffer: encoded uploads packed end to end, the rest inline; pixel rows."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from app.workers.buffer import InputBuffer
from tests.server import shm_files


@pytest.fixture
def buffer() -> Iterator[InputBuffer]:
    created = InputBuffer.create(100)
    yield created
    created.unlink()
    created.close()


def test_pack_fills_the_buffer_in_order_and_sends_the_rest_inline(buffer: InputBuffer) -> None:
    blobs = [b"a" * 60, b"b" * 60, b"c" * 40, b"d"]
    spans, inline = buffer.pack(blobs)
    assert spans == ((0, 60), None, (60, 40), None)
    assert inline == (None, b"b" * 60, None, b"d")
    assert [buffer.blob(s) if s else i for s, i in zip(spans, inline, strict=True)] == blobs


def test_images_are_views_of_the_first_rows(buffer: InputBuffer) -> None:
    rows = buffer.images(2, (4, 4, 3))
    rows[1] = 9
    assert rows.shape == (2, 4, 4, 3)
    assert np.array_equal(buffer.raw[48:96], np.full(48, 9, dtype=np.uint8))


def test_a_second_mapping_sees_what_the_first_wrote(buffer: InputBuffer) -> None:
    """The worker maps the pool's file: both see the same bytes."""
    other = InputBuffer(buffer.path, buffer.size)
    try:
        buffer.pack([b"hello"])
        assert other.blob((0, 5)) == b"hello"
    finally:
        other.close()


def test_unlinking_leaves_the_mapping_usable(buffer: InputBuffer) -> None:
    buffer.unlink()
    buffer.pack([b"still here"])
    assert buffer.blob((0, 10)) == b"still here"
    buffer.close()
    buffer.close()  # idempotent


def test_the_file_is_named_after_the_process_that_made_it(buffer: InputBuffer) -> None:
    # tests.server.shm_files finds a server's leftovers by this name, among other tests'.
    name = Path(buffer.path).name
    assert name.startswith(f"microbatch-{os.getpid()}-")
    if Path(buffer.path).parent == Path("/dev/shm"):  # where it has room
        assert name in shm_files(os.getpid())
