"""The HTML report and the per-check pcaps, tested as people use them: a run against a deliberately broken server
(the reference behind a fault-injecting relay), its report opened in a real headless browser (Debian's chromium,
which .ci/run installs), its pages parsed for broken links, its pcaps decoded by the kit and by tshark with the
kit's dissector, showing the same messages as the page."""

from __future__ import annotations

import json
import os
import re
import shutil
from html import unescape as html_unescape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from breakers import BREAKERS
from browser import dump_dom, needs_chromium, screenshot
from faulty import faulty_server
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V7

FAILING = "DATA-007"
CHECKS = "HELLO-00[1-3],DATA-00[5-8]"


class _Page(HTMLParser):
    """Links, ids and the outcome cell of each check row of one page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()
        self.outcomes: dict[str, str] = {}
        self._row: str | None = None
        self.rows_of_messages = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"] or "")
        if tag == "tr" and a.get("id"):
            self._row = a["id"]
        if tag in ("a", "link") and a.get("href"):
            self.links.append(a["href"] or "")
        if tag == "td" and self._row and "outcome" in (a.get("class") or ""):
            self.outcomes[self._row] = (a.get("class") or "").replace("outcome", "").strip()
        if tag == "td" and "dir" in (a.get("class") or "").split():
            self.rows_of_messages += 1


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("report")
    with running_server("7") as ref, faulty_server(ref.address, V7, BREAKERS[FAILING]()) as bad:
        code = main(["check", "--server", f"127.0.0.1:{bad.port}", "--checks", CHECKS, "--html", str(out / "html"),
                     "--pcap-dir", str(out / "pcaps"), "--json", str(out / "r.json")])
    return {"code": code, "dir": out, "json": json.loads((out / "r.json").read_text())}


def test_the_failing_check_is_shown_failing_and_the_others_passing(report: dict) -> None:
    assert report["code"] == 1
    index = _parse(report["dir"] / "html" / "index.html")
    outcomes = {r["id"]: r["outcome"] for r in report["json"]["results"]}
    assert outcomes[FAILING] == "fail"
    assert index.outcomes[FAILING] == "fail"
    assert {k for k, v in index.outcomes.items() if v == "pass"} == {k for k, v in outcomes.items() if v == "pass"}


def test_every_internal_link_and_anchor_resolves(report: dict) -> None:
    root = report["dir"] / "html"
    pages = [root / "index.html", *sorted((root / "checks").glob("*.html"))]
    assert len(pages) == 1 + len(report["json"]["results"])
    anchors = {root / "protocol.html": _parse(root / "protocol.html").ids}
    checked = 0
    for page in pages:
        for href in _parse(page).links:
            parts = urlsplit(href)
            assert not parts.scheme and not parts.netloc, f"{page.name}: external link {href}"
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            assert target.exists(), f"{page.name}: broken link {href}"
            if parts.fragment and target.suffix == ".html":
                ids = anchors.setdefault(target, _parse(target).ids)
                assert parts.fragment in ids, f"{page.name}: no anchor #{parts.fragment} in {target.name}"
            checked += 1
    assert checked > len(pages)


def test_json_names_the_pcap_and_page_of_each_result(report: dict) -> None:
    by = {r["id"]: r for r in report["json"]["results"]}
    assert Path(by[FAILING]["pcap"]).name == f"{FAILING}.pcap" and Path(by[FAILING]["pcap"]).exists()
    assert all(r["pcap"] is None for r in by.values() if r["outcome"] == "pass")  # only failing ones by default
    assert all(Path(r["html"]).exists() for r in by.values())


def test_the_pcap_holds_the_messages_the_page_shows(report: dict) -> None:
    by = {r["id"]: r for r in report["json"]["results"]}
    decoded = decode_file(by[FAILING]["pcap"])
    messages = sum(len(dc.requests) + len(dc.replies) for dc in decoded)
    assert messages > 0 and all(dc.ok for dc in decoded)
    assert _parse(Path(by[FAILING]["html"])).rows_of_messages == messages


@pytest.mark.skipif(shutil.which("tshark") is None and not os.environ.get("CI"),
                    reason="tshark is not installed (.ci/run installs it)")
def test_tshark_with_the_kits_dissector_shows_the_same_messages(report: dict, tmp_path: Path) -> None:
    from test_dissector_tshark import assert_same_as_decode, dissected, run_tshark

    lua = tmp_path / "ggml_rpc.lua"
    assert main(["dissector", "-o", str(lua)]) == 0
    pcap = Path({r["id"]: r for r in report["json"]["results"]}[FAILING]["pcap"])
    assert_same_as_decode(pcap, dissected(run_tshark(lua, pcap)))


@needs_chromium
def test_a_real_browser_renders_the_failure(report: dict, tmp_path: Path) -> None:
    index = (report["dir"] / "html" / "index.html").resolve()
    screenshot(tmp_path / "profile", index.as_uri(), tmp_path / "index.png")
    dom = dump_dom(tmp_path / "profile", index.as_uri())
    page = _Page()
    page.feed(dom)
    assert page.outcomes.get(FAILING) == "fail", "the browser's DOM does not show the failing check as failing"
    assert "pass" in page.outcomes.values()


def test_the_checked_in_upstream_report_shows_its_deaths_and_has_no_broken_links() -> None:
    root = Path(__file__).resolve().parents[2] / "runs" / "report-upstream-v7"
    results = json.loads((root / "report.json").read_text())["results"]
    deaths = {r["id"]: r for r in results if r["server_death"]}
    # A death fails its check at the check's own level.
    assert deaths and all(r["outcome"] == "fail" and r["failed_level"] == r["level"] for r in deaths.values())
    index = _parse(root / "index.html")
    assert all(index.outcomes[i] == "died" for i in deaths)
    for page in [root / "index.html", *root.glob("checks/*.html")]:
        for href in _parse(page).links:
            path = urlsplit(href).path
            assert not path or (page.parent / unquote(path)).exists(), f"{page.name}: broken link {href}"


_MEASURE = """<script>
window.addEventListener("load", () => {
  const out = [];
  const width = document.documentElement.clientWidth;
  for (const row of document.querySelectorAll("table.evidence tr.failing-step, table.evidence tr")) {
    for (const cell of row.querySelectorAll("td")) {
      const box = cell.getBoundingClientRect();
      if (box.width > 0) out.push(Math.ceil(box.right) <= width ? "in" : "out:" + Math.ceil(box.right));
    }
  }
  const failing = document.querySelector("table.evidence tr.failing-step");
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify({width: width, cells: out, failing: failing !== null,
                                    failing_top: failing ? Math.floor(failing.getBoundingClientRect().top) : -1});
  document.body.appendChild(pre);
});
</script>"""


@needs_chromium
def test_a_real_browser_shows_a_failing_checks_evidence_inside_the_viewport(report: dict, tmp_path: Path) -> None:
    """The failing check's page at 1200 x 900: every evidence cell ends inside the viewport (the cells wrap instead
    of pushing "expected"/"got" off-screen) and the failing step is marked and on the first screen."""
    page = report["dir"] / "html" / "checks" / f"{FAILING}.html"
    measured = page.with_name(f"{FAILING}.measured.html")  # beside it: its stylesheet link resolves the same
    html = page.read_text(encoding="utf-8")
    measured.write_text(html.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = dump_dom(tmp_path / "profile", measured.as_uri(), "--window-size=1200,900", "--virtual-time-budget=3000")
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, "the browser ran no measurement"
    result = json.loads(html_unescape(found.group(1)))
    assert result["cells"] and all(c == "in" for c in result["cells"]), result
    assert result["failing"] and 0 <= result["failing_top"] < 900, result


_LEVEL_LINES = """<script>
window.addEventListener("load", () => {
  const lines = [];
  for (const row of document.querySelectorAll("#failures + table tr")) {
    const cell = row.querySelectorAll("td")[1];  // the level column
    if (!cell) continue;
    const range = document.createRange();
    range.selectNodeContents(cell);
    lines.push([cell.textContent, new Set([...range.getClientRects()].map(r => Math.round(r.top))).size]);
  }
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify(lines);
  document.body.appendChild(pre);
});
</script>"""


@needs_chromium
def test_a_narrow_window_never_breaks_the_failures_level(report: dict, tmp_path: Path) -> None:
    """The failures table's level column stays one word on one line ("MUS/T" once wrapped) however narrow."""
    index = report["dir"] / "html" / "index.html"
    measured = index.with_name("index.measured.html")
    measured.write_text(index.read_text(encoding="utf-8").replace("</body>", _LEVEL_LINES + "</body>"),
                        encoding="utf-8")
    dom = dump_dom(tmp_path / "profile", measured.as_uri(), "--window-size=360,900", "--virtual-time-budget=3000")
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, "the browser ran no measurement"
    cells = json.loads(html_unescape(found.group(1)))
    assert cells and all(text in ("MUST", "SHOULD") for text, _ in cells), cells
    assert all(lines == 1 for _, lines in cells), cells
