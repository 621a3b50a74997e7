"""The fuzzer's model and the target's hash cache: followed exactly where the fuzzer owns the cache, accepted where
it cannot know it (no false wrong-reply on SET_TENSOR_HASH either way)."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.fuzz import Options, target_campaign
from ggml_rpc.conformance.fuzz.findings import FuzzFinding
from ggml_rpc.conformance.fuzz.hunt import Hunt
from ggml_rpc.conformance.fuzz.message import FuzzMessage
from ggml_rpc.conformance.fuzz.targets import (
    CachedSpawnedTarget,
    EmbeddedFuzzTarget,
    FuzzSpawnedTarget,
    cache_unknown,
    fuzz_config,
    spawned_target,
)
from ggml_rpc.conformance.harness import ExternalTarget, SpawnedTarget
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V7, Command, GgmlType, cache_file_name, fnv1a64, make_tensor

DATA = bytes(range(256)) * 4


def test_what_the_model_can_know_of_a_target_cache():
    plain = spawned_target("rpc-server -H 127.0.0.1 -p {port}")
    assert type(plain) is FuzzSpawnedTarget and not cache_unknown(plain)
    assert plain.env["GGML_NO_BACKTRACE"]  # no gdb backtrace per death: the assertion line stays in the log tail
    cached = spawned_target("rpc-server -H 127.0.0.1 -p {port} -c")
    assert isinstance(cached, CachedSpawnedTarget) and cached.use_cache and not cache_unknown(cached)
    assert cached.cache_dir is not None and cached.cache_dir.name == "rpc"
    chosen = spawned_target("ggml-rpc serve --port {port} --cache-dir /somewhere")
    assert type(chosen) is FuzzSpawnedTarget and cache_unknown(chosen)
    assert cache_unknown(SpawnedTarget("ggml-rpc serve --port {port} --cache-dir=/somewhere"))
    assert not cache_unknown(SpawnedTarget("rpc-server -p {port}"))
    assert cache_unknown(ExternalTarget("127.0.0.1", 1))
    assert not cache_unknown(EmbeddedFuzzTarget(fuzz_config(V7)))


def _hash_request(ex, buf) -> FuzzMessage:
    t = make_tensor(id=1, type=int(GgmlType.I8), ne=(len(DATA),), buffer=buf.handle, data=buf.base)
    return FuzzMessage(Command.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": fnv1a64(DATA)})


def test_a_hit_the_model_cannot_know_of_is_accepted_and_ends_judging(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / cache_file_name(fnv1a64(DATA))).write_bytes(DATA)  # left there before the campaign
    with running_server("7", cache_dir=str(cache)) as srv:
        campaign = target_campaign(ExternalTarget(srv.host, srv.port), Options(out_dir=tmp_path / "out"))
        assert campaign.cache_unknown and campaign.model_cache is None
        ex = campaign.new_example()
        ref = ex.active()
        buf = ex.alloc(ref, 4096, 0)
        assert buf is not None
        reply = ex.send(ref, _hash_request(ex, buf))
        assert reply == b"\x00"  # the model misses (it has no cache); the target hit
        assert ex.finding is None and ex.untracked
        ex.finish()
    assert ex.finding is None


@pytest.mark.upstream
def test_the_model_follows_an_upstream_cache_across_examples_and_restarts(tmp_path):
    from ggml_rpc.conformance.upstream.peers import PEERS

    peer = PEERS["7.0.0"]
    if not peer.installed():
        pytest.skip("upstream 7.0.0 not installed: run `ggml-rpc upstream install`")
    target = spawned_target(f"{peer.rpc_server} -H 127.0.0.1 -p {{port}} -c")
    assert isinstance(target, CachedSpawnedTarget)
    target.start()
    try:
        campaign = target_campaign(target, Options(out_dir=tmp_path / "out", timeout=5))
        assert campaign.model_cache is not None and not campaign.cache_unknown
        for restart in (False, True):
            if restart:
                target.restart()  # the cache directory stays; the next example empties it, the model's too
            ex = campaign.new_example()
            ref = ex.active()
            buf = ex.alloc(ref, 4096, 0)
            assert buf is not None
            t = make_tensor(id=1, type=int(GgmlType.I8), ne=(len(DATA),), buffer=buf.handle, data=buf.base)
            assert ex.send(ref, _hash_request(ex, buf)) == b"\x00"  # both miss: the cache starts empty
            ex.send(ref, FuzzMessage(Command.SET_TENSOR, {"tensor": t, "cache_flag": 1, "offset": 0}, DATA))
            assert ex.send(ref, _hash_request(ex, buf)) == b"\x01"  # both hit: upstream saved it, the model too
            assert ex.finding is None and not ex.untracked
            ex.finish()
            assert ex.finding is None
    finally:
        target.stop()


def test_the_hunt_s_reference_caches_as_the_model_does_and_starts_each_replay_empty():
    """A reproducer that fills the cache and hits it replays clean only against a reference that caches too (else
    its hit reads as a miss there and the class is never verified); each replay starts from an empty cache."""
    config = fuzz_config(V7)
    hunt = Hunt(EmbeddedFuzzTarget(config, cache=True), V7, config, Options(), alignment=config.device.alignment)
    assert hunt.model_cache is not None
    host, port = hunt._reference()
    with RpcClient.connect(host, port, timeout=10) as c:
        buf, _ = c.alloc_buffer(0, 4096)
        t = make_tensor(id=1, type=int(GgmlType.I8), ne=(len(DATA),), buffer=buf, data=c.buffer_get_base(buf))
        assert not c.set_tensor_hash(t, 0, fnv1a64(DATA))
        c.set_tensor(t, 0, DATA, cache_flag=1)
        assert c.set_tensor_hash(t, 0, fnv1a64(DATA))
    finding = FuzzFinding("crash", "died", command="SET_TENSOR_HASH")
    assert hunt._clean([hunt.store.probe()], finding, False)  # a program of one HELLO
    with RpcClient.connect(host, port, timeout=10) as c:
        buf, _ = c.alloc_buffer(0, 4096)
        t = make_tensor(id=1, type=int(GgmlType.I8), ne=(len(DATA),), buffer=buf, data=c.buffer_get_base(buf))
        assert not c.set_tensor_hash(t, 0, fnv1a64(DATA))  # the replay before emptied it
    hunt._reference_server.stop()
    hunt._reference_cache.cleanup()


def test_a_target_dead_before_an_example_sends_anything_is_counted_not_blamed_on_it(tmp_path):
    """What killed it came earlier (a heap corrupted by an earlier example, freed when a later connection ended): no
    program of this example reproduces it, so it is no finding of its own; the next example brings the target back."""
    with running_server("7") as srv:
        campaign = target_campaign(ExternalTarget(srv.host, srv.port), Options(out_dir=tmp_path / "out"))
    ex = campaign.new_example()
    ex.active()  # its HELLO finds nothing listening
    assert ex.finding is None and ex.inert and ex.messages == 0
    assert campaign.stats.deaths_between_examples == 1 and campaign.report()["deaths_between_examples"] == 1
    ex.finish()
    campaign.new_example()  # looks at the target first: here nothing can bring it back (no --spawn)
    assert campaign.gone and "target died" in campaign.gone


def test_a_cache_file_written_late_by_the_previous_example_is_no_hit_of_the_next(tmp_path):
    """A server serving one connection at a time may still be finishing the previous example's connection (a
    SET_TENSOR without a reply, queued when that example stopped at a failure) after the next example emptied the
    cache: the file it writes then must not answer the next example's SET_TENSOR_HASH. Emptied again once the target
    has answered the example's HELLO (it has moved on by then)."""
    config = fuzz_config(V7)
    target = EmbeddedFuzzTarget(config, cache=True)
    target.start()
    try:
        campaign = target_campaign(target, Options(out_dir=tmp_path / "out", timeout=5))
        assert campaign.model_cache is not None and target.cache_dir is not None
        ex = campaign.new_example()  # empties both caches
        (target.cache_dir / cache_file_name(fnv1a64(DATA))).write_bytes(DATA)  # the late write
        ref = ex.active()  # HELLO
        buf = ex.alloc(ref, 4096, 0)
        assert buf is not None
        assert ex.send(ref, _hash_request(ex, buf)) == b"\x00"  # both miss
        assert ex.finding is None and not ex.untracked
        ex.finish()
        assert ex.finding is None
    finally:
        target.stop()
