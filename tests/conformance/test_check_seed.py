"""Compute (and COMM) checks draw their inputs from the run's seed: one seed, the same bytes sent.

They drew unseeded inputs before, so a failure seen once could not be sent again.  The seed is fixed by default,
printed on the terminal and stored in the JSON, JUnit, SARIF and HTML reports; ``--seed N`` changes it.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.harness import DEFAULT_SEED, EmbeddedTarget, Runner, select
from ggml_rpc.conformance.sessions.decode import iter_connection
from ggml_rpc.spec import V7, Command, Request

CHECKS = "COMPUTE-001,COMPUTE-003,COMPUTE-006"


def set_tensor_data(rec) -> list[bytes]:
    """The data of every SET_TENSOR of one recorded connection."""
    return [bytes(m.data) for m in iter_connection(rec.capture(), V7)
            if isinstance(m, Request) and m.command is Command.SET_TENSOR and m.data is not None]


def uploads(seed: int | None) -> dict[str, list[bytes]]:
    """Per check, the data of every SET_TENSOR it sent (handles and addresses are the server's: left out)."""
    kwargs = {} if seed is None else {"seed": seed}
    with Runner(EmbeddedTarget(V7), **kwargs) as runner:
        runner.run(select(CATALOGUE, CHECKS))
    out: dict[str, list[bytes]] = {}
    for r in runner.results:
        assert r.outcome.value == "pass", (r.check.id, r.message)
        sent = [data for rec in r.recording.connections for data in set_tensor_data(rec)]
        assert sent, r.check.id
        out[r.check.id] = sent
    return out


def test_one_seed_sends_the_same_bytes_and_another_does_not():
    first, again, other = uploads(1234), uploads(1234), uploads(1235)
    assert first == again
    assert all(first[k] != other[k] for k in first)


def test_the_default_seed_is_fixed():
    assert uploads(None) == uploads(DEFAULT_SEED)


def test_a_check_run_alone_sends_what_it_sends_in_a_longer_run():
    alone = uploads(99)
    with Runner(EmbeddedTarget(V7), seed=99) as runner:
        runner.run(select(CATALOGUE, "COMPUTE-003"))
    [r] = runner.results
    assert [d for rec in r.recording.connections for d in set_tensor_data(rec)] == alone["COMPUTE-003"]


def test_every_report_names_the_seed(tmp_path, capsys):
    paths = {k: tmp_path / f"r.{k}" for k in ("json", "junit", "sarif")}
    code = main(["check", "--checks", "COMPUTE-001", "--seed", "4242", "--json", str(paths["json"]),
                 "--junit", str(paths["junit"]), "--sarif", str(paths["sarif"]), "--html", str(tmp_path / "html")])
    assert code == 0
    assert "seed 4242" in capsys.readouterr().out
    assert json.loads(paths["json"].read_text())["seed"] == 4242
    assert json.loads(paths["sarif"].read_text())["runs"][0]["properties"]["seed"] == 4242
    props = ET.parse(paths["junit"]).getroot().find("testsuite/properties")
    assert {p.get("name"): p.get("value") for p in props}["seed"] == "4242"
    assert "4242" in (tmp_path / "html" / "index.html").read_text()


def test_a_negative_seed_is_a_usage_error():
    assert main(["check", "--seed", "-1"]) == 2
