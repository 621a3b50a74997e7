"""What a reference server is started with: the configuration every connection's core reads, and the hooks through
which tests change a handler or inject a fault (instead of subclassing the connection)."""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ggml_rpc.spec import V7, Command, Protocol, parse_version_option

from .closing import Close
from .devices import DeviceConfig
from .graph import GraphTensor
from .resolve import Resolver, TensorHook

#: A GRAPH_COMPUTE payload larger than this is refused (upstream: whatever the allocator gives).
DEFAULT_MAX_GRAPH_BYTES = 256 << 20


class HookedConnection(typing.Protocol):
    """What a replacement handler is given: the connection's core (a :class:`~.core.ServerCore`), as far as a
    handler uses it."""

    #: The connection's tensor and device checks.
    resolve: Resolver
    #: The reference's own handlers of fixed-size commands (a replacement may call the one it replaces).
    handlers: dict[Command, Callable[[dict[str, Any]], None]]

    def reply(self, command: Command, fields: Mapping[str, Any]) -> None: ...

    def send(self, parts: list) -> None: ...


#: A replacement handler of a fixed-size command: the connection it serves and the request's decoded fields.
Handler = Callable[[HookedConnection, dict[str, Any]], None]
#: Where the IQ grid types' codebooks come from (name -> table), or None when there are none.
CodebookSource = Callable[[], "dict[str, Any] | None"]


@dataclass(frozen=True)
class Hooks:
    """Changes to the reference's behaviour, for tests and deliberately broken variants (never set by the CLI).

    Every hook is looked up once per connection, so the hot path tests a prepared value, never the class."""

    #: Replaces the handler of a fixed-size command (variable-size ones, SET_TENSOR and GRAPH_COMPUTE, cannot be).
    handlers: Mapping[Command, Handler] = field(default_factory=dict)
    #: Sees every single-command tensor as its decoded dict, before it is checked (command, role): may raise.
    tensor: TensorHook | None = None
    #: Sees every rule that closes a connection, before the connection ends (a variant may abort the process there,
    #: as upstream's assertions do).
    close: Callable[[Close], None] | None = None


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server is started with; connections share nothing else but the cache."""

    protocol: Protocol = V7
    devices: int = 1
    device: DeviceConfig = field(default_factory=DeviceConfig)
    cache_dir: str | None = None
    cache_max_bytes: int | None = None
    concurrent: bool = False
    verbose: bool = False
    max_graph_bytes: int = DEFAULT_MAX_GRAPH_BYTES
    #: Runs a rebuilt graph (None: the built-in executor, a plan ``prepare``d once per graph and run again).
    executor: Callable[[list[GraphTensor]], None] | None = None
    #: Threads numpy's BLAS may use for graph computation (upstream rpc-server's ``-t``).  One by default: on a busy
    #: machine OpenBLAS's worker threads wait for a core, and a 32,000 x 256 F32 matrix-vector product took 10-15 ms
    #: instead of 1 ms (2 cores, the client and other work running).  None leaves the process's setting alone.
    threads: int | None = 1
    #: Microseconds a connection keeps polling its socket for the next request before it blocks (0: block at once).
    #: A blocked server whose CPU went idle is woken by the client's request through an inter-processor interrupt,
    #: and so is the client by the reply: on a virtual machine each costs tens of microseconds (measured here: 10,700
    #: GET_ALIGNMENT round trips/s with client and server on two CPUs, 74,000/s on one, for upstream's C server as
    #: for the reference), more than the command itself.  Polling removes the server's half of that; it yields the CPU
    #: at every poll, so a client sharing it runs first.  Not used by concurrent servers (threads polling would
    #: contend for the interpreter lock); off by default for the same reason (a server on a thread of its client's
    #: process, as in tests); ``ggml-rpc serve``, a process of its own, turns it on.
    poll_us: int = 0
    #: 8.0.0 communicator: the address rank 0 listens on for its peer (the server's own), how long COMM_INIT waits
    #: for the peer, and whether rank 1 may connect to a host that is not a loopback address.
    comm_bind: str = "127.0.0.1"
    comm_timeout: float = 30.0
    comm_any_host: bool = False
    #: The IQ codebooks' source (the repository holds no upstream data: the caller says where they come from, e.g.
    #: ``ggml-rpc serve`` from an installed upstream peer).  None leaves the executor's current source alone.
    codebooks: CodebookSource | None = None
    hooks: Hooks = field(default_factory=Hooks)
    #: Compile (or load) the executor's kernels before listening (see :func:`.server.warm_up`), so that no client
    #: waits for a compile; off only where a first graph may be slow (a measurement of the warm-up itself).
    warm_up: bool = True


def make_config(
    proto: Protocol | str | int = "7",
    *,
    devices: int = 1,
    mem: int | None = None,
    alignment: int | None = None,
    max_size: int | None = None,
    cache_dir: str | None = None,
    cache_max_bytes: int | None = None,
    concurrent: bool = False,
    verbose: bool = False,
    max_graph_bytes: int | None = None,
    executor: Callable[[list[GraphTensor]], None] | None = None,
    threads: int | None = 1,
    codebooks: CodebookSource | None = None,
    hooks: Hooks | None = None,
    poll_us: int = 0,
    warm_up: bool = True,
) -> ServerConfig:
    """A ServerConfig from plain options (``proto``: a Protocol or a label such as ``6``, ``7``, ``7.0.1``)."""
    protocol = proto if isinstance(proto, Protocol) else parse_version_option(str(proto))
    dev = DeviceConfig()
    dev = replace(
        dev,
        memory=dev.memory if mem is None else mem,
        alignment=dev.alignment if alignment is None else alignment,
        max_size=dev.max_size if max_size is None else max_size,
    )
    config = ServerConfig(protocol=protocol, devices=devices, device=dev, cache_dir=cache_dir,
                          cache_max_bytes=cache_max_bytes, concurrent=concurrent, verbose=verbose, executor=executor,
                          threads=threads, codebooks=codebooks, hooks=hooks or Hooks(),
                          poll_us=max(0, poll_us), warm_up=warm_up)
    if max_graph_bytes is not None:
        config = replace(config, max_graph_bytes=max_graph_bytes)
    return config


__all__ = ["DEFAULT_MAX_GRAPH_BYTES", "CodebookSource", "Handler", "HookedConnection", "Hooks", "ServerConfig",
           "make_config"]
