"""Recording a named scenario (:mod:`.scenarios`) as a pcap: the kit's client through the recording proxy, against
a fresh reference server or any other (``ggml-rpc pcap record``)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_rpc.reference import running_server
from ggml_rpc.reference.config import CodebookSource
from ggml_rpc.spec import Protocol, parse_version_option

from .proxy import ProxyStats, running_proxy
from .scenarios import SCENARIOS, Session


@dataclass
class Recording:
    scenario: str
    protocol: str
    path: str
    stats: ProxyStats
    notes: list[str] = field(default_factory=list)

    def manifest_entry(self) -> dict[str, Any]:
        sc = SCENARIOS[self.scenario]
        return {
            "file": Path(self.path).name,
            "scenario": self.scenario,
            "protocol": self.protocol,
            "server": "reference server (ggml_rpc.reference), 1 CPU device, hash cache on, empty cache directory",
            "connections": self.stats.connections,
            "requests": self.stats.requests,
            "exercises": sc.exercises,
            "observed": self.notes,
            "lint_clean": sc.lint_clean,
        }


@contextlib.contextmanager
def _reference(protocol: Protocol, codebooks: CodebookSource | None) -> Iterator[tuple[str, int]]:
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-scenario-cache-") as cache, \
            running_server(protocol, cache_dir=cache, codebooks=codebooks) as srv:
        yield srv.host, srv.port


def record(name: str, proto: str | Protocol, out: str | Path, *, server: tuple[str, int] | None = None,
           mss: int | None = None, hash_weight_bytes: int = 64 * 1024,
           codebooks: CodebookSource | None = None) -> Recording:
    """Run scenario ``name`` in version ``proto`` against ``server`` (default: a fresh reference server, whose
    executor reads the IQ codebooks from ``codebooks``) and write the traffic to ``out``."""
    sc = SCENARIOS[name]
    protocol = proto if isinstance(proto, Protocol) else parse_version_option(str(proto))
    if protocol.major not in sc.majors:
        raise ValueError(f"scenario {name} exists for protocol {', '.join(map(str, sc.majors))} only")
    with contextlib.ExitStack() as stack:
        target = server or stack.enter_context(_reference(protocol, codebooks))
        with running_proxy(target, pcap=out, mss=mss) as px:
            session = Session(px.host, px.port, protocol, hash_weight_bytes=hash_weight_bytes)
            sc.run(session)
            # The proxy finishes each connection after both sides closed; wait for the last ones.
        stats = px.stats
    return Recording(name, protocol.label, str(out), stats, session.notes)


__all__ = ["Recording", "record"]
