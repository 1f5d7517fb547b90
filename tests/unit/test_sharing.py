"""A broker worker computes identical requests once (``app.broker.worker.sharing``): those
in one batch, and a repeat that comes a batch later; only requests their front end marked
(its response cache on, not asked afresh), only the same bytes, task, k and version; never
an error kept."""

from __future__ import annotations

import numpy as np
import pytest

from app.broker.wire.reply import decode_reply, encode_answer
from app.broker.wire.request import Request, decode_request, encode_request
from app.broker.worker.entries import replies
from app.broker.worker.sharing import Sharing
from app.broker.worker.stats import ConsumerStats
from app.errors import InferenceError, InvalidImage
from app.jobs import Task, TopK

SERVED = "m@aaaaaaaaaaaa"


def request(
    image: bytes, *, k: int = 5, shared: bool = True, request_id: str = "r", task: Task = Task.TAG
) -> Request:
    fields = encode_request(request_id, "fe", task, k, 1000, image, shared=shared)
    return decode_request({k.encode(): v for k, v in fields.items()}, 1 << 20)


def answer_of(marker: int) -> TopK:
    return TopK(np.array([marker, 0]), np.array([0.9, 0.1], np.float32))


class Model:
    """Computes each request's answer from its first image byte; counts what it ran."""

    def __init__(self) -> None:
        self.ran: list[list[bytes]] = []

    def __call__(self, requests: list[Request]) -> tuple[list[object], int]:
        self.ran.append([r.image for r in requests])
        return [
            InvalidImage("bad") if r.image.startswith(b"bad") else answer_of(r.image[0])
            for r in requests
        ], len(requests)


def test_the_wire_carries_the_mark_and_only_a_front_end_s_mark_shares() -> None:
    assert request(b"a").shared and not request(b"a", shared=False).shared
    fields = encode_request("r", "fe", Task.TAG, 5, 1000, b"a")
    assert b'"sh"' not in fields["h"]  # an unmarked entry is as it was before


def test_identical_requests_in_a_batch_run_once_and_each_gets_the_answer() -> None:
    sharing, model = Sharing(), Model()
    batch = [
        request(b"\x01x", request_id="a"),
        request(b"\x02y", request_id="b"),
        request(b"\x01x", request_id="c"),  # a's bytes: a's answer
        request(b"\x01x", request_id="d", shared=False),  # not marked: runs
        request(b"\x01x", request_id="e", k=3),  # another k: runs
    ]
    answers, size, split = sharing.run(SERVED, Task.TAG, batch, model)
    assert model.ran == [[b"\x01x", b"\x02y", b"\x01x", b"\x01x"]] and size == 4
    assert split.same_as == {2: 0} and split.shared == 1
    assert answers[2] is not None and answers[2] is answers[0]
    assert [int(a.indices[0]) for a in answers] == [1, 2, 1, 1, 1]  # type: ignore[attr-defined]
    # The same bytes and k for another task (a batch is of one task): computed again.
    both = request(b"\x01x", task=Task.EMBEDDING_AND_TAG)
    _, _, split = sharing.run(SERVED, Task.EMBEDDING_AND_TAG, [both], model)
    assert len(model.ran) == 2 and split.shared == 0


def test_a_repeat_a_batch_later_is_answered_without_the_model_but_not_another_version_s() -> None:
    sharing, model = Sharing(), Model()
    sharing.run(SERVED, Task.TAG, [request(b"\x07z")], model)
    answers, _, split = sharing.run(SERVED, Task.TAG, [request(b"\x07z", request_id="b")], model)
    assert len(model.ran) == 1 and split.kept and split.shared == 1
    assert int(answers[0].indices[0]) == 7  # type: ignore[attr-defined]
    assert not answers[0].indices.flags.writeable  # type: ignore[attr-defined]
    _, _, split = sharing.run("m@bbbbbbbbbbbb", Task.TAG, [request(b"\x07z")], model)
    assert len(model.ran) == 2 and split.shared == 0  # another export: computed


def test_an_error_is_shared_within_its_batch_but_never_kept() -> None:
    sharing, model = Sharing(), Model()
    answers, _, split = sharing.run(SERVED, Task.TAG, [request(b"bad"), request(b"bad")], model)
    assert split.shared == 1 and all(isinstance(a, InvalidImage) for a in answers)
    answers, _, split = sharing.run(SERVED, Task.TAG, [request(b"bad")], model)
    assert len(model.ran) == 2 and split.shared == 0  # the same bytes tried again


def test_the_replies_say_which_answers_were_shared() -> None:
    batch = [request(b"\x03c", request_id="a"), request(b"\x03c", request_id="b")]
    sharing = Sharing()
    answers, size, split = sharing.run(SERVED, Task.TAG, batch, Model())
    runnable = [(f"1-{i}".encode(), r) for i, r in enumerate(batch)]
    said = [
        decode_reply(raw) for _, _, raw in replies(runnable, answers, size, split.positions_shared)
    ]
    assert [(r.id, r.shared) for r in said] == [("a", False), ("b", True)]
    assert said[0].result.indices.tolist() == said[1].result.indices.tolist()  # type: ignore[attr-defined]
    error = encode_answer("c", 1, InvalidImage("bad"), shared=True)
    assert not decode_reply(error).shared  # an error says nothing of it


def test_a_failed_model_call_is_not_shared_each_identical_request_runs_for_itself() -> None:
    calls: list[int] = []

    def failing_once(requests: list[Request]) -> tuple[list[object], int]:
        calls.append(len(requests))
        if len(calls) == 1:
            return [InferenceError("model call failed")] * len(requests), len(requests)
        return [answer_of(r.image[0]) for r in requests], len(requests)

    batch = [request(b"\x05a", request_id="a"), request(b"\x05a", request_id="b")]
    answers, _, split = Sharing().run(SERVED, Task.TAG, batch, failing_once)
    assert calls == [1, 1] and split.shared == 0 and split.run == [0, 1]
    assert isinstance(answers[0], InferenceError)
    assert int(answers[1].indices[0]) == 5  # type: ignore[attr-defined]


def test_a_batch_answered_without_the_model_counts_its_waits_and_no_batch() -> None:
    stats = ConsumerStats()
    stats.record(SERVED, Task.TAG, 0, 0, 0.0, [0.002, 0.003], ["shop", None])
    assert stats.batches == stats.items == 0 and SERVED not in stats.sizes
    assert stats.wait_s[SERVED][Task.TAG][-1] == pytest.approx(0.005)
    assert stats.tenant_wait_s["shop"][-1] == pytest.approx(0.002)


def test_what_it_keeps_stays_within_its_bytes() -> None:
    sharing, model = Sharing(max_bytes=4096), Model()
    for marker in range(200):
        sharing.run(SERVED, Task.TAG, [request(bytes([marker]) + b"q")], model)
    assert 0 < sharing.recent.bytes <= 4096 and sharing.recent.evictions > 0
    _, _, split = sharing.run(SERVED, Task.TAG, [request(b"\x00q")], model)
    assert split.shared == 0  # the oldest was let go: computed again
