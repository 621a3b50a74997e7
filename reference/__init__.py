"""The reference server: the executable form of the spec, safe where upstream is not.

``running_server(proto="7", ...)`` starts one on an ephemeral loopback port for tests, the conformance harness and
benchmarks; ``ggml-rpc serve`` runs one from the command line.  Each connection is a sans-IO :class:`ServerCore`
(``core.py``) fed by ``server.py``, the package's one module with network I/O.
"""

from .config import Hooks, ServerConfig, make_config
from .core import ServerCore
from .devices import CPU_ALIGNMENT, CPU_MAX_SIZE, DEFAULT_MEMORY, DeviceConfig
from .server import RunningServer, Server, running_server, warm_up

__all__ = [
    "CPU_ALIGNMENT",
    "CPU_MAX_SIZE",
    "DEFAULT_MEMORY",
    "DeviceConfig",
    "Hooks",
    "RunningServer",
    "Server",
    "ServerConfig",
    "ServerCore",
    "make_config",
    "running_server",
    "warm_up",
]
