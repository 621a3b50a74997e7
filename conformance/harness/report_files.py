"""Machine-readable reports of a conformance run: JSON (``--json``) and JUnit XML (``--junit``).

JSON shape (``format`` names it; fields are only ever added)::

    {
      "format": "ggml-rpc-check/1",
      "kit_version": "0.1.0",
      "server": {"target": "...", "address": "127.0.0.1:50052", "hello": "7.0.0", "verdict": "speaks 7.0",
                 "devices": 1, "cache": true | false | null},
      "started": "2026-12-02T10:00:00+00:00", "duration_s": 1.23, "strict": false, "exit_code": 0, "seed": 24301,
      "verdict": {"state": "conformant" | "not conformant" | "not covered" | "incomplete", "exit_code": 0,
                  "line": "→ conformant — robustness: 0 deaths, 0 leaks", "reasons": [...], "deaths": 0, "leaks": 0,
                  "blocked": 0, "setup_refusals": [{"cause": "...", "blocked": 79}], "failures": ["FRAME-031"], ...},
      "summary": {"total": 96, "pass": 90, "fail": 0, "skip": 1, "unsupported": 5, "not run": 0, "error": 0,
                  "must_failures": 0, "should_failures": 0},
      "results": [{"id": "HELLO-001", "title": "...", "category": "handshake", "level": "MUST", "versions": "any",
                   "spec": "spec/PROTOCOL.md#v7-hello", "outcome": "pass" | "fail" | "skip" | "unsupported" |
                   "not run" | "error" | "blocked", "failed_level": null | "MUST" | "SHOULD", "message": "...",
                   "duration_s": 0.001, "evidence": [{"step": "...", "sent": "hex…", "expected": "...",
                   "got": "hex…"}], "server_death": null | {"status": "killed by signal SIGABRT", "exit_code": -6,
                   "log_tail": ["..."]}, "pcap": null | "DIR/ID.pcap", "html": null | "DIR/checks/ID.html"}]
    }

JUnit: one ``<testsuite>`` per category inside ``<testsuites>``; a check is a ``<testcase>`` (classname
``ggml_rpc.conformance.<category>``, name ``<ID> <title>``); a failure is ``<failure>`` (type = the failed
level; a death's message starts with "died"), a crashed check ``<error>`` (type ``check-error``), a blocked one
``<error>`` (type ``blocked``), skip/unsupported/not run ``<skipped>``; evidence goes to the case's
``<system-out>``.  A last ``<testsuite name="verdict">`` holds one case, the run's verdict (:mod:`.verdict`):
failed unless the run is conformant, so a CI system reading only JUnit sees what the exit code says.

SARIF 2.1.0 (``--sarif``): one rule per check of the run, one result per failed or blocked check (level
``error`` for a MUST failure or a death, ``warning`` for a SHOULD failure, ``note`` for a blocked check), the
verdict in the run's ``properties`` and the exit code in its invocation.

JUnit elements, attributes and their order follow the widely used JUnit XML schema of Jenkins (``junit-10.xsd``):
``<testsuites>`` carries name/tests/failures/errors/time, each ``<testsuite>`` adds skipped, timestamp, hostname, id
and package, then properties, testcases, system-out and system-err in that order.
"""

from __future__ import annotations

import json
import socket
import sys
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .. import kit_version
from .model import Outcome, Result, iter_groups
from .runner import Runner
from .verdict import State, died, reason

FORMAT = "ggml-rpc-check/1"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def to_json(runner: Runner, strict: bool = False) -> dict[str, Any]:
    info = runner.info
    verdict = runner.verdict(strict)
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
        "exit_code": verdict.exit_code,
        "seed": runner.seed,  # what `check --seed` takes to send the same inputs again
        "verdict": verdict.as_dict(),
        "summary": runner.summary(),
        "results": [r.as_dict() for r in runner.results],
    }


