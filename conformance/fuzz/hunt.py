"""Campaign mode for a target that dies often (``ggml-rpc fuzz --hunt``): upstream ``rpc-server`` 6.0/7.0.

The hypothesis campaign (:mod:`.campaign`) ends a round at every finding and shrinks it by re-running examples:
fine for a server that rarely fails, hopeless for one that dies every few hundred messages.  Here every example is
a seeded program (no hypothesis), judged by the same model and invariants (:class:`.example.Example`); a finding is
recorded and the campaign goes straight on (the target is restarted, the next example starts).  Besides the
generic steps, examples run *strategies* aimed at the classes of protocol.md §10/§12: deep src chains, node-id and
row-index mutations, size headers of 2^63 and more, region edges, the other major's SET_TENSOR layout, a client
that leaves before its reply, and reads of fresh buffers (info leaks).

Findings are deduplicated by class -- (kind, signal and assertion or leak symptom, command, rule broken) -- and the
first of each class is shrunk to a minimal reproducer on a fresh target (delta debugging over the requests of
the connection that failed, each candidate replayed by ``ggml-rpc replay``'s engine), then verified by one more
run against a fresh target.  Reports: ``findings.txt`` lines, ``findings.json``, and SARIF 2.1.0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import socket
import struct
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.conformance.harness import Target
from ggml_rpc.reference.connection import ServerConfig
from ggml_rpc.spec import CONN_CAPS_SIZE, Command, GgmlOp, GgmlType, Protocol, TensorFlag, encode_request
from ggml_rpc.spec.codec import TENSOR_DTYPE

from .campaign import Campaign, Options, _hello_reply, _return_free_memory
from .draws import RandomDraw
from .example import Example
from .findings import Finding, SavedFinding, Writes, death_symptom, rule_class, save
from .generate import BufferRef, TensorRef
from .message import FuzzMessage
from .model import ModelStall

#: Steps of one example (generic steps and strategies together).
HUNT_STEPS = 24
#: Longest burst of generic steps in one step of an example.
BURST = 32
#: Out of 100 steps, how many are strategies aimed at a known class (the rest: the generic generators).
STRATEGY_PERCENT = 35
#: Replays spent shrinking one finding at most (each on a freshly restarted target).
SHRINK_TRIALS = 40
#: The src-chain depth upstream's recursive graph rebuild does not survive (§12: 100,000 computes).
DEEP_CHAIN = 300_000
#: Out of 1,000 strategy picks, how many are the (89 MB) deep chain.
DEEP_PER_MILLE = 4
#: Seconds the 89 MB of a deep chain may take to go out and be answered (or closed).
DEEP_WAIT = 30.0
#: Row indices for GET_ROWS past any table the fuzzer builds.
BAD_ROWS = (-1, 8, 9, 1 << 16, 0x7FFFFFFF, -(1 << 31))


@dataclass
class HuntStats:
    findings_seen: int = 0
    classes: int = 0
    shrink_replays: int = 0
    verified: int = 0
    unverified: int = 0
    fuzzer_errors: int = 0


class Hunt(Campaign):
    """Seeded examples without hypothesis; every finding recorded, the campaign goes on after each death."""

    def __init__(self, target: Target, protocol: Protocol, model_config: ServerConfig, options: Options, *,
                 devices: int = 1, alignment: int = 32, progress: Callable[[Campaign], None] | None = None,
                 on_finding: Callable[[SavedFinding], None] | None = None) -> None:
        super().__init__(target, protocol, model_config, options, devices=devices, alignment=alignment,
                         progress=progress, on_finding=on_finding)
        self.hunt = HuntStats()
        self._classes: dict[tuple, SavedFinding] = {}
        #: Every hit, per class id (the first is shrunk; the count says how often the class came back).
        self.hits: dict[str, int] = {}

    # ---- the run -----------------------------------------------------------------------------------------------

    def run(self) -> list[SavedFinding]:
        warnings.simplefilter("ignore", RuntimeWarning)  # the model's executor on fuzzed numbers
        number = 0
        try:
            while not self.stop_requested:
                o = self.options
                if o.examples is not None and number >= o.examples:
                    self.stopped_because = "budget spent"
                    break
                if o.seconds is not None and self.stats.seconds >= o.seconds:
                    self.stopped_because = "budget spent"
                    break
                if o.max_findings is not None and len(self.findings) >= o.max_findings:
                    self.stopped_because = f"{len(self.findings)} finding(s)"
                    break
                self._one(random.Random(o.seed * 1_000_003 + number))
                number += 1
                if self.gone:
                    self.stopped_because = f"target died: {self.gone}"
                    break
                if number % 64 == 0:
                    _return_free_memory()
            else:
                self.stopped_because = "interrupted"
        finally:
            self._close_example()
            if self.model_cache is not None:
                self.model_cache.remove()
        return self.findings

    def _one(self, rng: random.Random) -> None:
        ex = self.new_example()
        if ex.inert:
            return
        d = RandomDraw(rng)
        try:
            ex.prepare(ex.new_ref())
            for _ in range(self.options.steps):
                if ex.inert:
                    break
                if rng.randrange(100) < STRATEGY_PERCENT:
                    strategy(rng)(self, ex, d, rng)
                else:
                    # Seeded bursts of the generic generators carry the message rate (as in the machine).
                    ex.burst(rng, rng.randint(1, BURST))
            ex.finish()
        except Finding as finding:
            self._record(ex, finding)
        except ModelStall:
            self.hunt.fuzzer_errors += 1
        except OSError:
            # The target went away between two of the example's own checks: look again before the next one.
            self.mark_dead()
        finally:
            self._close_example()

    # ---- findings ------------------------------------------------------------------------------------------------

    def found(self, example: Example, finding: Finding) -> None:
        """Nothing to keep for hypothesis here (it would start the shrink clock that turns examples inert): the
        finding reaches :meth:`_record` as the exception it is."""

    def _record(self, ex: Example, finding: Finding) -> None:
        self.hunt.findings_seen += 1
        key = finding.signature
        saved = self._classes.get(key)
        if saved is not None:
            self.hits[saved.class_id] = self.hits.get(saved.class_id, 0) + 1
            return
        at = _culprit(ex.transcript)
        if at is None:
            return
        groups, msgs = _groups(ex.transcript[at]), list(ex.sent[at])
        early = finding.broken is not None and finding.broken.startswith("early-close")
        verified: bool | None = None
        if self.target.can_restart and len(groups) == len(msgs):
            kept = self._shrink(list(range(len(groups))), groups, finding, early)
            groups, msgs = [groups[i] for i in kept], [msgs[i] for i in kept]
            verified = self._reproduces(groups, finding, early)
            # The death is the last request's that still reproduces it: a no-reply request before the one that
            # noticed the death (a GRAPH_COMPUTE before an ALLOC_BUFFER) takes the blame once shrinking shows it.
            last = msgs[-1]
            if verified and (last.name, last.broken) != (finding.command, finding.broken):
                finding.command, finding.broken = last.name, last.broken
                again = self._classes.get(finding.signature)
                if again is not None:
                    self._classes[key] = again
                    self.hits[again.class_id] = self.hits.get(again.class_id, 0) + 1
                    return
        saved = SavedFinding(finding.kind, finding.message, finding.command, finding.broken, messages=0,
                             connections=1, death=finding.death, shrunk=verified is not None, symptom=key[1],
                             rule=rule_class(finding.broken), first_seconds=round(self.stats.seconds, 2),
                             verified=verified)
        self._classes[key] = self._classes[finding.signature] = saved
        self.hits[saved.class_id] = 1
        self.hunt.classes += 1
        if verified:
            self.hunt.verified += 1
        else:
            self.hunt.unverified += 1
            saved.notes.append("not verified: the reproducer did not fail a fresh target the same way"
                               if verified is False else "not verified: the target cannot be restarted")
        if early:
            saved.notes.append("the client closes before reading the last reply: `ggml-rpc replay` reads every "
                               "reply, so only the fuzzer's raw re-run (client bytes, then close) reproduces it")
        writes = _writes(groups)
        saved.messages = sum(1 for c, _ in writes if c)
        if self.options.out_dir is not None:
            save(saved, [writes, self._probe()], self.options.out_dir, len(self.findings) + 1)
        self.findings.append(saved)
        self.mark_dead()  # the next example checks the target (shrinking restarted it more than once)
        if self._on_finding is not None:
            self._on_finding(saved)

    def _probe(self) -> Writes:
        return [(True, encode_request(self.protocol, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})),
                (False, _hello_reply(self.protocol))]

    def _shrink(self, order: list[int], groups: list[Writes], finding: Finding, early: bool) -> list[int]:
        """Delta debugging over the requests after HELLO (indices into ``groups``): drop chunks, the last request
        included, while the program still fails a fresh target as the finding did."""
        head, body = order[:1], order[1:]
        budget = SHRINK_TRIALS
        chunk = max(1, len(body) // 2)
        while chunk >= 1 and budget > 0 and len(body) > 1:
            i = 0
            removed = False
            while i < len(body) and budget > 0 and len(body) > 1:
                candidate = body[:i] + body[i + chunk:]
                if not candidate:
                    break
                budget -= 1
                if self._reproduces([groups[k] for k in head + candidate], finding, early):
                    body = candidate
                    removed = True
                else:
                    i += chunk
            if not removed:
                chunk //= 2
        return head + body

    def _reproduces(self, groups: list[Writes], finding: Finding, early: bool) -> bool:
        """Does this program fail a freshly restarted target as the finding did (same class)?"""
        self.hunt.shrink_replays += 1
        try:
            self.target.restart()
            self.stats.restarts += 1
        except Exception:
            return False
        if not self.alive():
            return False
        try:
            if early:
                got = self._raw_rerun(groups)
            else:
                got = self._replay(groups)
        finally:
            self._dead = True
        if finding.kind == "crash":
            if self.alive():
                return False
            return death_symptom(self.target.death_info()) == death_symptom(finding.death)
        return got == finding.kind

    def _replay(self, groups: list[Writes]) -> str:
        """Replay the program with ``ggml-rpc replay``'s engine; the kind of failure seen ('' if none)."""
        from ggml_rpc.conformance.sessions.replay import ReplayError, replay

        with tempfile.TemporaryDirectory(prefix="ggml-rpc-hunt-") as tmp:
            pcap = Path(tmp) / "candidate.pcap"
            from ggml_rpc.conformance.sessions.pcapwrite import write_session

            write_session(pcap, [_writes(groups), self._probe()])
            try:
                report = replay([pcap], self.target.host, self.target.port, timeout=self.timeout)
            except ReplayError:
                return "crash"
            except Exception:
                return ""
        if report.ok:
            return ""
        kinds = {m.kind for m in report.mismatches}
        if "transport" in kinds:
            return "crash"
        return "info-leak" if any(m.command == "GET_TENSOR" for m in report.mismatches) else "wrong-reply"

    def _raw_rerun(self, groups: list[Writes]) -> str:
        """Send the program's client bytes (replies read, except the last) and leave: for early-close findings."""
        try:
            sock = socket.create_connection((self.target.host, self.target.port), timeout=self.timeout)
        except OSError:
            return "crash"
        with contextlib.closing(sock):
            try:
                for group in groups[:-1]:
                    sock.sendall(group[0][1])
                    _recv_exact(sock, sum(len(raw) for sent, raw in group[1:]))
                sock.sendall(groups[-1][0][1])
            except OSError:
                return "crash"
        return ""

    # ---- reports -------------------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Everything ``findings.json`` holds."""
        st = self.stats
        return {
            "target": self.target.description,
            "protocol": self.protocol.label,
            "seed": self.options.seed,
            "examples": st.examples,
            "messages": st.messages,
            "seconds": round(st.seconds, 1),
            "messages_per_second": round(st.rate, 1),
            "restarts": st.restarts,
            "findings_seen": self.hunt.findings_seen,
            "shrink_replays": self.hunt.shrink_replays,
            "classes": [finding_dict(f, self.hits.get(f.class_id, 1)) for f in self.findings],
        }


