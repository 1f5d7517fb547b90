"""Locust load test: real JPEGs to both prediction endpoints, in a realistic mix.

    make loadtest                                   # starts a server, runs 30 s headless
    locust -f tests/load/locustfile.py --host http://127.0.0.1:8000 --headless -u 32 -r 8 -t 30s

Photos come from scikit-image (shipped with the package, nothing downloaded). Set
``LOCUST_API_KEY`` if the server has an ``API_KEY``.
"""

from __future__ import annotations

import io
import os
import random

from locust import HttpUser, between, task
from PIL import Image


def _photos() -> list[bytes]:
    from skimage import data

    jpegs = []
    photos = (data.chelsea(), data.coffee(), data.astronaut(), data.rocket())  # type: ignore[no-untyped-call]  # skimage.data is unannotated
    for photo in photos:
        buffer = io.BytesIO()
        Image.fromarray(photo).save(buffer, format="JPEG", quality=85)
        jpegs.append(buffer.getvalue())
    return jpegs


PHOTOS = _photos()
HEADERS = (
    {"Authorization": f"Bearer {os.environ['LOCUST_API_KEY']}"}
    if os.environ.get("LOCUST_API_KEY")
    else {}
)


class ImageClient(HttpUser):
    """Mostly tagging, some embedding, with a short think time between requests."""

    wait_time = between(0.0, 0.05)

    @task(3)
    def tag(self) -> None:
        with self.client.post(
            "/predict/tag",
            files={"image": ("photo.jpg", random.choice(PHOTOS), "image/jpeg")},
            data={"k": "5"},
            headers=HEADERS,
            name="/predict/tag",
            catch_response=True,
        ) as response:
            tags = response.json() if response.status_code == 200 else None
            if not tags or len(tags) != 5:
                response.failure(f"bad answer: {response.status_code} {response.text[:200]}")

    @task(1)
    def embedding(self) -> None:
        with self.client.post(
            "/predict/embedding",
            files={"image": ("photo.jpg", random.choice(PHOTOS), "image/jpeg")},
            headers=HEADERS,
            name="/predict/embedding",
            catch_response=True,
        ) as response:
            vector = response.json() if response.status_code == 200 else None
            if not vector or not all(isinstance(x, float) for x in vector[:8]):
                response.failure(f"bad answer: {response.status_code} {response.text[:200]}")
