"""bench.rollout.judged, which bench.rollout and bench.chaos count "mismatched" answers with
(never another caller's result): by the precision the served id names, so an answer that
bf16 rounded is its own image's, and another image's never is."""

from __future__ import annotations

import numpy as np
import pytest

from bench.rollout import MIN_COSINE, judged


def test_an_answer_is_judged_by_the_precision_that_computed_it() -> None:
    rng = np.random.default_rng(3)
    refs = rng.standard_normal((2, 64)).astype(np.float32)
    refs /= np.linalg.norm(refs, axis=1, keepdims=True)
    noise = rng.standard_normal(64).astype(np.float32)
    # About bf16's rounding: a cosine of 0.995 to its own reference.
    rounded = refs[0] + 0.1 * noise / np.linalg.norm(noise)
    cosine = float(rounded @ refs[0] / np.linalg.norm(rounded))
    assert MIN_COSINE["bfloat16"] < cosine < MIN_COSINE["float32"]
    by_id = {"m@abc+bf16": refs, "m@abc": refs}
    body = rounded.astype("<f4").tobytes()
    judged_cosine, matched = judged(body, "m@abc+bf16", by_id, 0)
    assert judged_cosine == pytest.approx(cosine, abs=1e-6) and matched
    assert judged(body, "m@abc", by_id, 0)[1] is False  # fp32 must agree closer
    assert judged(body, "m@abc+bf16", by_id, 1)[1] is False  # another image's
    assert judged(body, "other@1", by_id, 0) == (None, False)  # no reference for it
