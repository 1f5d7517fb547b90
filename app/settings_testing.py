"""The settings only tests set (``MB_TEST_*``): hooks that make a test's outcome the same on
every host (a slow load, a CPU with or without bf16 units, which precision wins a timing).
Never set them to serve. Part of ``app.settings.Settings``, read from the environment with
the rest."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode


class TestHooks(BaseModel):
    """The ``MB_TEST_*`` settings (see the module's docstring)."""

    mb_test_load_delay_s: Annotated[tuple[float, ...], NoDecode] = Field(
        (),
        description=(
            "Testing only: seconds each model worker sleeps in every load after its start (a "
            "slow rollout, on purpose), as a comma-separated list by worker index (worker i "
            "gets item i modulo its length)."
        ),
    )
    mb_test_cpu_bf16: bool | None = Field(
        None,
        description=(
            "Testing only: workers take the CPU to have (true) or lack (false) bf16 units, "
            "whatever it has."
        ),
    )
    mb_test_fastest_dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description=(
            "Testing only: under MB_DTYPE=auto, workers time every candidate in this "
            "precision as a thousand times faster than measured, so it wins wherever it passes "
            "its self-test (real timings of a tiny test model are noise: on a busy host one "
            "bf16 timing came out 8x slower than fp32's)."
        ),
    )
    mb_test_retire_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Testing only: seconds a broker worker keeps a drained version loaded after it "
            "stops reading its work (instead of the lifecycle's RETIRE_S), so a test can act "
            "while one is in that state."
        ),
    )

    @field_validator("mb_test_load_delay_s", mode="before")
    @classmethod
    def _split_delays(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(float(part) for part in value.split(",") if part.strip())
        return value
