"""A real headless browser for the tests of pages people look at: Debian's chromium, which .ci/run installs.

The report tests and the documentation site's test open their pages with it: a screenshot, and the DOM after the
page's scripts ran. Outside CI the tests skip when chromium is missing; in CI (``CI`` set) they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


#: Skip a test that needs the browser when it is missing, except in CI.
needs_chromium = pytest.mark.skipif(chromium() is None and not os.environ.get("CI"),
                                    reason="chromium is not installed (.ci/run installs it)")


def headless(profile: Path, *extra: str) -> list[str]:
    """The command line of a headless chromium with its own profile, talking to nothing but the page."""
    browser = chromium()
    assert browser is not None, "chromium is missing (.ci/run installs Debian's chromium)"
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", *extra]


def screenshot(profile: Path, url: str, out: Path, size: str = "1200,1400") -> bytes:
    subprocess.run([*headless(profile, f"--screenshot={out}", f"--window-size={size}"), url],
                   capture_output=True, timeout=120, check=False)
    assert out.exists(), "the browser wrote no screenshot"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
    return data


def dump_dom(profile: Path, url: str, *extra: str) -> str:
    return subprocess.run([*headless(profile, *extra), "--dump-dom", url], capture_output=True, text=True,
                          timeout=120, check=False).stdout


def distinct_rows(png: bytes) -> int:
    """How many different pixel rows a PNG holds: 1 for a blank page, hundreds once text is drawn.

    Rows are compared as stored (each with its filter byte), which is enough to tell a page with content from an
    empty one without decoding the filters."""
    pos, width, channels, data = 8, 0, 0, b""
    while pos < len(png):
        length = int.from_bytes(png[pos:pos + 4], "big")
        kind, body = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, depth, colour = int.from_bytes(body[:4], "big"), body[8], body[9]
            assert depth == 8, f"bit depth {depth}"
            channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
        elif kind == b"IDAT":
            data += body
        pos += 12 + length
    raw = zlib.decompress(data)
    stride = width * channels + 1
    return len({raw[i:i + stride] for i in range(0, len(raw), stride)})