def _write(path: str | Path, text: str) -> None:
    """A report file, or standard output for ``-`` (the CLI convention)."""
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(path).write_text(text, encoding="utf-8")


def write_json(runner: Runner, path: str | Path, strict: bool = False) -> None:
    _write(path, json.dumps(to_json(runner, strict), indent=2) + "\n")


def evidence_lines(r: Result) -> list[str]:
    """A result's evidence (each step with what was sent, expected and got) and server death, as plain text."""
    lines = []
    for e in r.evidence:
        lines.append(f"- {e.step}")
        for label, value in (("sent", e.sent), ("expected", e.expected), ("got", e.got)):
            if value:
                lines.append(f"    {label}: {value}")
    if r.server_death:
        d = r.server_death
        lines.append(f"server death: {d.get('status')}" + (f" during step '{d['step']}'" if d.get("step") else "")
                     + (f"; bytes sent: {d['sent']}" if d.get("sent") else ""))
    return lines


def _evidence_text(r: Result) -> str:
    lines = [f"{r.check.id} [{r.check.level.value}] {r.outcome.value}: {r.message}", f"spec: {r.spec}",
             *evidence_lines(r)]
    if r.server_death:
        lines.extend(f"    log: {line}" for line in r.server_death.get("log_tail", []))
    lines.extend(f"{label}: {path}" for label, path in (("pcap", r.pcap), ("html", r.html)) if path)
    return "\n".join(lines)


