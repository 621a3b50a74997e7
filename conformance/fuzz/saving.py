"""Where a campaign's findings go: each class of finding kept once, its reproducer (pcap and summary) written into
the output folder with its line in ``findings.txt``, and announced.  A hypothesis round's finding is kept as the
failing connection alone when a replay of it alone still fails the target, else as the whole example."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

from ggml_rpc.spec import CONN_CAPS_SIZE, Command, Protocol, encode_reply, encode_request, hello_reply

from .findings import FuzzFinding, SavedFinding, Writes, save
from .workers import SharedFindings

#: ``replay_fails(pcap, kind)``: does re-running the reproducer ``pcap`` fail the target as a finding of ``kind``
#: did (the campaign's own judgement: it restarts and empties the target).
ReplayFails = Callable[[Path | None, str], bool]


class FindingStore:
    """A campaign's findings (a :class:`.campaign.Campaign` holds one), in the order they were kept."""

    def __init__(self, protocol: Protocol, out_dir: Path | None,
                 on_finding: Callable[[SavedFinding], None] | None = None) -> None:
        self.protocol = protocol
        self.out_dir = out_dir
        self.findings: list[SavedFinding] = []
        #: The finding classes shared with other workers of the campaign (``--workers``, ``--database``), if any.
        self.shared: SharedFindings | None = None
        self._on_finding = on_finding
        self._seen: set[tuple[str, str, str, str]] = set()

    def probe(self) -> Writes:
        """The connection every reproducer ends with: HELLO and the reference's reply (a server the reproducer
        killed refuses it, so ``ggml-rpc replay`` fails)."""
        return [(True, encode_request(self.protocol, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})),
                (False, encode_reply(self.protocol, Command.HELLO, hello_reply(self.protocol.version)))]

    def save(self, finding: FuzzFinding, transcript: list, *, shrunk: bool, replay_fails: ReplayFails,
             can_restart: bool, out_of_time: bool = False) -> SavedFinding | None:
        """Keep a hypothesis round's finding, unless one of its signature is kept already: the connection that
        failed alone when ``replay_fails`` says a replay of it alone still fails the target (only after a crash
        when the target ``can_restart`` and the run is not ``out_of_time``), else the whole example."""
        if finding.signature in self._seen:
            return None
        self._seen.add(finding.signature)
        if self.shared is not None and self.shared.known(finding.signature):
            return None  # another worker of the campaign has this class (and its reproducer)
        transcript = [conn for conn in transcript if conn]
        saved = SavedFinding(finding.kind, finding.message, finding.command, finding.broken, messages=0,
                             connections=0, death=finding.death, shrunk=shrunk)
        if self.out_dir is not None:
            probe = self.probe()
            number = len(self.findings) + 1
            # The connection that crashed the server: the last one that sent more than its opening message
            # (a connection opened after the fatal message may still have been accepted by the dying process).
            culprit = next((conn for conn in reversed(transcript) if sum(1 for c, _ in conn if c) > 1), None)
            # (Not once the time budget is spent: the replay of a crash restarts the target, seconds past it.)
            if len(transcript) > 1 and culprit is not None and (finding.kind != "crash" or can_restart) \
                    and not out_of_time:
                # Connections share nothing but the hash cache: the one that failed is usually enough.  Keep it
                # alone if a replay of it alone still fails against the target (a fresh one after a crash).
                save(saved, [culprit, probe], self.out_dir, number)
                if replay_fails(saved.pcap, finding.kind):
                    transcript = [culprit]
                    saved.notes.append("earlier connections dropped: replayed alone, the last one fails the same "
                                       "way")
                else:
                    _forget(self.out_dir, saved)
            if saved.pcap is None or not saved.pcap.exists():
                save(saved, [*transcript, probe], self.out_dir, number)
        saved.messages = sum(sum(1 for c, _ in conn if c) for conn in transcript)
        saved.connections = len(transcript)
        if saved.summary_file is not None:
            _rewrite_line(self.out_dir, saved)
        self._announce(saved, [finding.signature])
        return saved

    def keep(self, saved: SavedFinding, connections: list[Writes], *, early: Collection[int] = (),
             signatures: Iterable[Sequence[str]] = (), hits: int = 1) -> None:
        """Keep a finding already shrunk (the hunt's): its reproducer, ``connections`` then the probe, written into
        the output folder (``early``: connections whose client leaves before its last reply), then announced, and
        shared with the campaign's other workers under each of ``signatures`` with its ``hits``."""
        if self.out_dir is not None:
            save(saved, [*connections, self.probe()], self.out_dir, len(self.findings) + 1, early=early)
        self._announce(saved, signatures, hits)

    def _announce(self, saved: SavedFinding, signatures: Iterable[Sequence[str]], hits: int = 1) -> None:
        self.findings.append(saved)
        if self.shared is not None:
            for signature in signatures:
                self.shared.add(signature, saved, hits)
        if self._on_finding is not None:
            self._on_finding(saved)


def _forget(out_dir: Path, saved: SavedFinding) -> None:
    """Remove a reproducer written on trial (and its line in findings.txt)."""
    for path in (saved.pcap, saved.summary_file):
        if path is not None:
            path.unlink(missing_ok=True)
    index = out_dir / "findings.txt"
    if index.exists():
        lines = index.read_text().splitlines(keepends=True)
        index.write_text("".join(lines[:-1]))
    saved.pcap = saved.summary_file = None


def _rewrite_line(out_dir: Path | None, saved: SavedFinding) -> None:
    """The summary files carry the final message/connection counts."""
    if out_dir is None or saved.summary_file is None:
        return
    lines = saved.summary_file.read_text().splitlines()
    lines[0] = saved.line()
    lines += [n for n in saved.notes if n not in lines]
    saved.summary_file.write_text("\n".join(lines) + "\n")
    index = out_dir / "findings.txt"
    rows = index.read_text().splitlines()
    rows[-1] = f"{saved.summary_file.stem}: {saved.line()}"
    index.write_text("\n".join(rows) + "\n")


__all__ = ["FindingStore"]
