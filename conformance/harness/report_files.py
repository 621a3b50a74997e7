"""Machine-readable reports of a conformance run: JSON (``--json``) and JUnit XML (``--junit``).

JSON shape (``format`` names it; fields are only ever added)::

    {
      "format": "ggml-rpc-check/1",
      "kit_version": "0.1.0",
      "server": {"target": "...", "address": "127.0.0.1:50052", "hello": "7.0.0", "verdict": "speaks 7.0",
                 "devices": 1, "cache": true | false | null},
      "started": "2026-12-02T10:00:00+00:00", "duration_s": 1.23, "strict": false, "exit_code": 0,
      "summary": {"total": 96, "pass": 90, "fail": 0, "skip": 1, "unsupported": 5, "not run": 0, "error": 0,
                  "must_failures": 0, "should_failures": 0},
      "results": [{"id": "HELLO-001", "title": "...", "category": "handshake", "level": "MUST", "versions": "any",
                   "spec": "spec/PROTOCOL.md#v7-hello", "outcome": "pass" | "fail" | "skip" | "unsupported" |
                   "not run" | "error", "failed_level": null | "MUST" | "SHOULD", "message": "...",
                   "duration_s": 0.001, "evidence": [{"step": "...", "sent": "hex…", "expected": "...",
                   "got": "hex…"}], "server_death": null | {"status": "killed by signal SIGABRT", "exit_code": -6,
                   "log_tail": ["..."]}, "pcap": null | "DIR/ID.pcap", "html": null | "DIR/checks/ID.html"}]
    }

JUnit: one ``<testsuite>`` per category inside ``<testsuites>``; a check is a ``<testcase>`` (classname
``ggml_rpc.conformance.<category>``, name ``<ID> <title>``); a failure is ``<failure>`` (type = the failed
level), a crashed check ``<error>``, skip/unsupported/not run ``<skipped>``; evidence goes to the case's
``<system-out>``.  Elements, attributes and their order follow the widely used JUnit XML schema of Jenkins
(``junit-10.xsd``): ``<testsuites>`` carries name/tests/failures/errors/time, each ``<testsuite>`` adds skipped,
timestamp, hostname, id and package, then properties, testcases, system-out and system-err in that order.
"""

from __future__ import annotations

import json
import socket
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .. import kit_version
from .model import Outcome, Result, iter_groups
from .runner import Runner

FORMAT = "ggml-rpc-check/1"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def to_json(runner: Runner, strict: bool = False) -> dict[str, Any]:
    info = runner.info
    return {
        "format": FORMAT,
        "kit_version": kit_version(),
        "server": {
            "target": runner.target.description,
            "address": runner.target.address,
            "hello": info.version_label,
            "verdict": info.verdict,
            "devices": info.device_count,
            "cache": info.cache,
        },
        "started": _iso(runner.started_at),
        "duration_s": round(max(0.0, (runner.finished_at or runner.started_at) - runner.started_at), 3),
        "strict": strict,
        "exit_code": runner.exit_code(strict),
        "summary": runner.summary(),
        "results": [r.as_dict() for r in runner.results],
    }


def write_json(runner: Runner, path: str | Path, strict: bool = False) -> None:
    Path(path).write_text(json.dumps(to_json(runner, strict), indent=2) + "\n", encoding="utf-8")


def evidence_lines(r: Result) -> list[str]:
    """A result's evidence (each step with what was sent, expected and got) and server death, as plain text."""
    lines = []
    for e in r.evidence:
        lines.append(f"- {e.step}")
        for label, value in (("sent", e.sent), ("expected", e.expected), ("got", e.got)):
            if value:
                lines.append(f"    {label}: {value}")
    if r.server_death:
        lines.append(f"server death: {r.server_death.get('status')}")
    return lines


def _evidence_text(r: Result) -> str:
    lines = [f"{r.check.id} [{r.check.level.value}] {r.outcome.value}: {r.message}", f"spec: {r.spec}",
             *evidence_lines(r)]
    if r.server_death:
        lines.extend(f"    log: {line}" for line in r.server_death.get("log_tail", []))
    lines.extend(f"{label}: {path}" for label, path in (("pcap", r.pcap), ("html", r.html)) if path)
    return "\n".join(lines)


def to_junit(runner: Runner) -> ET.Element:
    root = ET.Element("testsuites", name="ggml-rpc check")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    host = socket.gethostname()
    stamp = datetime.fromtimestamp(runner.started_at, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    for i, (cat, results) in enumerate(iter_groups(runner.results)):
        failures = sum(1 for r in results if r.outcome is Outcome.FAIL)
        errors = sum(1 for r in results if r.outcome is Outcome.ERROR)
        skipped = sum(1 for r in results if r.outcome in (Outcome.SKIP, Outcome.UNSUPPORTED, Outcome.NOT_RUN))
        time_s = sum(r.duration for r in results)
        suite = ET.SubElement(root, "testsuite", {
            "name": cat.value, "tests": str(len(results)), "failures": str(failures), "errors": str(errors),
            "skipped": str(skipped), "time": f"{time_s:.4f}", "timestamp": stamp, "hostname": host, "id": str(i),
            "package": "ggml_rpc.conformance",
        })
        props = ET.SubElement(suite, "properties")
        for name, value in (("server", runner.target.address), ("hello", runner.info.version_label),
                            ("verdict", runner.info.verdict)):
            ET.SubElement(props, "property", name=name, value=value)
        for r in results:
            case = ET.SubElement(suite, "testcase", {
                "name": f"{r.check.id} {r.check.title}",
                "classname": f"ggml_rpc.conformance.{cat.value}",
                "time": f"{r.duration:.4f}",
            })
            if r.outcome is Outcome.FAIL:
                el = ET.SubElement(case, "failure", message=r.message,
                                   type=r.failed_level.value if r.failed_level else "MUST")
                el.text = _evidence_text(r)
            elif r.outcome is Outcome.ERROR:
                el = ET.SubElement(case, "error", message=r.message, type="check-error")
                el.text = _evidence_text(r)
            elif r.outcome is not Outcome.PASS:
                ET.SubElement(case, "skipped", message=f"{r.outcome.value}: {r.message}")
            if r.evidence or r.server_death or r.pcap or r.html:
                ET.SubElement(case, "system-out").text = _evidence_text(r)
        ET.SubElement(suite, "system-out").text = ""
        ET.SubElement(suite, "system-err").text = ""
        totals["tests"] += len(results)
        totals["failures"] += failures
        totals["errors"] += errors
        totals["skipped"] += skipped
        total_time += time_s
    root.set("tests", str(totals["tests"]))
    root.set("failures", str(totals["failures"]))
    root.set("errors", str(totals["errors"]))
    # junit-10.xsd gives <testsuites> no skipped count: skips are counted per <testsuite>.
    root.set("time", f"{total_time:.4f}")
    return root


def write_junit(runner: Runner, path: str | Path) -> None:
    tree = ET.ElementTree(to_junit(runner))
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)
