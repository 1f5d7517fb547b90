"""What crosses the worker's socket: a reply's arrays survive the trip exactly."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from app.workers.channel import dumps
from app.workers.messages import BatchDone


def _round_trip(reply: BatchDone) -> BatchDone:
    back = pickle.loads(dumps(reply))  # as the pool's channel reads what the worker posts
    assert isinstance(back, BatchDone)
    return back


@pytest.mark.parametrize(
    "outputs",
    [
        {
            "indices": np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], dtype=np.int64),
            "probs": np.array([[0.5, 0.2, 0.1, 0.1, 0.1]] * 2, dtype=np.float32),
        },
        {"embedding": np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)},
        {"embedding": np.zeros((0, 7), dtype=np.float32)},  # every image in the batch failed
        {"embedding": np.arange(12, dtype=np.float16).reshape(3, 4).T},  # not contiguous
        {},
    ],
)
def test_a_reply_comes_back_with_the_same_arrays_and_fields(
    outputs: dict[str, np.ndarray],
) -> None:
    reply = BatchDone(7, (10, 11, 12), outputs, 0.25, {1: ("InvalidImage", "bad")}, 2)
    back = _round_trip(reply)
    assert (back.batch_id, back.ids, back.compute_s, back.errors, back.threads) == (
        7,
        (10, 11, 12),
        0.25,
        {1: ("InvalidImage", "bad")},
        2,
    )
    assert back.outputs.keys() == outputs.keys()
    for name, array in outputs.items():
        assert back.outputs[name].dtype == array.dtype
        np.testing.assert_array_equal(back.outputs[name], array)
