"""What every request must get back, checked from the test process: each answer against its
own upload, under concurrency (shared by the reliability and broker tests)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from app.images import preprocess
from app.manifest import read_manifest
from app.workers.models import load_models
from tests.models import tiny_expected_embedding


class Expectation:
    """Computes, in the test process, what the tiny model must answer for a given upload."""

    def __init__(self, store: Path) -> None:
        self.spec = read_manifest(store).input
        classifier = load_models(store, torch.device("cpu")).classifier
        assert classifier is not None, "the tiny test model has a classifier head"
        self.classifier = classifier
        self.classes = (store / "classes.txt").read_text().splitlines()

    def embedding(self, data: bytes) -> np.ndarray:
        return tiny_expected_embedding(preprocess(data, self.spec))

    def probs(self, data: bytes) -> np.ndarray:
        with torch.inference_mode():
            logits = self.classifier(torch.from_numpy(self.embedding(data))[None])
        return torch.softmax(logits, dim=1)[0].numpy()

    def check(self, task: str, data: bytes, answer: Any) -> bool:
        if task == "embedding":
            return bool(np.allclose(answer, self.embedding(data), atol=1e-5))
        probs = self.probs(data)
        top = [self.classes.index(tag["name"]) for tag in answer]
        return top[0] == int(np.argmax(probs)) and bool(
            np.allclose([tag["prob"] for tag in answer], probs[top], atol=1e-5)
        )


async def httpx_closed_loop(
    base_url: str,
    jobs: list[tuple[str, bytes]],
    clients: int,
    *,
    timeout_s: float = 30,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[tuple[int, int, Any]]:
    """Send every job once from ``clients`` concurrent clients; returns (job index, status,
    body) per job. A client timeout is recorded as status 0."""
    results: list[tuple[int, int, Any]] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(jobs)):
        queue.put_nowait(index)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, limits=limits, transport=transport
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                task, data = jobs[index]
                try:
                    response = await client.post(
                        f"/predict/{task}", files={"image": ("x.png", data)}, data={"k": "3"}
                    )
                except httpx.TimeoutException:
                    results.append((index, 0, None))
                    continue
                results.append((index, response.status_code, response.json()))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def mixed_jobs(images: list[bytes]) -> list[tuple[str, bytes]]:
    return [("embedding" if i % 2 else "tag", data) for i, data in enumerate(images)]
