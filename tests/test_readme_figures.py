"""The figures about the check catalogue come from the catalogue, not from a hand-typed copy.

They went stale before (103 checks, ``FRAME-…035``, ``DATA-…029`` while the suite had 122 checks up to FRAME-047
and DATA-032): the site's catalogue page is generated (:mod:`ggml_rpc.conformance.checks.figures`) at every build,
and these tests fail when a count or an ID range typed in the README or a page of the site disagrees with
``CATALOGUE``. The dated records (docs/records/) keep the figures of their day and are left out.
"""

from __future__ import annotations

import re
from pathlib import Path

from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.checks.figures import page, rows
from ggml_rpc.conformance.upstream.known_bugs import safe_profile

ROOT = Path(__file__).resolve().parents[1]
#: What a reader sees: the README, the site's own pages (not the dated records) and its generated catalogue page.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "records" not in p.parts)]


def _texts() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in PAGES] + \
        [("catalogue page", page(CATALOGUE))]


def test_the_catalogue_page_sums_up_every_check_once():
    text = page(CATALOGUE)
    assert sum(r.count for r in rows(CATALOGUE)) == len(CATALOGUE)
    assert f"{len(CATALOGUE)} checks in {len(rows(CATALOGUE))} groups" in text
    listed = re.findall(r"^\| ([A-Z]+(?:-V\d)?-\d{3}) \|", text, re.M)
    assert listed == [c.id for c in CATALOGUE]


def test_every_id_range_in_the_docs_ends_at_the_last_id_of_its_prefix():
    last: dict[str, int] = {}
    for c in CATALOGUE:
        prefix, _, number = c.id.rpartition("-")
        last[prefix] = max(last.get(prefix, 0), int(number))
    ranges = [(name, r) for name, text in _texts() for r in re.findall(r"\b([A-Z]+(?:-V\d)?)-(\d{3})…(\d+)", text)]
    assert ranges
    for name, (prefix, first, end) in ranges:
        assert prefix in last, f"{name}: {prefix}-{first}…{end}: no check has that prefix"
        assert (int(first), int(end)) == (1, last[prefix]), f"{name}: {prefix}-{first}…{end}: the catalogue ends " \
            f"at {prefix}-{last[prefix]:03d}"


#: A transcript of a run of a ``--checks`` selection: its counts are the selection's, not the catalogue's.
SELECTION_RUN = re.compile(r"```console\n\$ ggml-rpc check [^\n]*--checks .*?```", re.S)


def _profile_figures() -> dict[str, tuple[int, ...]]:
    """The safe profile's figures as the pages state them (``check --profile safe``: its header, its verdict line,
    the prose), each with the values the catalogue gives them."""
    safe, total = len(safe_profile(CATALOGUE)), len(CATALOGUE)
    return {r"profile safe: (\d+) checks, (\d+) left out": (safe, total - safe),
            r"\((\d+) checks\s+left\s+out": (total - safe,),
            r"\b(\d+) of the catalogue's (\d+) checks": (safe, total)}


def test_every_check_count_in_the_docs_is_the_catalogue_s():
    counts, wrong = [], []
    for name, text in _texts():
        text = SELECTION_RUN.sub("", text)
        for pattern, expected in _profile_figures().items():
            for found in re.findall(pattern, text):
                found = tuple(map(int, found if isinstance(found, tuple) else (found,)))
                counts.append((name, found))
                if found != expected:
                    wrong.append((name, pattern, found, expected))
            text = re.sub(pattern, "", text)
        totals = [int(n) for n in re.findall(r"\b(\d+) checks\b", text) + re.findall(r'"total": (\d+)', text)]
        counts += [(name, n) for n in totals]
        wrong += [(name, n) for n in totals if n != len(CATALOGUE)]
    assert counts, "the docs state no count any more: drop this test"
    assert not wrong, f"the catalogue has {len(CATALOGUE)} checks, its safe profile " \
        f"{len(safe_profile(CATALOGUE))}; the docs state {wrong}"


def test_the_no_cache_hint_names_each_server_s_own_flag(capsys):
    """A server without a cache: the skip says how to start one, in the flag of the kit's server and upstream's
    (it said `-c`, which `ggml-rpc serve` does not take)."""
    import json

    from ggml_rpc.conformance.cli import main
    from ggml_rpc.reference import running_server

    with running_server("7") as srv:  # no cache directory
        main(["check", "--server", f"{srv.host}:{srv.port}", "--checks", "CACHE-V7-001", "--json", "-"])
    [result] = json.loads(capsys.readouterr().out)["results"]
    assert result["outcome"] == "skip"
    assert "ggml-rpc serve --cache-dir DIR; upstream rpc-server -c" in result["message"]
