"""The README's figures about the check catalogue come from the catalogue, not from a hand-typed copy.

They went stale before (103 checks, ``FRAME-…035``, ``DATA-…029`` while the suite had 122 checks up to FRAME-047
and DATA-032): the table is generated (:mod:`ggml_rpc.conformance.checks.figures`) and these tests fail when the
README's copy, or any count or ID range typed elsewhere in it, disagrees with ``CATALOGUE``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.checks.figures import readme_block, table

README = Path(__file__).resolve().parents[1] / "README.md"
FIX = "run `python -m ggml_rpc.conformance.checks.figures README.md`"


def test_the_catalogue_table_is_the_generated_one():
    block = readme_block(README.read_text(encoding="utf-8"))
    assert block is not None, "README.md lost the catalogue table markers"
    assert block == table(CATALOGUE), f"README.md's catalogue table is stale: {FIX}"


def test_every_id_range_in_the_readme_ends_at_the_last_id_of_its_prefix():
    text = README.read_text(encoding="utf-8")
    last: dict[str, int] = {}
    for c in CATALOGUE:
        prefix, _, number = c.id.rpartition("-")
        last[prefix] = max(last.get(prefix, 0), int(number))
    ranges = re.findall(r"\b([A-Z]+(?:-V\d)?)-(\d{3})…(\d+)", text)
    assert ranges
    for prefix, first, end in ranges:
        assert prefix in last, f"{prefix}-{first}…{end}: no check has that prefix"
        assert (int(first), int(end)) == (1, last[prefix]), f"{prefix}-{first}…{end}: the catalogue ends at " \
            f"{prefix}-{last[prefix]:03d}"


def test_every_check_count_in_the_readme_is_the_catalogue_s():
    text = README.read_text(encoding="utf-8")
    counts = [int(n) for n in re.findall(r"\b(\d+) checks\b", text)]
    counts += [int(n) for n in re.findall(r'"total": (\d+)', text)]
    assert counts, "the README states no count any more: drop this test or the generated table"
    assert set(counts) == {len(CATALOGUE)}, f"the README states {counts}; the catalogue has {len(CATALOGUE)}"


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