def finding_dict(f: SavedFinding, hits: int = 1) -> dict[str, Any]:
    return {
        "class": f.class_id, "kind": f.kind, "symptom": f.symptom, "command": f.command, "rule": f.rule,
        "message": f.message, "broken": f.broken, "first_seconds": f.first_seconds, "hits": hits,
        "messages": f.messages, "connections": f.connections, "verified": f.verified, "shrunk": f.shrunk,
        "reproducer": str(f.pcap) if f.pcap else None,
        "reproducer_bytes": f.pcap.stat().st_size if f.pcap and f.pcap.exists() else None,
        "death": {k: v for k, v in (f.death or {}).items() if k in ("status", "exit_code", "log_tail")} or None,
        "notes": f.notes,
    }


def write_reports(campaign: Campaign, out_dir: Path, sarif: Path | None = None) -> Path:
    """``findings.json`` in ``out_dir`` (and SARIF at ``sarif``); the JSON file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = campaign.report() if isinstance(campaign, Hunt) else {
        "target": campaign.target.description, "protocol": campaign.protocol.label, "seed": campaign.options.seed,
        "examples": campaign.stats.examples, "messages": campaign.stats.messages,
        "seconds": round(campaign.stats.seconds, 1), "messages_per_second": round(campaign.stats.rate, 1),
        "restarts": campaign.stats.restarts, "classes": [finding_dict(f) for f in campaign.findings]}
    path = out_dir / "findings.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    if sarif is not None:
        sarif.parent.mkdir(parents=True, exist_ok=True)
        sarif.write_text(json.dumps(to_sarif(campaign.findings, data), indent=2) + "\n")
    return path


SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def to_sarif(findings: list[SavedFinding], summary: dict[str, Any]) -> dict[str, Any]:
    """A SARIF 2.1.0 log: one rule and one result per finding class, the reproducer pcap as the artifact."""
    rules, results, artifacts = [], [], []
    for f in findings:
        rules.append({"id": f.class_id, "name": f.kind, "shortDescription": {"text": f.line()[:200]},
                      "properties": {"kind": f.kind, "symptom": f.symptom, "command": f.command, "rule": f.rule}})
        result: dict[str, Any] = {
            "ruleId": f.class_id, "ruleIndex": len(rules) - 1,
            "level": "error" if f.kind in ("crash", "info-leak", "out-of-buffer") else "warning",
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
        "tool": {"driver": {"name": "ggml-rpc fuzz", "informationUri": "https://github.com/ggml-org/llama.cpp",
                            "rules": rules}},
        "results": results,
        "artifacts": artifacts,
        "properties": {k: v for k, v in summary.items() if k != "classes"},
    }
    if out_dir is not None:
        run["originalUriBaseIds"] = {"FINDINGS": {"uri": out_dir.resolve().as_uri() + "/"}}
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


# ---- helpers over transcripts ------------------------------------------------------------------------------------


def _culprit(transcript: list[Writes]) -> int | None:
    """Index of the connection that failed: the last one that sent more than its opening message."""
    busy = [i for i, c in enumerate(transcript) if sum(1 for sent, _ in c if sent) > 1]
    if busy:
        return busy[-1]
    some = [i for i, c in enumerate(transcript) if c]
    return some[-1] if some else None


def _groups(writes: Writes) -> list[Writes]:
    """Requests with their replies: each group is one client write and the server writes that follow it."""
    groups: list[Writes] = []
    for sent, raw in writes:
        if sent or not groups:
            groups.append([(sent, raw)])
        else:
            groups[-1].append((sent, raw))
    return groups


def _writes(groups: list) -> Writes:
    return [w for g in groups for w in g]


def _recv_exact(sock: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        chunk = sock.recv(min(1 << 16, n - got))
        if not chunk:
            raise ConnectionError("closed")
        got += len(chunk)


# ---- strategies aimed at the known classes (protocol.md §10, §12) ------------------------------------------------

Strategy = Callable[[Hunt, Example, RandomDraw, random.Random], None]


def _buffer(ex: Example, d: RandomDraw, size: int) -> BufferRef | None:
    return ex.alloc(ex.active(), size, 0)


def _tensor(ex: Example, buf: BufferRef, offset: int, ne: tuple[int, ...], type_id: int, tid: int) -> TensorRef:
    from ggml_rpc.spec import make_tensor, tensor_nbytes

    t = make_tensor(id=tid, type=type_id, ne=ne, buffer=buf.handle, data=buf.base + offset)
    ref = TensorRef(t, buf, tensor_nbytes(t))
    ex.scope.all_tensors.append(ref)
    return ref


def deep_chain(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GRAPH_COMPUTE of one node at the end of a src chain of 300,000+ tensors (no buffers, nothing to run)."""
    depth = rng.choice((DEEP_CHAIN, DEEP_CHAIN + 50_000))
    tensors = np.zeros(depth, dtype=TENSOR_DTYPE)
    ids = np.arange(1, depth + 1, dtype=np.uint64) + np.uint64(0x100000)
    tensors["id"] = ids
    tensors["type"] = int(GgmlType.F32)
    tensors["ne"] = (4, 1, 1, 1)
    tensors["nb"] = (4, 16, 16, 16)
    tensors["src"][1:, 0] = ids[:-1]
    msg = FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [int(ids[-1])], "tensors": tensors},
                      broken=f"deep: src chain = {depth}", tags=("deep",))
    # The model steps in the fuzzer's thread through a socketpair: 89 MB do not fit its buffers.  The graph goes to
    # the target alone, on a connection of its own that ends right after it; only the target's survival is judged.
    ex.close_current()
    conn = ex.new_ref()
    ex.prepare(conn)
    tconn = ex.tconn
    if ex.inert or tconn is None:
        return
    wire, _ = msg.encode(ex.protocol)
    tconn.timeout = max(tconn.timeout, DEEP_WAIT)
    tconn.send(wire)
    ex.record_sent(msg, wire)
    tconn.shutdown_write()
    tconn.until_closed()
    tconn.close()
    ex.models[conn].close()
    ex.current, ex.tconn = None, None
    if not h.alive():
        ex._fail("crash", f"the target died on a GRAPH_COMPUTE whose src chain is {depth:,} deep", msg)


