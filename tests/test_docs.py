"""The README and the documentation site, as a newcomer meets them.

The README stays short and its two first commands exactly as CI runs them; the site builds with ``mkdocs build
--strict`` (every link and anchor resolves) and its getting-started page renders in a real browser; the command
reference is the parsers' own text, so an option added to a command is on the site without anyone writing it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from browser import distinct_rows, dump_dom, needs_chromium, screenshot

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The README's first commands: the install-and-check line and the test line (CI runs the second as written).
FIRST_COMMANDS = ("pip install . && ggml-rpc check", "pip install '.[test]' && python -m pytest -q")


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_short_and_starts_with_the_commands_ci_runs():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 12_000, f"README.md is {len(text.encode())} bytes: move detail to docs/"
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    assert [b.strip() for b in blocks[:2]] == list(FIRST_COMMANDS)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -q '.[test" in ci and "python -m pytest -q" in ci


def test_every_link_of_the_readme_is_a_file_of_the_repository():
    text = README.read_text(encoding="utf-8")
    links = [m.split("#")[0] for m in re.findall(r"\]\(([^)]+)\)", text) if "://" not in m and not m.startswith("#")]
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def _parsers() -> list[argparse.ArgumentParser]:
    from ggml_rpc.conformance.cli import COMMANDS, build_parser

    out, todo = [], [build_parser(COMMANDS)]
    while todo:
        parser = todo.pop()
        out.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return out


def test_the_command_reference_has_every_command_and_option():
    page = _hooks().commands_page()
    parsers = _parsers()
    assert len(parsers) > 15
    for parser in parsers:
        assert f"\n## {parser.prog}\n" in page or f"\n### {parser.prog}\n" in page, f"{parser.prog} is missing"
        for action in parser._actions:
            for option in action.option_strings:
                assert f"`{option}" in page or f", {option}" in page, f"{parser.prog} {option} is missing"


def test_help_texts_that_list_protocol_versions_list_every_covered_one():
    """A help text naming versions names all of them (``serve --help`` said "protocol 6, 7 or 7.0.1" after 8.0.0
    was served too)."""
    from ggml_rpc.spec import PROTOCOLS

    newest = str(PROTOCOLS[-1].version[0])
    texts = []
    for parser in _parsers():
        texts.append((parser.prog, parser.description or ""))
        texts += [(parser.prog, a.help or "") for a in parser._actions]
    stale = [f"{prog}: {text}" for prog, text in texts if "7.0.1" in text and newest not in text]
    assert not stale, stale


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``mkdocs build --strict`` writes it (any broken link or anchor fails the build)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs the docs extra (pip install '.[docs]'), which has mkdocs and mkdocs-material")
        pytest.skip("mkdocs is not installed (pip install '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_site_builds_strictly_with_every_page(site: Path):
    for page in ("getting-started", "check-my-server", "commands", "catalogue", "spec/PROTOCOL", "SECURITY",
                 "INTEROP", "BENCHMARKS", "ARCHITECTURE", "CHANGELOG", "records"):
        assert (site / page / "index.html").is_file(), f"{page} is not on the site"
    catalogue = (site / "catalogue" / "index.html").read_text(encoding="utf-8")
    from ggml_rpc.conformance.checks import CATALOGUE

    assert all(f">{c.id}<" in catalogue for c in CATALOGUE)
    # The recorded runs the records link to are served beside the pages.
    assert (site / "runs" / "report-upstream-v7" / "index.html").is_file()


@needs_chromium
def test_the_getting_started_page_renders_in_a_browser(site: Path, tmp_path: Path):
    url = (site / "getting-started" / "index.html").as_uri()
    png = screenshot(tmp_path / "profile", url, tmp_path / "getting-started.png", "1200,900")
    assert distinct_rows(png) > 50, "the screenshot is blank"
    dom = dump_dom(tmp_path / "profile", url, "--virtual-time-budget=3000")
    assert re.search(r"<h1[^>]*>Getting started", dom), "the page's title is not in the rendered DOM"
    assert "pip install . &amp;&amp; ggml-rpc check" in dom


def test_citations_name_an_anchor_or_the_fact_not_a_section_or_an_issue_number():
    """Code and docs cite spec/PROTOCOL.md's anchors (``spec/PROTOCOL.md#rules``) or say the fact: a section number
    of the old protocol fact sheet, or the number of a project issue, points into documents the repository does not
    hold."""
    cited = re.compile(r"§\s*\d|\bissues?[ -]#?\d+", re.I)
    found = []
    for folder, dirs, files in os.walk(ROOT):
        # Not the project's text: git's, virtual environments, build output, and the raw data of recorded runs.
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "build", "site", "__pycache__")
                   and not (Path(folder) / d / "pyvenv.cfg").exists()]
        for name in files:
            path = Path(folder) / name
            if path.suffix not in (".py", ".md"):
                continue
            rel = path.relative_to(ROOT)
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if cited.search(line):
                    found.append(f"{rel}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_every_module_and_file_the_pages_name_exists():
    """Modules move (the layers' work moved several): a page naming ``ggml_rpc.x.y`` or ``x/y.py`` must name what
    is there."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    files = {p.relative_to(ROOT).as_posix() for top in ("spec", "reference", "conformance", "bench", "tests")
             for p in (ROOT / top).rglob("*.py")}
    missing = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for name in sorted(set(re.findall(r"\bggml_rpc\.(?:spec|reference|conformance|bench)(?:\.\w+)*", text))):
            parts = name.split(".")
            for k in range(2, len(parts) + 1):  # the longest importable prefix; the rest are its attributes
                try:
                    obj = importlib.import_module(".".join(parts[:k]))
                except ImportError:
                    k -= 1
                    break
            try:
                for attribute in parts[k:]:
                    obj = getattr(obj, attribute)
            except AttributeError:
                missing.append(f"{page.name}: {name}")
        for path in sorted(set(re.findall(r"`([\w/]+\.py)`", text))):
            if not any(f == path or f.endswith("/" + path) for f in files):
                missing.append(f"{page.name}: {path}")
    assert not missing, missing
