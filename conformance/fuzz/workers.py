"""Several fuzzing processes on one campaign (``ggml-rpc fuzz --workers N``), on one machine or several.

The workers share one findings set and one corpus through a hypothesis example database: a folder on this machine
(:class:`~hypothesis.database.DirectoryBasedExampleDatabase`, the default) or a Redis server that workers on
several machines reach (``--database redis://HOST:PORT/DB``, :class:`~hypothesis.extra.redis.RedisExampleDatabase`).
Under the campaign's key the database holds, per finding class, its record (the ``findings.json`` entry) and its
reproducer (the pcap's bytes): the corpus of programs that fail the target. A worker that meets a class the set
already holds counts a hit and goes on, without shrinking, verifying or saving it again; at the end the workers'
reports are merged into one, each class once, with the classes other machines put in the set.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from .findings import SavedFinding
from .reports import SARIF_SCHEMA, finding_dict

#: Every key of the kit's in a shared database starts so (a Redis server may hold other things).
KEY_PREFIX = b"ggml-rpc-kit:fuzz:"
#: How long a Redis-held campaign's entries live after their last write.
REDIS_EXPIRY = timedelta(days=30)


class DatabaseError(Exception):
    """The shared database cannot be used (the message says why: a user mistake, one line)."""


def open_database(spec: str) -> ExampleDatabase:
    """``redis://HOST:PORT/DB`` (or ``rediss://``, ``unix://``): a Redis server; anything else: a folder."""
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError:
            raise DatabaseError(f"--database {spec}: the redis package is needed (pip install "
                                "'ggml-rpc-kit[redis]')") from None
        try:
            client = redis.Redis.from_url(spec)
            client.ping()
        except (redis.RedisError, ValueError) as exc:
            raise DatabaseError(f"--database {spec}: {exc}") from None
        return RedisExampleDatabase(client, expire_after=REDIS_EXPIRY, key_prefix=KEY_PREFIX)
    path = Path(spec)
    if path.exists() and not path.is_dir():
        raise DatabaseError(f"--database {spec}: exists and is not a folder")
    return DirectoryBasedExampleDatabase(str(path))


def campaign_key(target: str, protocol: str) -> bytes:
    """The key a campaign's entries are kept under: the target as described (its command line, with ``{port}``)
    and the protocol, so that campaigns against different servers never share classes."""
    return KEY_PREFIX + hashlib.sha256(f"{target}\0{protocol}".encode()).hexdigest()[:32].encode()


def _signature(signature: Sequence[str]) -> str:
    return json.dumps(list(signature))


class SharedFindings:
    """The finding classes of every worker of one campaign, in ``db`` under ``key``."""

    def __init__(self, db: ExampleDatabase, key: bytes, worker: str) -> None:
        self.db = db
        self.key = key
        self.worker = worker
        #: Classes this worker already knows the set holds (the database is only asked about others).
        self._known: set[str] = set()

    def known(self, signature: Sequence[str]) -> bool:
        """Does the set hold this class (found by any worker)?"""
        sig = _signature(signature)
        if sig in self._known:
            return True
        for raw in self.db.fetch(self.key):
            try:
                self._known.add(json.loads(raw)["signature"])
            except (ValueError, KeyError, TypeError):
                continue  # not an entry of the kit's: ignored
        return sig in self._known

    def add(self, signature: Sequence[str], saved: SavedFinding, hits: int = 1) -> None:
        """Put a class this worker found (its record, and its reproducer into the corpus) in the set."""
        sig = _signature(signature)
        self._known.add(sig)
        record = {"signature": sig, "worker": self.worker, "finding": finding_dict(saved, hits)}
        self.db.save(self.key, json.dumps(record, sort_keys=True).encode())
        if saved.pcap is not None and saved.pcap.is_file():
            self.db.save(self.key + b":corpus", saved.class_id.encode() + b"\0" + saved.pcap.read_bytes())

    def records(self) -> list[dict[str, Any]]:
        """Every class in the set: ``{"signature", "worker", "finding"}``."""
        out = []
        for raw in self.db.fetch(self.key):
            try:
                record = json.loads(raw)
                if isinstance(record, dict) and "signature" in record and "finding" in record:
                    out.append(record)
            except ValueError:
                continue
        return out

    def corpus(self) -> dict[str, bytes]:
        """Class id -> its reproducer's pcap bytes."""
        out = {}
        for raw in self.db.fetch(self.key + b":corpus"):
            name, sep, data = raw.partition(b"\0")
            if sep:
                out[name.decode("utf-8", "replace")] = data
        return out


