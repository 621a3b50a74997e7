"""What the fuzzer reports: a finding (crash, hang, wrong reply, out-of-buffer data, leaked memory) and its saved
reproducer.

A reproducer is a pcap of the shrunk example as the reference would have answered it (the model's replies), plus
a last connection that only says HELLO: ``ggml-rpc replay`` re-runs it, passes against a correct server and fails
against the one that produced the finding (a crash shows as a refused connection, the other kinds as a mismatch).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from ggml_rpc.conformance.sessions.pcapwrite import write_session

#: ``info-leak``: bytes the server never wrote (another allocation's, freed data, pointers) in a reply.
#: ``undefined-behaviour``: an instrumented server's sanitizer report it survived (UBSan recovers).
#: ``corruption``: after a write, a buffer holds bytes the shadow memory says it must not (:mod:`.shadow`).
KINDS = ("crash", "hang", "wrong-reply", "out-of-buffer", "info-leak", "undefined-behaviour", "corruption")


def sanitizer_symptom(symptom: str) -> bool:
    """Does the symptom come from a sanitizer's report (``ASan heap-buffer-overflow READ in f``)?"""
    return symptom.startswith(("ASan ", "UBSan ", "LSan "))
#: A ggml assertion as upstream logs it before aborting: ``…/ggml-backend.cpp:345: GGML_ASSERT(…) failed``.
_ASSERT = re.compile(r"([\w.+-]+\.(?:c|cc|cpp|h|hpp)):(\d+): GGML_ASSERT")
_SIZE_CLAIM = re.compile(r"claims (\d+) bytes")
#: An array index inside a dotted field path (``tensors.3.data``).
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def death_symptom(death: dict | None) -> str:
    """The signal (or exit) of a death, with the assertion's source location when the log names one."""
    if not death:
        return ""
    if death.get("sanitizer"):
        return str(death["sanitizer"]["symptom"])  # the instrumented build said what broke, and where
    status = str(death.get("status", ""))
    symptom = status.rsplit(" ", 1)[-1] if "signal" in status else status
    for line in reversed(death.get("log_tail") or []):
        m = _ASSERT.search(line)
        if m:
            return f"{symptom} {m.group(1)}:{m.group(2)}"
    return symptom


def flaw_class(broken: str | None) -> str:
    """A message's flaw without its drawn value: ``bound: tensors.3.data = 0x7f…`` -> ``bound: tensors.*.data``.

    Size claims are bucketed by what they do to a server (>= 2^63: no container can hold it; >= 2^32; smaller).
    """
    if not broken:
        return "valid"
    flaw, _, rest = broken.partition(":")
    rest = rest.strip()
    if flaw == "size":
        m = _SIZE_CLAIM.search(rest)
        claim = int(m.group(1)) if m else 0
        return "size: claim >= 2^63" if claim >= 1 << 63 else "size: claim >= 2^32" if claim >= 1 << 32 \
            else "size: small claim"
    if flaw == "truncation":
        return "truncation"
    if rest.startswith("command byte"):
        return f"{flaw}: command byte"
    path = _INDEX.sub("*", rest.split(" = ", 1)[0])
    return f"{flaw}: {path}"

Writes = list[tuple[bool, bytes]]


