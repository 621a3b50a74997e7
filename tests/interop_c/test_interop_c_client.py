"""PROTOCOL.md alone suffices: a client written in C from the document, with no code of the kit, gets a computed
graph from the reference server and from every installed genuine server on the first try.

``rpc_client.c`` speaks 6.0.0, 7.0.0 and 8.0.0 (with the graph uid): HELLO, GET_ALIGNMENT, ALLOC_BUFFER,
BUFFER_GET_BASE, SET_TENSOR of two F32 matrices, GRAPH_COMPUTE of one ADD node (first without the COMPUTE flag,
which every server skips, then with it), GET_TENSOR, GRAPH_RECOMPUTE, FREE_BUFFER.  That it follows only the
document is checked too: every number it uses is a ``#define`` quoting the PROTOCOL.md sentence or table row it
comes from (or marked as the client's own choice), each quote is found in the section its anchor names, and the
code outside the ``#define``s holds no other number than 0 and 1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ggml_rpc.conformance.upstream.peers import DEBIAN_BUILDS, LOOPBACK, PEERS, Peer, debian_peer
from ggml_rpc.conformance.upstream.runs import UpstreamServer, reference_server

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "rpc_client.c"
PROTOCOL_MD = HERE.parent.parent / "spec" / "PROTOCOL.md"
MAJORS = (6, 7, 8)

#: ``#define NAME VALUE /* PROTOCOL.md#anchor "quote" */`` or ``/* choice: why */``.
_DEFINE = re.compile(r"^#define\s+(\w+)\s+(\S+)\s*(/\*.*\*/)?\s*$")
_CITED = re.compile(r'/\*\s*PROTOCOL\.md#([\w-]+)\s+"(.+)"\s*\*/')
#: A number: hex or decimal digits not inside a name (a version's "6.0.0" gives 6, 0 and 0; a float's two parts).
_NUMBER = re.compile(r"(?<![A-Za-z_0-9])(?:0[xX][0-9a-fA-F]+|\d+)")


def _section(doc: str, anchor: str) -> str:
    start = doc.index(f'<a id="{anchor}"></a>')
    nxt = doc.find("<a id=", start + 1)
    return doc[start : nxt if nxt >= 0 else len(doc)]


def _defines(text: str) -> list[tuple[str, str, str]]:
    """(name, value, comment) of every #define with a value (the feature-test macro aside)."""
    out = []
    for line in text.splitlines():
        m = _DEFINE.match(line)
        if m and not m.group(1).startswith("_"):
            out.append((m.group(1), m.group(2), m.group(3) or ""))
    return out


def _numbers(text: str) -> set[int]:
    return {int(n, 0) if n.lower().startswith("0x") else int(n) for n in _NUMBER.findall(text)}


def test_every_constant_quotes_protocol_md():
    doc = PROTOCOL_MD.read_text(encoding="utf-8")
    defines = _defines(SOURCE.read_text(encoding="utf-8"))
    cited = choices = 0
    for name, value, comment in defines:
        if comment.startswith("/* choice:"):
            choices += 1
            continue
        if value.startswith("("):  # a formula of other defines (NELEM, NBYTES)
            assert not _numbers(value), f"{name}: a number outside a cited #define"
            continue
        m = _CITED.fullmatch(comment.strip())
        assert m, f"{name}: no PROTOCOL.md quote and not marked as a choice: {comment!r}"
        anchor, quote = m.groups()
        assert f'<a id="{anchor}"></a>' in doc, f"{name}: PROTOCOL.md has no #{anchor}"
        assert quote in _section(doc, anchor), f"{name}: #{anchor} does not say {quote!r}"
        assert int(value, 0) in _numbers(quote), f"{name} = {value}: not a number of {quote!r}"
        cited += 1
    # The protocol's numbers are cited; only the test's own data, uids and exit codes are choices.
    assert cited >= 60 and choices <= 12, (cited, choices)


def test_no_number_outside_the_defines():
    code = SOURCE.read_text(encoding="utf-8")
    code = re.sub(r"/\*.*?\*/", "", code, flags=re.S)  # comments
    code = re.sub(r'"(?:\\.|[^"\\])*"', '""', code)  # string literals (messages)
    body = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
    assert _numbers(body) <= {0, 1}, _numbers(body) - {0, 1}
    assert "sizeof(" not in body.replace("sizeof msg", "").replace("sizeof req", ""), "sizes come from PROTOCOL.md"


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (apt-get install gcc)")
    out = tmp_path_factory.mktemp("interop-c") / "rpc_client"
    build = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o", str(out), str(SOURCE)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return out


def _run(client: Path, address: str, major: int) -> str:
    host, port = address.rsplit(":", 1)
    done = subprocess.run([str(client), host, port, str(major)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}{done.stderr}"
    return done.stdout


def _check_output(out: str, major: int) -> None:
    lines = out.splitlines()
    assert lines[0].startswith(f"hello {major}.")
    assert "without COMPUTE, c keeps its bytes: ok" in lines
    assert "with COMPUTE, c = a + b: ok" in lines
    assert "GRAPH_RECOMPUTE after a new a: ok" in lines
    assert lines[-1] == "free_buffer: ok"


@pytest.mark.parametrize("major", MAJORS)
def test_c_client_computes_on_the_reference_server(client, major):
    with reference_server(major, None) as address:
        _check_output(_run(client, address, major), major)


@pytest.mark.upstream
@pytest.mark.parametrize("peer", [*PEERS.values(), *map(debian_peer, DEBIAN_BUILDS)], ids=lambda p: p.label)
def test_c_client_computes_on_the_genuine_server(client, peer: Peer):
    if not peer.installed():
        source = " --from debian" if peer.origin == "debian" else ""
        message = f"upstream {peer.label} not installed: run `ggml-rpc upstream install --proto {peer.major}{source}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with UpstreamServer(peer, cache=False) as server:
        assert server.address.startswith(LOOPBACK)
        out = _run(client, server.address, peer.major)
        assert server.alive(), "the genuine server died"
    _check_output(out, peer.major)