def null_node(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GRAPH_COMPUTE naming node id 0 (a null node), with or without tensors."""
    buf = _buffer(ex, d, 256)
    tensors = []
    if buf is not None and rng.random() < 0.5:
        a = _tensor(ex, buf, 0, (4,), int(GgmlType.F32), ex.scope.new_id())
        tensors = [a.fields]
    nodes = [0] if not tensors or rng.random() < 0.5 else [int(tensors[0]["id"]), 0]
    ex.send(ex.active(), FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": nodes, "tensors": tensors},
                                     broken="id: nodes.* = 0", tags=("id",)))


def get_rows_index(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GET_ROWS (or SET_ROWS) whose row indices, written by SET_TENSOR, point past the table."""
    buf = _buffer(ex, d, 4096)
    if buf is None:
        return
    k = rng.choice((1, 2, 4))
    table = _tensor(ex, buf, 0, (4, 8), int(GgmlType.F32), ex.scope.new_id())
    rows = _tensor(ex, buf, 256, (k,), int(GgmlType.I32), ex.scope.new_id())
    out = _tensor(ex, buf, 512, (4, k), int(GgmlType.F32), ex.scope.new_id())
    conn = ex.active()
    bad = [rng.choice(BAD_ROWS) for _ in range(k)]
    fields = {"tensor": rows.fields, "offset": 0}
    if ex.protocol.cache_rule.flag_field:
        fields[ex.protocol.cache_rule.flag_field] = 0
    ex.send(conn, FuzzMessage(Command.SET_TENSOR, fields, struct.pack(f"<{k}i", *bad)))
    op = GgmlOp.GET_ROWS if rng.random() < 0.7 else GgmlOp.SET_ROWS
    node = dict(out.fields, op=int(op), flags=int(TensorFlag.COMPUTE),
                src=[table.fields["id"], rows.fields["id"]] + [0] * 8)
    if op is GgmlOp.SET_ROWS:  # dst = table with rows of src0 set: dst views the table
        node = dict(table.fields, id=ex.scope.new_id(), op=int(op), flags=int(TensorFlag.COMPUTE),
                    src=[out.fields["id"], rows.fields["id"]] + [0] * 8)
    ex.send(conn, FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [node["id"]],
                                                      "tensors": [table.fields, rows.fields, out.fields, node]},
                              broken=f"index: {op.name}.rows = {bad}", tags=("index",)))
    if not ex.inert and ex.current is conn and not ex.models[conn].closed:
        ex.send(conn, FuzzMessage(Command.GET_TENSOR, {"tensor": out.fields, "offset": 0, "size": out.nbytes},
                                  tags=("read-back",)))