class FuzzFinding(Exception):
    """Raised inside an example when the target breaks an invariant; hypothesis then shrinks the example.  (The
    fuzzer's finding: a difference between the target and the model.  What a rule's predicate finds in one message
    is :class:`ggml_rpc.spec.rules.Finding`.)"""

    def __init__(self, kind: str, message: str, *, command: str = "", broken: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        assert kind in KINDS
        self.kind = kind
        self.message = message
        self.command = command
        self.broken = broken
        #: Exit status / log tail of the target when it died (crash, hang), taken when it was noticed.
        self.death: dict | None = None
        #: What a leak looked like (``pointers``, ``freed-data``, ``stale-bytes``), for info-leak findings; the
        #: report's class for an undefined-behaviour finding.
        self.symptom = ""
        #: The sanitizer's report a surviving instrumented server printed (undefined-behaviour findings).
        self.sanitizer: dict | None = None

    @property
    def signature(self) -> tuple[str, str, str, str]:
        """Findings with the same signature are the same bug for de-duplication: the kind, the signal (and
        assertion) or leak symptom, the command, and the message's flaw (without its drawn value). A sanitizer's
        report is a class by itself (kind, top upstream frame, command): the flaw that got there is not."""
        symptom = death_symptom(self.death) or self.symptom
        flaw = "-" if sanitizer_symptom(symptom) else flaw_class(self.broken)
        return self.kind, symptom, self.command, flaw


@dataclass
class SavedFinding:
    """A finding after shrinking, with its reproducer files."""

    kind: str
    message: str
    command: str
    broken: str | None
    messages: int
    connections: int
    pcap: Path | None = None
    summary_file: Path | None = None
    death: dict | None = None
    shrunk: bool = True
    notes: list[str] = field(default_factory=list)
    #: Deduplication key parts (see :attr:`FuzzFinding.signature`).
    symptom: str = ""
    #: The flaw's class (:func:`flaw_class`; written "rule" in findings.json and SARIF, as before).
    flaw: str = ""
    #: Seconds into the campaign of the first hit of this class.
    first_seconds: float = 0.0
    #: The reproducer was re-run against a fresh target and failed it the same way again.
    verified: bool | None = None
    #: The sanitizer's report behind the finding (a death's is in ``death``).
    sanitizer: dict | None = None

    @property
    def report(self) -> dict | None:
        """The sanitizer's report: the one that killed the server, or the one it printed and survived."""
        return (self.death or {}).get("sanitizer") or self.sanitizer

    @property
    def class_id(self) -> str:
        """One stable name for the finding class (its SARIF ``ruleId``): kind, symptom, command and flaw; for a
        sanitizer's report kind, report class and command only."""
        flaw = "-" if sanitizer_symptom(self.symptom) else self.flaw or "valid"
        parts = [self.kind, self.symptom or "-", self.command or "-", flaw]
        return "/".join(p.replace("/", "_") for p in parts)

    def line(self) -> str:
        """The one-line summary."""
        where = f" on {self.command}" if self.command else ""
        flaw = f" [{self.broken}]" if self.broken else ""
        size = f"{self.messages} message(s) in {self.connections} connection(s)"
        death = f"; target: {self.death.get('status')}" if self.death else ""
        checked = "" if self.verified is None else "; verified on a fresh target" if self.verified else \
            "; NOT verified"
        return (f"{self.kind}{where}{flaw}: {self.message} ({size}{'' if self.shrunk else ', not fully shrunk'}"
                f"{death}{checked})")


def save(finding: SavedFinding, transcript: list[Writes], out_dir: Path, number: int, *,
         early: Collection[int] = ()) -> SavedFinding:
    """Write ``finding-NNN-<kind>.pcap`` and ``.txt`` into ``out_dir`` and append the line to findings.txt
    (``early``: connections whose client leaves before its last reply, see ``write_session``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"finding-{number:03d}-{finding.kind}"
    finding.pcap = out_dir / f"{stem}.pcap"
    finding.summary_file = out_dir / f"{stem}.txt"
    kept = [(i, w) for i, w in enumerate(transcript) if w]
    write_session(finding.pcap, [w for _, w in kept], early=[n for n, (i, _) in enumerate(kept) if i in early])
    text = finding.line()
    details = [text, f"reproduce: ggml-rpc replay {finding.pcap.name} --server HOST:PORT"]
    if finding.death:
        details.append(f"target status: {finding.death.get('status')}")
        details += [f"  log: {line}" for line in finding.death.get("log_tail", [])[-10:]]
    if finding.report:
        details += [f"  sanitizer: {line}" for line in finding.report.get("report", [])[:40]]
    details += finding.notes
    finding.summary_file.write_text("\n".join(details) + "\n")
    with open(out_dir / "findings.txt", "a") as fh:
        fh.write(f"{stem}: {text}\n")
    return finding
