"""What ``ggml-rpc check`` writes beside its reports: a pcap of each failing (or every) check's exchange
(``--pcap-dir``, named by check ID) and the HTML report (``--html``); each result learns the paths."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from ggml_rpc.spec import DEFAULT_PORT

from .. import kit_version
from .html import write_html_report
from .model import Outcome, Result
from .runner import Runner


def wants_pcap(r: Result, every: bool) -> bool:
    """A failing check's exchange always; with ``every``, each check that sent something."""
    return r.recording is not None and not r.recording.empty and (every or r.outcome in (Outcome.FAIL,
                                                                                          Outcome.ERROR))


def write_pcaps(results: list[Result], directory: str | Path, *, every: bool = False) -> int:
    """One pcap per chosen check, ``<ID>.pcap`` in ``directory``; the number written.

    The server's port is written as the protocol's default (:data:`DEFAULT_PORT`), so that the kit's dissector
    and Wireshark decode the file without being told the port the run happened to use.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for r in results:
        if wants_pcap(r, every):
            for conn in r.recording.connections:
                conn.server = (conn.server[0], DEFAULT_PORT)
            r.pcap = str(r.recording.write_pcap(out / f"{r.check.id}.pcap"))
            n += 1
    return n


def write_html(runner: Runner, directory: str | Path, strict: bool = False) -> Path:
    info = runner.info
    started = datetime.fromtimestamp(runner.started_at or 0, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    server = [("target", runner.target.description), ("address", runner.target.address),
              ("announced version", info.version_label), ("protocol", info.verdict), ("date", started),
              ("kit version", kit_version()), ("seed", str(runner.seed))]
    return write_html_report(directory, runner.results, server, info.protocol, runner.summary(),
                             verdict=runner.verdict(strict))