def huge_claim(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """SET_TENSOR or GRAPH_COMPUTE whose size header is 2^63 or more."""
    claim = rng.choice((1 << 63, (1 << 63) + 1, (1 << 64) - 1))
    conn = ex.active()
    if rng.random() < 0.5:
        buf = _buffer(ex, d, 64)
        if buf is None:
            return
        t = _tensor(ex, buf, 0, (16,), int(GgmlType.I8), ex.scope.new_id())
        fields = {"tensor": t.fields, "offset": 0}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        msg = FuzzMessage(Command.SET_TENSOR, fields, b"", size=claim)
    else:
        msg = FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [1], "tensors": []}, size=claim)
    msg.broken, msg.tags = f"size: header claims {claim} bytes", ("size",)
    ex.send(conn, msg)


def region_edge(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A tensor command whose tensor or region sits just outside its buffer or just past the tensor's bytes."""
    size = rng.choice((64, 256, 4096))
    buf = _buffer(ex, d, size)
    if buf is None:
        return
    n = rng.choice((1, 8, 16))
    where = rng.choice(("data past end", "data before base", "offset past nbytes", "size past nbytes"))
    offset = 0 if where != "data past end" else size
    if where == "data before base":
        offset = -rng.choice((1, 64))
    t = _tensor(ex, buf, max(0, offset), (n,), int(GgmlType.I8), ex.scope.new_id())
    fields_t = dict(t.fields, data=(buf.base + offset) % (1 << 64))
    commands = [Command.GET_TENSOR, Command.SET_TENSOR, Command.MEMSET_TENSOR, Command.COPY_TENSOR,
                Command.INIT_TENSOR, Command.GET_ALLOC_SIZE, Command.GRAPH_COMPUTE]
    cmd = rng.choice(commands)
    over = 1 if where in ("offset past nbytes", "size past nbytes") else 0
    off = rng.choice((1, n)) if where == "offset past nbytes" else 0
    length = n + over - off if where != "offset past nbytes" else n
    if cmd is Command.GET_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": fields_t, "offset": off, "size": length})
    elif cmd is Command.SET_TENSOR:
        fields = {"tensor": fields_t, "offset": off}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        msg = FuzzMessage(cmd, fields, bytes(rng.randrange(256) for _ in range(length)))
    elif cmd is Command.MEMSET_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": fields_t, "offset": off, "size": length, "value": 0x41})
    elif cmd is Command.COPY_TENSOR:
        src = _tensor(ex, buf, 0, (n,), int(GgmlType.I8), ex.scope.new_id())
        pair = (src.fields, fields_t) if rng.random() < 0.5 else (fields_t, src.fields)
        msg = FuzzMessage(cmd, {"src": pair[0], "dst": pair[1]})
    elif cmd is Command.INIT_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": fields_t})
    elif cmd is Command.GET_ALLOC_SIZE:
        from ggml_rpc.spec import null_tensor

        msg = FuzzMessage(cmd, {"device": 0, "tensor": fields_t, "srcs": [null_tensor() for _ in range(10)]})
    else:
        node = dict(fields_t, op=int(GgmlOp.SCALE), flags=int(TensorFlag.COMPUTE))
        msg = FuzzMessage(cmd, {"device": 0, "nodes": [node["id"]], "tensors": [node]})
    # Named as the generic generator names the field it breaks, so that both meet in one finding class.
    if where in ("data past end", "data before base"):
        path = {Command.COPY_TENSOR: "src.data" if msg.fields.get("src") is fields_t else "dst.data",
                Command.GRAPH_COMPUTE: "tensors.0.data"}.get(cmd, "tensor.data")
        msg.broken = f"bound: {path} = {fields_t['data']:#x} ({where})"
    elif cmd is Command.SET_TENSOR and where == "size past nbytes":
        msg.broken = f"bound: data length = {length} (past the tensor's {n} bytes)"
    elif where == "offset past nbytes" and "offset" in msg.fields:
        msg.broken = f"bound: offset = {off} ({where})"
    elif "size" in msg.fields:
        msg.broken = f"bound: size = {length} ({where})"
    else:
        msg.broken = f"bound: tensor.ne = {n} ({where})"
    msg.tags = ("bound",)
    ex.send(ex.active(), msg)


def other_layout(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A SET_TENSOR in the other major's layout, sent as the bytes a mis-negotiated client would send."""
    buf = _buffer(ex, d, 256)
    if buf is None:
        return
    n = rng.choice((8, 16, 64))
    t = _tensor(ex, buf, 0, (n,), int(GgmlType.I8), ex.scope.new_id())
    data = bytes([rng.randrange(1, 256)]) + bytes(rng.randrange(256) for _ in range(n - 1))
    if ex.protocol.cache_rule.flag_field:
        # v6 layout to a v7 server: offset 0 then data; read as cache_flag 0 and an offset whose top byte is the
        # first data byte.
        flag = ex.protocol.cache_rule.flag_field
        fields = {"tensor": t.fields, flag: 0, "offset": data[0] << 56}
        msg = FuzzMessage(Command.SET_TENSOR, fields, data[1:], broken="layout: v6 SET_TENSOR to v7")
    else:
        # v7 layout to a v6 server: cache_flag 0 and offset 0 read as offset 0, the offset's top byte as data.
        msg = FuzzMessage(Command.SET_TENSOR, {"tensor": t.fields, "offset": 0}, b"\0" + data,
                          broken="layout: v7 SET_TENSOR to v6")
    msg.tags = ("layout",)
    ex.send(ex.active(), msg)


def early_close(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A reply-bearing request, then the client closes without reading its reply; the server must live on."""
    ex.close_current()
    conn = ex.new_ref()
    ex.prepare(conn)
    if ex.inert or ex.tconn is None:
        return
    cmd = rng.choice((Command.GET_ALIGNMENT, Command.GET_MAX_SIZE, Command.GET_DEVICE_MEMORY,
                      Command.DEVICE_COUNT))
    fields = {} if cmd is Command.DEVICE_COUNT else {"device": 0}
    msg = FuzzMessage(cmd, fields, broken="early-close: before the reply", tags=("early-close",))
    ex.leave_early(conn, msg)


def fresh_read(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GET_TENSOR of a buffer nobody wrote, allocated right after one filled and freed (an info leak if the server
    hands out that allocation's bytes or its allocator's pointers)."""
    size = rng.choice((256, 1024, 4096, 16384, 65536))
    conn = ex.active()
    if rng.random() < 0.7:
        old = _buffer(ex, d, size)
        if old is None:
            return
        t = _tensor(ex, old, 0, (size,), int(GgmlType.I8), ex.scope.new_id())
        fields = {"tensor": t.fields, "offset": 0}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        ex.send(conn, FuzzMessage(Command.SET_TENSOR, fields, bytes([0x5A]) * size))
        ex.send(conn, FuzzMessage(Command.FREE_BUFFER, {"remote_ptr": old.handle}))
    new = _buffer(ex, d, size)
    if new is None:
        return
    t = _tensor(ex, new, 0, (size,), int(GgmlType.I8), ex.scope.new_id())
    ex.send(conn, FuzzMessage(Command.GET_TENSOR, {"tensor": t.fields, "offset": 0, "size": size},
                              tags=("fresh-read",)))


#: (weight, strategy): how often each is picked among strategy steps.
STRATEGIES: tuple[tuple[int, Strategy], ...] = (
    (14, region_edge), (10, null_node), (10, get_rows_index), (10, huge_claim), (8, other_layout),
    (8, early_close), (12, fresh_read),
)


def strategy(rng: random.Random) -> Strategy:
    if rng.randrange(1000) < DEEP_PER_MILLE:
        return deep_chain
    total = sum(w for w, _ in STRATEGIES)
    pick = rng.randrange(total)
    for weight, fn in STRATEGIES:
        if pick < weight:
            return fn
        pick -= weight
    return STRATEGIES[-1][1]


def hunt_campaign(target: Target, options: Options, *, protocol: Protocol | None = None,
                  **hooks: Callable[..., Any]) -> Hunt:
    """A hunt against a started target; the model takes the facts the target announces (as target_campaign)."""
    from .setup import SetupError, learn_target
    from .targets import FUZZ_DEVICE_MEMORY, fuzz_config

    facts = learn_target(target.host, target.port, timeout=options.timeout, protocol=protocol)
    if facts.devices < 1:
        raise SetupError("the server reports no device")
    from dataclasses import replace

    from ggml_rpc.reference.devices import DeviceConfig

    memory = facts.memory if facts.memory is not None else FUZZ_DEVICE_MEMORY
    device = DeviceConfig(memory=memory, alignment=facts.alignment, max_size=facts.max_size)
    config = replace(fuzz_config(facts.protocol, devices=facts.devices), device=device)
    return Hunt(target, facts.protocol, config, options, devices=facts.devices, alignment=facts.alignment,
                **hooks)


def embedded_hunt(protocol: Protocol, options: Options, *, server_cls: type | None = None,
                  **hooks: Callable[..., Any]) -> Hunt:
    """A hunt against the embedded reference server (or a variant); call ``target.start()`` first."""
    from dataclasses import replace

    from ggml_rpc.reference.server import Server

    from .targets import EmbeddedFuzzTarget, fuzz_config

    config = fuzz_config(protocol)
    target = EmbeddedFuzzTarget(config, server_cls or Server, cache=False)
    return Hunt(target, protocol, config, replace(options, exact=True), alignment=config.device.alignment,
                **hooks)


__all__ = ["HUNT_STEPS", "STRATEGIES", "Hunt", "embedded_hunt", "hunt_campaign", "to_sarif", "write_reports"]
