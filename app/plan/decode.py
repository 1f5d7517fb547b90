"""Where uploads are decoded: ``MB_DECODE`` interpreted once, at start-up, into one plan.

Every piece that cares (the Predictor, the worker pool, each worker) receives the
``DecodePlan`` and asks it; nobody reads ``MB_DECODE`` again. A leaf module (stdlib only),
so services and workers share it without importing each other.

The choices, for the record (the reasons are in ``docs/design.md``):

* ``server``: a thread pool in the HTTP process decodes every upload while the workers
  compute, and batches reach the workers as pixels.
* ``worker``: uploads travel encoded and each worker decodes its own batch on its threads.
* ``device``: as ``worker``, but JPEGs are decoded, resized and cropped on the worker's device.
* ``auto``: ``worker``, on CPU and GPU workers alike. The workers' JPEG path (libjpeg-turbo
  at a reduced scale, torch's SIMD resize) is twice as fast as Pillow's, holds no GIL, and
  leaves the HTTP process only HTTP; decoding in the server, overlapping the model, lost to
  it on every model measured (``docs/performance.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

DecodeSetting = Literal["auto", "server", "worker", "device"]
# The HTTP process's decode pool never needs more threads than this: past it, the GIL its
# decode threads share with the event loop is the limit.
MAX_SERVER_THREADS = 8


@dataclass(frozen=True)
class DecodePlan:
    """Who decodes uploads, on how many threads.

    >>> plan = plan_decode("auto", ["cpu"], torch_threads=2, decode_threads=None, cpu_count=2)
    >>> plan.server_decodes, plan.worker_threads
    (False, 2)
    """

    server_threads: int  # decode threads in the HTTP process; 0: it never decodes
    worker_threads: int  # decode threads per worker; 0: batches reach workers as pixels
    on_device: bool = False  # workers decode JPEGs on their device (nvJPEG on a GPU)
    # Broker mode: the workers are other processes, maybe on other hosts, with plans of
    # their own; uploads travel to them encoded.
    remote_workers: bool = False

    def __post_init__(self) -> None:
        if self.server_threads == 0 and self.worker_threads == 0 and not self.remote_workers:
            raise ValueError("somebody must decode the uploads")
        if self.server_threads and self.worker_threads:
            raise ValueError("uploads are decoded on one side: the server or the workers")

    @classmethod
    def front_end(cls) -> DecodePlan:
        """A broker front end's plan: it never decodes; the remote workers always do."""
        return cls(server_threads=0, worker_threads=0, remote_workers=True)

    @property
    def workers_decode(self) -> bool:
        """Whether a worker may receive encoded uploads (it then needs a decoder)."""
        return self.worker_threads > 0 or self.remote_workers

    @property
    def server_decodes(self) -> bool:
        """Whether the HTTP process decodes the uploads (else they travel encoded)."""
        return self.server_threads > 0

    def describe(self) -> str:
        """For the start-up log line and ``/info``."""
        if self.remote_workers:
            return "the model workers, behind the broker"
        if self.server_threads == 0:
            where = "the workers' device" if self.on_device else "the workers"
            return f"{where} ({self.worker_threads} threads each)"
        return f"the server ({self.server_threads} threads)"


def plan_decode(
    setting: DecodeSetting,
    devices: Sequence[str],
    *,
    torch_threads: int,
    decode_threads: int | None,
    cpu_count: int,
) -> DecodePlan:
    """The plan for workers on ``devices`` (one entry per worker, ``"cpu"`` or
    ``"cuda:N"``), each with ``torch_threads``; ``decode_threads`` is ``MB_DECODE_THREADS``
    (``None``: the defaults in the README's settings table)."""
    on_gpu = any(device != "cpu" for device in devices)
    if setting == "auto":
        setting = "worker"
    server_threads = 0
    if setting == "server":
        server_threads = decode_threads or min(MAX_SERVER_THREADS, cpu_count)
    worker_threads = 0
    if setting in ("worker", "device"):
        if decode_threads is not None:
            worker_threads = decode_threads
        elif on_gpu:  # a GPU worker's cores are free to decode
            worker_threads = max(1, cpu_count // max(1, len(devices)))
        else:  # a CPU worker's model threads idle while its batch decodes
            worker_threads = torch_threads
    return DecodePlan(
        server_threads=server_threads,
        worker_threads=worker_threads,
        on_device=setting == "device",
    )
