"""The hunt's reports: ``findings.json`` (one entry per finding class) and SARIF 2.1.0."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Protocol

from .. import kit_version
from .findings import SavedFinding


class Reported(Protocol):
    """A campaign as its reports see it (:class:`.campaign.Campaign`, :class:`.hunt.Hunt`)."""

    findings: list[SavedFinding]

    def report(self) -> dict[str, Any]:
        """Everything ``findings.json`` holds."""
        ...


def finding_dict(f: SavedFinding, hits: int = 1) -> dict[str, Any]:
    return {
        "class": f.class_id, "kind": f.kind, "symptom": f.symptom, "command": f.command, "rule": f.flaw,
        "message": f.message, "broken": f.broken, "first_seconds": f.first_seconds, "hits": hits,
        "messages": f.messages, "connections": f.connections, "verified": f.verified, "shrunk": f.shrunk,
        "reproducer": str(f.pcap) if f.pcap else None,
        "reproducer_bytes": f.pcap.stat().st_size if f.pcap and f.pcap.exists() else None,
        "death": {k: v for k, v in (f.death or {}).items() if k in ("status", "exit_code", "log_tail", "sanitizer")}
        or None,
        "sanitizer": f.report,
        "notes": f.notes,
    }


def write_reports(campaign: Reported, out_dir: Path, sarif: Path | str | None = None) -> Path:
    """``findings.json`` in ``out_dir`` (and SARIF at ``sarif``, ``-``: standard output); the JSON file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = campaign.report()
    path = out_dir / "findings.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    if sarif is not None:
        text = json.dumps(to_sarif(campaign.findings, data), indent=2) + "\n"
        if str(sarif) == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            Path(sarif).parent.mkdir(parents=True, exist_ok=True)
            Path(sarif).write_text(text)
    return path


SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def to_sarif(findings: list[SavedFinding], summary: dict[str, Any]) -> dict[str, Any]:
    """A SARIF 2.1.0 log: one result per finding class, each class described once (SARIF's ``rules`` array of the
    driver, SARIF's word), the reproducer pcap as the artifact."""
    classes, results, artifacts = [], [], []
    for f in findings:
        classes.append({"id": f.class_id, "name": f.kind, "shortDescription": {"text": f.line()[:200]},
                        "properties": {"kind": f.kind, "symptom": f.symptom, "command": f.command, "rule": f.flaw}})
        result: dict[str, Any] = {
            "ruleId": f.class_id, "ruleIndex": len(classes) - 1,
            "level": "error" if f.kind in ("crash", "info-leak", "out-of-buffer", "undefined-behaviour")
            else "warning",
            "message": {"text": f.line()},
            "properties": {"first_seconds": f.first_seconds, "verified": f.verified, "messages": f.messages},
        }
        if f.pcap is not None and f.pcap.exists():
            raw = f.pcap.read_bytes()
            artifacts.append({"location": {"uri": f.pcap.name, "uriBaseId": "FINDINGS"}, "length": len(raw),
                              "mimeType": "application/vnd.tcpdump.pcap",
                              "hashes": {"sha-256": hashlib.sha256(raw).hexdigest()},
                              "description": {"text": f"reproducer: ggml-rpc replay {f.pcap.name} --server "
                                                      "HOST:PORT"}})
            result["locations"] = [{"physicalLocation": {"artifactLocation": {
                "uri": f.pcap.name, "uriBaseId": "FINDINGS", "index": len(artifacts) - 1}}}]
        results.append(result)
    out_dir = next((f.pcap.parent for f in findings if f.pcap is not None), None)
    run: dict[str, Any] = {
        "tool": {"driver": {"name": "ggml-rpc fuzz", "version": kit_version(),
                            "informationUri": "https://github.com/ggml-org/llama.cpp", "rules": classes}},
        "results": results,
        "artifacts": artifacts,
        "properties": {k: v for k, v in summary.items() if k != "classes"},
    }
    if out_dir is not None:
        run["originalUriBaseIds"] = {"FINDINGS": {"uri": out_dir.resolve().as_uri() + "/"}}
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}



__all__ = ["SARIF_SCHEMA", "Reported", "finding_dict", "to_sarif", "write_reports"]
