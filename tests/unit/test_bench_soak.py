"""The soak benchmark's pure parts: which role a process plays, growth, the table, the images."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from bench.memory import MB, Row, Sample, Usage, classify, growth_pct, rows, table
from bench.soak import soak_images

PY = "/venv/bin/python"
SPAWN = [PY, "-B", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=4, pipe_handle=6)", "--multiprocessing-fork"]  # fmt: skip
TRACKER = [PY, "-B", "-c", "from multiprocessing.resource_tracker import main;main(3)"]
GUNICORN = [PY, "-m", "gunicorn", "-k", "app.gunicorn_worker.Worker", "app.main:create_app()"]


@pytest.mark.parametrize(
    ("cmdline", "parent", "role"),
    [
        ([PY, "-m", "app"], None, "http"),
        (SPAWN, "http", "worker"),
        (TRACKER, "http", "resource-tracker"),
        ([PY, "-m", "app.broker.cluster", "--workers", "2"], None, "launcher"),
        (["/usr/bin/redis-server 127.0.0.1:6380"], "launcher", "redis"),
        ([PY, "-m", "app.broker.worker"], "launcher", "supervisor"),
        (SPAWN, "supervisor", "worker"),
        (GUNICORN, "launcher", "gunicorn-master"),
        (GUNICORN, "gunicorn-master", "front-end"),
        ([PY, "-m", "application"], None, "other"),
        ([], None, "other"),
    ],
)
def test_each_process_of_the_server_gets_its_role(
    cmdline: list[str], parent: str | None, role: str
) -> None:
    assert classify(cmdline, parent) == role


def test_growth_is_relative_to_the_baseline() -> None:
    assert growth_pct(1000, 1105) == 10.5
    assert growth_pct(1000, 990) == -1.0
    with pytest.raises(ValueError, match="baseline"):
        growth_pct(0, 10)


def test_rows_follow_each_pid_and_a_restarted_worker_has_no_baseline() -> None:
    base = Sample(0, [Usage(7, "worker", 100 * MB, 80 * MB), Usage(5, "worker", 200 * MB),
                      Usage(3, "http", 50 * MB)])  # fmt: skip
    mid = Sample(10_000, [Usage(7, "worker", 110 * MB, 88 * MB), Usage(3, "http", 50 * MB),
                          Usage(9, "worker", 150 * MB)])  # fmt: skip
    end = Sample(20_000, [Usage(7, "worker", 120 * MB, 96 * MB), Usage(3, "http", 51 * MB),
                          Usage(9, "worker", 160 * MB)])  # fmt: skip
    by_pid = {row.pid: row for row in rows([base, mid, end])}
    assert [row.label for row in rows([base, mid, end])] == [
        "http", "worker (new)", "worker-1", "worker-2"
    ]  # fmt: skip
    assert by_pid[7].label == "worker-2"  # numbered in pid order
    assert by_pid[7].rss_growth_pct == 20.0 and by_pid[7].anon_growth_pct == 20.0
    assert by_pid[5].rss == [200 * MB, None, None] and by_pid[5].rss_growth_pct is None
    assert by_pid[9].rss_growth_pct is None
    assert by_pid[3].rss_growth_pct == 2.0
    lines = table([base, mid, end]).splitlines()
    assert lines[0].split() == ["process", "pid", "warm-up", "10k", "20k", "RSS", "growth",
                                "RSS", "trend", "anon", "warm-up", "anon", "end", "anon",
                                "growth"]  # fmt: skip
    assert lines[3].split() == ["worker-1", "5", "200", "-", "-", "-", "-", "-", "-", "-"]
    assert by_pid[7].rss_trend_pct == 20.0 and by_pid[9].rss_trend_pct is None


def test_the_trend_sees_growth_but_not_the_swing_of_one_sample() -> None:
    def row(mbs: list[int]) -> Row:
        return Row("http", "http", 3, [mb * MB for mb in mbs], 0, 0)

    swinging = row([113, 119, 115, 110, 111, 114, 121, 120, 112, 105, 121])
    assert swinging.rss_growth_pct == 7.1 and swinging.rss_trend_pct == -2.6
    growing = row([100, 104, 108, 112, 116, 120])
    assert growing.rss_trend_pct == 15.7  # (116 + 120) / 2 against (100 + 104) / 2


def test_soak_images_are_distinct_varied_and_reproducible() -> None:
    images = soak_images(40, seed=3)
    assert images == soak_images(40, seed=3)
    assert len(set(images)) == 40
    opened = [Image.open(io.BytesIO(data)) for data in images]
    assert {image.format for image in opened} >= {"JPEG", "PNG"}
    assert len({image.size for image in opened}) == 40
