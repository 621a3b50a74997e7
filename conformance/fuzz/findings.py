"""What the fuzzer reports: a finding (crash, hang, wrong reply, out-of-buffer data) and its saved reproducer.

A reproducer is a pcap of the shrunk example as the reference would have answered it (the model's replies), plus
a last connection that only says HELLO: ``ggml-rpc replay`` re-runs it, passes against a correct server and fails
against the one that produced the finding (a crash shows as a refused connection, the other kinds as a mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ggml_rpc.conformance.sessions.pcapwrite import write_session

KINDS = ("crash", "hang", "wrong-reply", "out-of-buffer")

Writes = list[tuple[bool, bytes]]


class Finding(Exception):
    """Raised inside an example when the target breaks an invariant; hypothesis then shrinks the example."""

    def __init__(self, kind: str, message: str, *, command: str = "", broken: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        assert kind in KINDS
        self.kind = kind
        self.message = message
        self.command = command
        self.broken = broken
        #: Exit status / log tail of the target when it died (crash, hang), taken when it was noticed.
        self.death: dict | None = None

    @property
    def signature(self) -> tuple[str, str]:
        """Findings with the same signature are the same bug for de-duplication."""
        return self.kind, self.command


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

    def line(self) -> str:
        """The one-line summary."""
        where = f" on {self.command}" if self.command else ""
        rule = f" [{self.broken}]" if self.broken else ""
        size = f"{self.messages} message(s) in {self.connections} connection(s)"
        death = f"; target: {self.death.get('status')}" if self.death else ""
        return f"{self.kind}{where}{rule}: {self.message} ({size}{'' if self.shrunk else ', not fully shrunk'}{death})"


def save(finding: SavedFinding, transcript: list[Writes], out_dir: Path, number: int) -> SavedFinding:
    """Write ``finding-NNN-<kind>.pcap`` and ``.txt`` into ``out_dir`` and append the line to findings.txt."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"finding-{number:03d}-{finding.kind}"
    finding.pcap = out_dir / f"{stem}.pcap"
    finding.summary_file = out_dir / f"{stem}.txt"
    write_session(finding.pcap, [w for w in transcript if w])
    text = finding.line()
    details = [text, f"reproduce: ggml-rpc replay {finding.pcap.name} --server HOST:PORT"]
    if finding.death:
        details.append(f"target status: {finding.death.get('status')}")
        details += [f"  log: {line}" for line in finding.death.get("log_tail", [])[-10:]]
    details += finding.notes
    finding.summary_file.write_text("\n".join(details) + "\n")
    with open(out_dir / "findings.txt", "a") as fh:
        fh.write(f"{stem}: {text}\n")
    return finding
