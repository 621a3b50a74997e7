"""The verified reproducers behind SECURITY.md (``fixtures/repro/security/``): each hunt's classes that no report
explains (``hunt-<build>/``: 7.0.0, both 8.0.0 builds, the instrumented 7.0.0), whose replies are the hunt model's,
so each replays clean against the reference server of its version and leaves it serving; and the failing checks'
exchanges kept by ``ggml-rpc upstream security`` (``<peer>-<check>.pcap``), recorded against upstream: each decodes
in its version's layouts up to its bad input (the reference may refuse where upstream computed, and a refusal passes
those checks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.replay import replay
from ggml_rpc.reference import running_server
from ggml_rpc.spec import parse_version_option

SECURITY = Path(__file__).resolve().parents[2] / "fixtures" / "repro" / "security"
#: Reproducers the replay engine does not yet replay as the hunt's model answered them (open, see CHANGELOG):
#: strict, so that a fix shows.
NOT_YET = {
    "hunt-7.0.0+asan-ubsan/finding-002-info-leak.pcap":
        "the reference's GET_TENSOR of the region differs from the hunt model's after relocation (189 of 576 bytes)",
    "hunt-7.0.0+asan-ubsan/finding-008-crash.pcap":
        "a SET_TENSOR whose data address is 0xfffffffffffffffe: the reference closes where the hunt model answered",
}


def _param(path: Path) -> Path | object:
    why = NOT_YET.get(path.relative_to(SECURITY).as_posix())
    return pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=why)) if why else path


PCAPS = [_param(p) for p in sorted(SECURITY.glob("hunt-*/*.pcap"))]
CHECK_PCAPS = sorted(SECURITY.glob("*.pcap"))


def major(path: Path) -> str:
    """The protocol major a reproducer was found on: its folder's or its name's leading version."""
    m = re.match(r"(?:hunt-)?(\d+)\.\d+\.\d+", path.parent.name if path.parent != SECURITY else path.name)
    assert m, path
    return m.group(1)


def test_there_are_reproducers_and_each_is_small() -> None:
    pcaps = sorted(SECURITY.rglob("*.pcap"))
    assert len(pcaps) >= 10 and len(NOT_YET) * 10 < len(pcaps)
    assert all(p.stat().st_size <= 1 << 20 for p in pcaps)


@pytest.mark.parametrize("pcap", CHECK_PCAPS, ids=lambda p: p.name)
def test_check_exchanges_decode_in_their_versions_layouts(pcap: Path) -> None:
    decoded = decode_file(pcap, parse_version_option(major(pcap)))
    # Each connection opens with the version's HELLO; what follows is the check's bad input (a decode error in
    # the request direction is the point of many of them).
    assert decoded and all(dc.requests and dc.requests[0].command.name == "HELLO" for dc in decoded), pcap.name


@pytest.mark.parametrize("pcap", PCAPS, ids=lambda p: str(p.relative_to(SECURITY)) if isinstance(p, Path) else "")
def test_replays_clean_against_the_reference(pcap: Path) -> None:
    with running_server(major(pcap)) as srv:
        report = replay([pcap], srv.host, srv.port, timeout=10)
        assert report.ok, [m.line() for m in report.mismatches]
        with RpcClient.connect(srv.host, srv.port, timeout=5) as c:
            assert c.device_count() >= 1
