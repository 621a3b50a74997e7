"""Saving a hypothesis round's finding (a mixin of :class:`.campaign.Campaign`): the failing connection alone when a
replay of it alone still fails the target, else the whole example; the reproducer pcap, its summary and the line
in ``findings.txt``."""

from __future__ import annotations

from pathlib import Path

from ggml_rpc.conformance.sessions.replay import ReplayError, replay
from ggml_rpc.spec import CONN_CAPS_SIZE, Command, Protocol, encode_reply, encode_request, hello_reply

from .findings import Finding, SavedFinding, save


class FindingSaver:
    """The saving steps; ``self`` is a :class:`.campaign.Campaign`."""

    def _replay_fails(self, pcap: Path | None, kind: str) -> bool:
        """Does ``ggml-rpc replay``'s engine, re-running ``pcap`` against the target, fail (the target dies again
        after a crash -- on a restarted target --, or its replies differ)?"""
        if pcap is None:
            return False
        try:
            if kind == "crash":
                self.target.restart()
                self.stats.restarts += 1
            self.clear_caches()  # ``replay`` models a target cache that starts empty, as the example's did
            report = replay([pcap], self.target.host, self.target.port, timeout=self.timeout)
            failed = not report.ok
        except ReplayError:
            failed = True
        except Exception:  # a reproducer that does not even replay is simply not kept
            return False
        finally:
            self._dead = True  # make the next example check (and bring back) the target
        return not self.alive() if kind == "crash" else failed


    def _record_unshrunk(self, why: str) -> None:
        if self._first_failure is None:
            return
        finding, transcript = self._first_failure
        self._first_failure = None
        saved = self._save(finding, transcript, shrunk=False)
        if saved is not None:
            saved.notes.append(f"not shrunk: {why}")

    def _save(self, finding: Finding, transcript: list, *, shrunk: bool) -> SavedFinding | None:
        if finding.signature in self._seen or self.stop_requested:
            # Stopping: the failure may be the kit's own termination (a process group's signal reaches a target
            # the kit started too), and re-verifying it would outlast the 2 s a stop may take.
            return None
        self._seen.add(finding.signature)
        if self.shared is not None and self.shared.known(finding.signature):
            return None  # another worker of the campaign has this class (and its reproducer)
        transcript = [conn for conn in transcript if conn]
        saved = SavedFinding(finding.kind, finding.message, finding.command, finding.broken, messages=0,
                             connections=0, death=finding.death, shrunk=shrunk)
        if self.options.out_dir is not None:
            probe = [(True, encode_request(self.protocol, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})),
                     (False, _hello_reply(self.protocol))]
            number = len(self.findings) + 1
            # The connection that crashed the server: the last one that sent more than its opening message
            # (a connection opened after the fatal message may still have been accepted by the dying process).
            culprit = next((conn for conn in reversed(transcript) if sum(1 for c, _ in conn if c) > 1), None)
            if len(transcript) > 1 and culprit is not None and (finding.kind != "crash" or self.target.can_restart):
                # Connections share nothing but the hash cache: the one that failed is usually enough.  Keep it
                # alone if a replay of it alone still fails against the target (a fresh one after a crash).
                save(saved, [culprit, probe], self.options.out_dir, number)
                if self._replay_fails(saved.pcap, finding.kind):
                    transcript = [culprit]
                    saved.notes.append("earlier connections dropped: replayed alone, the last one fails the same "
                                       "way")
                else:
                    _forget(self.options.out_dir, saved)
            if saved.pcap is None or not saved.pcap.exists():
                save(saved, [*transcript, probe], self.options.out_dir, number)
        saved.messages = sum(sum(1 for c, _ in conn if c) for conn in transcript)
        saved.connections = len(transcript)
        if saved.summary_file is not None:
            _rewrite_line(self.options.out_dir, saved)
        self.findings.append(saved)
        if self.shared is not None:
            self.shared.add(finding.signature, saved)
        if self._on_finding is not None:
            self._on_finding(saved)
        return saved



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



def _hello_reply(protocol: Protocol) -> bytes:
    return encode_reply(protocol, Command.HELLO, hello_reply(protocol.version))


__all__ = ["FindingSaver"]
