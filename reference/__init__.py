"""The reference server: the executable form of the spec, safe where upstream is not.

``running_server(proto="7", ...)`` starts one on an ephemeral loopback port for tests, the conformance harness and
benchmarks; ``ggml-rpc serve`` runs one from the command line.
"""

from .connection import ServerConfig
from .devices import CPU_ALIGNMENT, CPU_MAX_SIZE, DEFAULT_MEMORY, DeviceConfig
from .server import RunningServer, Server, make_config, running_server

__all__ = [
    "CPU_ALIGNMENT",
    "CPU_MAX_SIZE",
    "DEFAULT_MEMORY",
    "DeviceConfig",
    "RunningServer",
    "Server",
    "ServerConfig",
    "make_config",
    "running_server",
]
