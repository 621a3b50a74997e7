"""The pytest plugin's session: the server the ``--rpc-*`` options name, and a :class:`~.harness.Runner` on it.

Loaded by the plugin's ``rpc_runner`` fixture (:mod:`.pytest_plugin`), only in a pytest run that uses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ggml_rpc.spec import V7, Protocol, parse_version_option

from .harness import EmbeddedTarget, ExternalTarget, Runner, SpawnedTarget, Target, TargetError, parse_address
from .upstream.codebooks import tables


def target_of(config: pytest.Config) -> tuple[Target, Protocol | None]:
    """The server under test and the protocol expected of it (None: whatever it announces)."""
    proto_text = config.getoption("--rpc-proto")
    proto = None if proto_text == "auto" else parse_version_option(proto_text)
    cache = config.getoption("--rpc-cache-dir")
    cache_dir = Path(cache) if cache else None
    server = config.getoption("--rpc-server")
    spawn = config.getoption("--rpc-spawn")
    if spawn:
        target = SpawnedTarget(spawn, cache_dir=cache_dir)
        if server:
            target.host, target.port = parse_address(server)
        return target, proto
    if server:
        return ExternalTarget(*parse_address(server), cache_dir=cache_dir), proto
    # The IQ codebooks come from an installed upstream peer, as for `ggml-rpc check` (the reference holds none).
    return EmbeddedTarget(proto or V7, cache_dir, codebooks=tables), proto


def started_runner(config: pytest.Config) -> Iterator[Runner]:
    """The session's runner, started (a target that cannot start ends the pytest run, exit code 2), then stopped."""
    try:
        target, proto = target_of(config)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    runner = Runner(target, expect=proto, timeout=config.getoption("--rpc-timeout"))
    seed = config.getoption("--rpc-seed")
    if seed is not None:
        runner.seed = seed
    try:
        runner.start()
    except TargetError as exc:
        runner.stop()
        pytest.exit(f"ggml-rpc conformance: {exc}", returncode=2)
    yield runner
    runner.stop()
