"""``bench/bench_scale.py``: its options, the figures it computes from runs, its record and tables, the process
measurements it relies on, and (cheap) its tools step on a small capture.  Nothing here asserts a speed."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest
from ggml_rpc.bench import bench_scale
from ggml_rpc.bench.large_capture import measure
from ggml_rpc.bench.scale import measure_tools, speeds, stop
from ggml_rpc.bench.scale_report import markdown, ratio, summarise_generation, summarise_runs
from ggml_rpc.conformance.upstream.models import SCALE_MODELS
from ggml_rpc.conformance.upstream.peers import peer_for

ROOT = Path(__file__).resolve().parents[1]

LOG = """\
       load time =     120.10 ms
prompt eval time =      50.00 ms /    24 tokens (    2.08 ms per token,   480.00 tokens per second)
       eval time =     144.32 ms /    15 runs   (    9.62 ms per token,   103.94 tokens per second)
      total time =     200.00 ms /    39 tokens
"""


# ---- options ------------------------------------------------------------------------------------------------------


def test_defaults_cover_every_scale_model_with_one_value_per_size() -> None:
    args = bench_scale.parse_args([])
    assert [f"scale-{s}" for s in args.sizes] == list(SCALE_MODELS)
    assert args.rounds == [3, 3, 3] and args.n_predict == [16, 16, 16]
    assert args.steps == ["session", "tools", "generation"] and args.proto == "6"


def test_per_size_lists_are_kept_in_order() -> None:
    args = bench_scale.parse_args(["--sizes", "0.1,4", "--rounds", "3,1", "--n-predict", "16,4", "--steps",
                                   "tools", "--timeout", "60"])
    assert args.sizes == ["0.1", "4"] and args.rounds == [3, 1] and args.n_predict == [16, 4]
    assert args.steps == ["tools"] and args.timeout == 60.0


@pytest.mark.parametrize("argv", [["--sizes", "0.1,1.6", "--rounds", "1,2,3"], ["--sizes", "2"],
                                  ["--rounds", "0"], ["--rounds", "x"], ["--steps", "session,bake"],
                                  ["--proto", "8"], ["--timeout", "0"]])
def test_bad_options_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        bench_scale.parse_args(argv)
    assert stopped.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_scale_models_have_the_issue_shapes() -> None:
    assert SCALE_MODELS["scale-1.6"] | {"n_ctx_train": 0} == {
        "ftype": "F32", "n_embd": 2048, "n_layer": 6, "n_head": 16, "n_head_kv": 4, "n_ff": 5632, "n_ctx_train": 0}
    big = SCALE_MODELS["scale-4"]
    assert (big["ftype"], big["n_embd"], big["n_layer"]) == ("Q4_0", 4096, 32)


# ---- figures ------------------------------------------------------------------------------------------------------


def test_both_timing_lines_are_read() -> None:
    assert speeds(LOG) == {"prompt_tokens": 24, "prompt_tps": 480.0, "eval_tokens": 15, "eval_tps": 103.94}
    assert set(speeds("error loading model\n").values()) == {None}


def test_runs_summary_takes_the_median_of_ended_runs_and_the_highest_peak() -> None:
    runs = [{"seconds": 2.0, "peak_kib": 100, "rc": 0, "timed_out": False, "mismatches": 3},
            {"seconds": 4.0, "peak_kib": 300, "rc": 0, "timed_out": False, "mismatches": 2},
            {"seconds": 9.0, "peak_kib": 200, "rc": None, "timed_out": True, "stderr": ""},
            {"seconds": 3.0, "peak_kib": 150, "rc": 1, "timed_out": False, "mismatches": 1}]
    got = summarise_runs(runs, 6_000_000_000)
    assert got["seconds"] == 3.0 and got["min_seconds"] == 2.0
    assert got["gb_per_s"] == pytest.approx(2.0)
    assert got["peak_kib"] == 300 and got["timed_out"] == 1 and got["rcs"] == [0, 1, None]
    assert got["mismatches"] == 1  # what the last run that ended found
    assert "stderr" not in got


def test_a_command_that_always_timed_out_has_no_time() -> None:
    got = summarise_runs([{"seconds": 9.0, "peak_kib": 5, "rc": None, "timed_out": True}], 100)
    assert got["seconds"] is None and got["gb_per_s"] is None and got["timed_out"] == 1


def _gen_run(text: str, prompt: float | None, gen: float | None, rc: int | None = 0) -> dict:
    return {"rc": rc, "timed_out": rc is None, "prompt_tps": prompt, "eval_tps": gen, "text": text,
            "prompt_tokens": 24 if prompt else None, "server_peak_kib": 1000, "seconds": 1.0}


def test_generation_ratios_are_reference_over_upstream() -> None:
    got = summarise_generation({"reference": [_gen_run("a", 10.0, 1.0), _gen_run("a", 30.0, 3.0)],
                                "upstream": [_gen_run("a", 80.0, 8.0), _gen_run("a", 80.0, 8.0)]})
    assert got["ratio_prompt"] == pytest.approx(0.25) and got["ratio_eval"] == pytest.approx(0.25)
    assert got["same_text"] is True and got["reference"]["completed"] == 2


def test_a_timed_out_side_gives_no_ratio_and_no_text_verdict() -> None:
    got = summarise_generation({"reference": [_gen_run("", None, None, rc=None)],
                                "upstream": [_gen_run("b", 80.0, 8.0)]})
    assert got["reference"]["timed_out"] == 1 and got["reference"]["eval_tps"] is None
    assert got["ratio_eval"] is None and got["same_text"] is None
    assert summarise_generation({"reference": [_gen_run("a", 1.0, 1.0)],
                                 "upstream": [_gen_run("b", 1.0, 1.0)]})["same_text"] is False
    assert ratio(1.0, 0.0) is None


# ---- the record and its tables ------------------------------------------------------------------------------------


def test_record_entries_stay_in_size_order_and_are_updated_in_place(tmp_path: Path) -> None:
    peer = peer_for(6)
    record = bench_scale.new_record(peer, ["bench_scale.py"])
    assert {"schema", "command", "proto", "upstream", "machine", "sizes"} <= set(record)
    bench_scale.entry_for(record, "4")["x"] = 1
    bench_scale.entry_for(record, "0.1")
    bench_scale.entry_for(record, "4")["y"] = 2
    assert [e["size"] for e in record["sizes"]] == ["0.1", "4"] and record["sizes"][1] == {"size": "4", "x": 1,
                                                                                            "y": 2}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    assert bench_scale.load_record(path, peer, ["again"])["sizes"] == record["sizes"]
    assert bench_scale.load_record(path, peer_for(7), ["again"])["sizes"] == []  # another version: a new record


def test_the_tables_name_every_figure() -> None:
    tool = {"seconds": 1.0, "gb_per_s": 1.35, "peak_kib": 100 * 1024, "rcs": [0], "timed_out": 0}
    entry = {"size": "1.6", "rounds": 3, "n_predict": 16,
             "model": {"name": "scale-1.6", "bytes": 1_606_516_736, "shape": SCALE_MODELS["scale-1.6"]},
             "session": {"pcap_bytes": 1_350_000_000, "upstream_server_peak_kib": 2048,
                         "client": {"seconds": 12.0, "rc": 0, "timed_out": False, "why": None},
                         "proxy": {"peak_kib": 117 * 1024, "violations": 0}},
             "tools": {"decode": tool, "lint": {**tool, "violations": 0},
                       "replay": {**tool, "requests": 1234, "mismatches": 2, "worst_nmse": 0.01,
                                  "target_peak_kib": 2048 * 1024},
                       "tshark": tool},
             "generation": summarise_generation({"reference": [_gen_run("a", 10.0, 1.0)],
                                                 "upstream": [_gen_run("a", 40.0, 4.0)]}) | {"timeout": 900.0}}
    text = markdown({"sizes": [entry]})
    for expected in ("**scale-1.6**", "n_embd 2048", "capture 1.35 GB, 0 violations", "proxy 117 MiB",
                     "`ggml-rpc decode`", "0 violations", "1,234 requests, 2 mismatches, worst NMSE 1.0e-02",
                     "(target 2,048 MiB)", "tshark", "10.0 / 40.0 (ratio 0.25x)", "same text"):
        assert expected in text, expected


# ---- process measurements -----------------------------------------------------------------------------------------


def test_stop_reaps_a_child_and_reads_its_own_peak() -> None:
    code = "import sys, time; b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', " \
           "flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    rc, peak = stop(proc, timeout=10.0)
    proc.stdout.close()
    assert rc == -15 and peak >= 96 * 1024


def test_a_child_peak_is_its_own_not_its_large_parents() -> None:
    # Linux carries a process's pre-exec peak into the maxrss its parent reaps: with 256 MiB resident here, a
    # child spawned now would report at least that through ru_maxrss alone.
    ballast = bytearray(256 << 20)
    ballast[::4096] = b"x" * len(ballast[::4096])
    proc = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    rc, peak = stop(proc, timeout=10.0)
    proc.stdout.close()
    del ballast
    assert rc == -15 and 0 < peak < 128 * 1024


def test_measure_reports_a_run_past_its_limit_as_timed_out() -> None:
    got = measure([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert got["timed_out"] is True and got["rc"] is None
    assert measure([sys.executable, "-c", "pass"], timeout=30.0)["rc"] == 0


def test_the_lock_is_exclusive_while_held(tmp_path: Path) -> None:
    lock = tmp_path / "bench.lock"
    with bench_scale.locked(str(lock)), open(lock) as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving


def test_tools_step_on_a_small_capture() -> None:
    """decode, lint and replay (and tshark when installed) on a v6 fixture: every command ran and found nothing."""
    pcap = ROOT / "fixtures" / "v6-inference.pcap"
    got = measure_tools(pcap, proto="6", rounds=1, timeout=120.0, progress=lambda _line: None)
    assert {"decode", "lint", "replay"} <= set(got)
    for name in ("decode", "lint", "replay"):
        assert got[name]["rcs"] == [0], got[name]["runs"]
        assert got[name]["gb_per_s"] > 0 and got[name]["peak_kib"] > 0
    assert got["lint"]["violations"] == 0
    assert got["replay"]["mismatches"] == 0 and got["replay"]["requests"] > 0
    assert got["replay"]["target_peak_kib"] > 0


@pytest.mark.upstream
def test_one_small_size_end_to_end(upstream_peer, tmp_path: Path) -> None:
    """The whole script on the smallest model against the installed 7.0.0: a record with every step's figures."""
    out = tmp_path / "scale.json"
    rc = bench_scale.main(["--sizes", "0.1", "--rounds", "1", "--n-predict", "2", "--proto", "7", "--workdir",
                           str(tmp_path / "work"), "--models-dir", str(tmp_path / "models"), "--timeout", "300",
                           "--json", str(out)])
    assert rc == 0
    (entry,) = json.loads(out.read_text())["sizes"]
    assert entry["session"]["client"]["rc"] == 0 and entry["session"]["proxy"]["violations"] == 0
    assert entry["session"]["pcap_bytes"] > 50_000_000
    assert entry["tools"]["replay"]["mismatches"] == 0
    assert entry["generation"]["reference"]["completed"] == entry["generation"]["upstream"]["completed"] == 1
    assert entry["generation"]["same_text"] is True
    assert not (tmp_path / "work" / "v7-scale-0.1.pcap").exists()  # deleted without --keep