def merge_reports(reports: Sequence[tuple[str, Path]], out_dir: Path,
                  shared: SharedFindings | None = None) -> dict[str, Any]:
    """One ``findings.json`` (and ``findings.txt``, reproducers) in ``out_dir`` from the workers' reports
    (``(worker, its output folder)``): each class once (the first found, its hits summed), the set's classes no
    local worker has added with their reproducers from the corpus; the merged record."""
    out_dir.mkdir(parents=True, exist_ok=True)
    merged: dict[str, dict[str, Any]] = {}
    totals = {"examples": 0, "messages": 0, "restarts": 0, "fork_restarts": 0, "findings_seen": 0,
              "shrink_replays": 0}
    seconds = 0.0
    base: dict[str, Any] = {}
    workers = []
    for worker, folder in reports:
        path = folder / "findings.json"
        if not path.is_file():
            workers.append({"worker": worker, "report": None})
            continue
        data = json.loads(path.read_text())
        base = base or data
        workers.append({"worker": worker, "report": str(path), "examples": data.get("examples"),
                        "messages": data.get("messages"), "seconds": data.get("seconds")})
        for key in totals:
            totals[key] += int(data.get(key) or 0)
        seconds = max(seconds, float(data.get("seconds") or 0.0))
        for c in data.get("classes", []):
            entry = dict(c, worker=worker)
            have = merged.get(c["class"])
            if have is None:
                merged[c["class"]] = entry
            else:
                have["hits"] = int(have.get("hits") or 1) + int(c.get("hits") or 1)
                if c.get("first_seconds", 0) < have.get("first_seconds", 0):
                    merged[c["class"]] = dict(entry, hits=have["hits"])
    corpus = shared.corpus() if shared is not None else {}
    if shared is not None:
        for record in shared.records():
            c = record["finding"]
            if c["class"] not in merged:
                merged[c["class"]] = dict(c, worker=record["worker"], reproducer=None)
    lines = []
    for number, c in enumerate(sorted(merged.values(), key=lambda c: c.get("first_seconds", 0.0)), start=1):
        stem = f"finding-{number:03d}-{c['kind']}"
        source = Path(c["reproducer"]) if c.get("reproducer") else None
        target = out_dir / f"{stem}.pcap"
        if source is not None and source.is_file():
            shutil.copyfile(source, target)
        elif c["class"] in corpus:
            target.write_bytes(corpus[c["class"]])
        else:
            target = None
        c["reproducer"] = str(target) if target else None
        c["reproducer_bytes"] = target.stat().st_size if target else None
        lines.append(f"{stem}: {c['kind']} on {c.get('command') or '-'}: {c.get('message', '')} "
                     f"(class {c['class']}; {c.get('hits', 1)} hit(s); worker {c['worker']})")
    record = {k: v for k, v in base.items() if k not in ("classes", *totals)}
    seconds = seconds or 1.0
    record.update(totals, seconds=round(seconds, 1), messages_per_second=round(totals["messages"] / seconds, 1),
                  workers=workers, classes=sorted(merged.values(), key=lambda c: c.get("first_seconds", 0.0)))
    (out_dir / "findings.json").write_text(json.dumps(record, indent=2) + "\n")
    (out_dir / "findings.txt").write_text("".join(f"{line}\n" for line in lines))
    return record


def sarif_of_record(record: dict[str, Any]) -> dict[str, Any]:
    """A SARIF 2.1.0 log of a merged record (as :func:`.reports.to_sarif` writes one worker's)."""
    classes, results, artifacts = [], [], []  # one description per class: SARIF's "rules"
    for c in record["classes"]:
        text = f"{c['kind']}{' on ' + c['command'] if c.get('command') else ''}: {c.get('message', '')}"
        classes.append({"id": c["class"], "name": c["kind"], "shortDescription": {"text": text[:200]},
                        "properties": {k: c.get(k) for k in ("kind", "symptom", "command", "rule")}})
        result: dict[str, Any] = {
            "ruleId": c["class"], "ruleIndex": len(classes) - 1,
            "level": "error" if c["kind"] in ("crash", "info-leak", "out-of-buffer", "undefined-behaviour")
            else "warning",
            "message": {"text": text},
            "properties": {k: c.get(k) for k in ("first_seconds", "verified", "messages", "hits", "worker")},
        }
        pcap = Path(c["reproducer"]) if c.get("reproducer") else None
        if pcap is not None and pcap.is_file():
            raw = pcap.read_bytes()
            artifacts.append({"location": {"uri": pcap.name, "uriBaseId": "FINDINGS"}, "length": len(raw),
                              "mimeType": "application/vnd.tcpdump.pcap",
                              "hashes": {"sha-256": hashlib.sha256(raw).hexdigest()}})
            result["locations"] = [{"physicalLocation": {"artifactLocation": {
                "uri": pcap.name, "uriBaseId": "FINDINGS", "index": len(artifacts) - 1}}}]
        results.append(result)
    run: dict[str, Any] = {"tool": {"driver": {"name": "ggml-rpc fuzz", "rules": classes}}, "results": results,
                           "artifacts": artifacts,
                           "properties": {k: v for k, v in record.items() if k not in ("classes", "workers")}}
    folder = next((Path(c["reproducer"]).parent for c in record["classes"] if c.get("reproducer")), None)
    if folder is not None:
        run["originalUriBaseIds"] = {"FINDINGS": {"uri": folder.resolve().as_uri() + "/"}}
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


__all__ = ["KEY_PREFIX", "DatabaseError", "SharedFindings", "campaign_key", "merge_reports", "open_database",
           "sarif_of_record"]