def to_junit(runner: Runner, strict: bool = False) -> ET.Element:
    root = ET.Element("testsuites", name="ggml-rpc check")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    host = socket.gethostname()
    stamp = datetime.fromtimestamp(runner.started_at, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    verdict = runner.verdict(strict)
    for i, (cat, results) in enumerate(iter_groups(runner.results)):
        failures = sum(1 for r in results if r.outcome is Outcome.FAIL)
        errors = sum(1 for r in results if r.outcome in (Outcome.ERROR, Outcome.BLOCKED))
        skipped = sum(1 for r in results if r.outcome in (Outcome.SKIP, Outcome.UNSUPPORTED, Outcome.NOT_RUN))
        time_s = sum(r.duration for r in results)
        suite = ET.SubElement(root, "testsuite", {
            "name": cat.value, "tests": str(len(results)), "failures": str(failures), "errors": str(errors),
            "skipped": str(skipped), "time": f"{time_s:.4f}", "timestamp": stamp, "hostname": host, "id": str(i),
            "package": "ggml_rpc.conformance",
        })
        props = ET.SubElement(suite, "properties")
        for name, value in (("server", runner.target.address), ("hello", runner.info.version_label),
                            ("protocol", runner.info.verdict), ("verdict", verdict.state.value),
                            ("verdict line", verdict.line()), ("seed", str(runner.seed))):
            ET.SubElement(props, "property", name=name, value=value)
        for r in results:
            case = ET.SubElement(suite, "testcase", {
                "name": f"{r.check.id} {r.check.title}",
                "classname": f"ggml_rpc.conformance.{cat.value}",
                "time": f"{r.duration:.4f}",
            })
            if r.outcome is Outcome.FAIL:
                # A death's message already starts "server died …": the failure says it is a death.
                message = f"died: {r.message}" if died(r) and not r.message.startswith("server") else r.message
                el = ET.SubElement(case, "failure", message=message,
                                   type=r.failed_level.value if r.failed_level else "MUST")
                el.text = _evidence_text(r)
            elif r.outcome is Outcome.ERROR:
                el = ET.SubElement(case, "error", message=r.message, type="check-error")
                el.text = _evidence_text(r)
            elif r.outcome is Outcome.BLOCKED:
                el = ET.SubElement(case, "error", message=f"blocked: {r.message}", type="blocked")
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
    # The verdict as a case of its own: a JUnit reader that ignores exit codes still sees a run that is not
    # conformant (a version not covered, a blocked setup, deaths) as failed.
    suite = ET.SubElement(root, "testsuite", {
        "name": "verdict", "tests": "1", "failures": str(int(verdict.state is not State.CONFORMANT)), "errors": "0",
        "skipped": "0", "time": "0.0000", "timestamp": stamp, "hostname": host, "id": str(len(root) - 1),
        "package": "ggml_rpc.conformance",
    })
    ET.SubElement(suite, "properties")
    case = ET.SubElement(suite, "testcase", {"name": f"verdict: {verdict.state.value}",
                                             "classname": "ggml_rpc.conformance.verdict", "time": "0.0000"})
    if verdict.state is not State.CONFORMANT:
        el = ET.SubElement(case, "failure", message=verdict.line(), type=verdict.state.value)
        el.text = "\n".join([verdict.line(), *(f"{r.check.id}: {reason(r)}" for r in verdict.failures)])
    ET.SubElement(suite, "system-out").text = verdict.line()
    ET.SubElement(suite, "system-err").text = ""
    totals["tests"] += 1
    totals["failures"] += int(verdict.state is not State.CONFORMANT)
    root.set("tests", str(totals["tests"]))
    root.set("failures", str(totals["failures"]))
    root.set("errors", str(totals["errors"]))
    # junit-10.xsd gives <testsuites> no skipped count: skips are counted per <testsuite>.
    root.set("time", f"{total_time:.4f}")
    return root


def write_junit(runner: Runner, path: str | Path, strict: bool = False) -> None:
    root = to_junit(runner, strict)
    ET.indent(root)
    _write(path, "<?xml version='1.0' encoding='utf-8'?>\n" + ET.tostring(root, encoding="unicode") + "\n")


SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def to_sarif(runner: Runner, strict: bool = False) -> dict[str, Any]:
    """The run as SARIF 2.1.0: the checks as rules, failed and blocked checks as results, the verdict in the run's
    properties (the same verdict as every other format)."""
    verdict = runner.verdict(strict)
    rules, index = [], {}
    for r in runner.results:
        if r.check.id not in index:
            index[r.check.id] = len(rules)
            rules.append({"id": r.check.id, "name": r.check.id, "shortDescription": {"text": r.check.title},
                          "helpUri": r.spec or None, "properties": {"level": r.check.level.value,
                                                                    "category": r.check.category.value}})
    results = []
    for r in runner.results:
        if not (r.failed or r.outcome is Outcome.BLOCKED):
            continue
        if r.outcome is Outcome.BLOCKED:
            level = "note"
        elif died(r) or (r.failed_level or r.check.level).value == "MUST" or r.outcome is Outcome.ERROR:
            level = "error"
        else:
            level = "warning"
        result: dict[str, Any] = {
            "ruleId": r.check.id, "ruleIndex": index[r.check.id], "level": level,
            "message": {"text": f"{r.check.id} {r.outcome.value}: {r.message}"},
            "properties": {"outcome": r.outcome.value, "failedLevel": r.failed_level.value if r.failed_level else None,
                           "evidence": evidence_lines(r), "serverDeath": r.server_death},
        }
        if r.pcap:
            result["locations"] = [{"physicalLocation": {"artifactLocation": {"uri": Path(r.pcap).as_posix()}}}]
        results.append(result)
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "ggml-rpc check", "version": kit_version(), "rules": rules}},
            "invocations": [{"executionSuccessful": verdict.state is State.CONFORMANT,
                             "exitCode": verdict.exit_code,
                             "startTimeUtc": _iso(runner.started_at)}],
            "results": results,
            "properties": {"target": runner.target.description, "address": runner.target.address,
                           "protocol": runner.info.verdict, "verdict": verdict.as_dict(), "seed": runner.seed},
        }],
    }


def write_sarif(runner: Runner, path: str | Path, strict: bool = False) -> None:
    _write(path, json.dumps(to_sarif(runner, strict), indent=2) + "\n")
