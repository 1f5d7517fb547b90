"""The README stays a newcomer's page: short, its links alive, its examples runnable."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from PIL import Image

from app.images import preprocess
from app.manifest import InputSpec

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = ("docs/performance.md", "docs/design.md", "docs/kubernetes.md")
# The default model's preprocessing (EfficientNet-Lite0), what the curl examples run through.
DEFAULT_INPUT = InputSpec(
    crop_size=224, resize_size=256, interpolation="bicubic", mean=(0.5,) * 3, std=(0.5,) * 3
)

_FENCED = re.compile(r"^```.*?^```", flags=re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


def _prose(markdown: str) -> str:
    """The text outside code, where a bracket followed by a parenthesis is a link."""
    return _INLINE_CODE.sub("", _FENCED.sub("", markdown))


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", _FENCED.sub("", markdown), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _links(page: Path) -> list[tuple[str, str]]:
    """(path, anchor) of every relative link and image on ``page``."""
    found = []
    for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def _curl_uploads() -> list[str]:
    """The files the README's curl examples upload (``-F image=@...``, ``--data-binary @...``)."""
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    curls = [line for block in blocks for line in block.splitlines() if line.startswith("curl ")]
    return [path for line in curls for path in re.findall(r"@([\w./-]+)", line)]


def test_the_readme_stays_under_300_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_docs_pages_exist() -> None:
    for page in DOCS:
        assert (REPO / page).is_file(), page


@pytest.mark.parametrize("page", ["README.md", *DOCS])
def test_every_relative_link_and_image_points_at_a_file(page: str) -> None:
    source = REPO / page
    links = _links(source)
    assert links or page != "README.md", "the README links to its docs pages"
    for path, anchor in links:
        target = (source.parent / path).resolve() if path else source
        assert target.exists(), f"{page} links to {path}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target.read_text(encoding="utf-8")), (
                f"{page} links to {path}#{anchor}: no such heading"
            )


def test_the_readme_links_both_docs_pages_and_shows_the_plot() -> None:
    targets = {path for path, _ in _links(README)}
    assert set(DOCS) | {"docs/performance.png"} <= targets


def test_the_curl_examples_upload_a_shipped_jpeg_the_server_accepts() -> None:
    uploads = _curl_uploads()
    assert uploads, "the README has curl examples that upload an image"
    for name in set(uploads):
        path = REPO / name
        assert path.is_file(), f"the curl examples upload {name}, which is not in the repo"
        data = path.read_bytes()
        assert len(data) < 60 * 1024, f"{name} is {len(data)} bytes; keep the clone small"
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG", f"{name} is {image.format}, not JPEG"
        pixels = preprocess(data, DEFAULT_INPUT)
        assert pixels.shape == (224, 224, 3)
