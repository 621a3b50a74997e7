"""Building a campaign: for the embedded reference server, or for any server after learning its facts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.harness import Target
from ggml_rpc.reference.devices import DeviceConfig
from ggml_rpc.reference.server import Server
from ggml_rpc.spec import HandshakeError, Protocol, ProtocolError

from .campaign import Campaign, Options
from .targets import FUZZ_DEVICE_MEMORY, EmbeddedFuzzTarget, fuzz_config

C = TypeVar("C", bound=Campaign)


class SetupError(Exception):
    """The target cannot be fuzzed (unreachable, not a ggml RPC server, a version the kit does not cover)."""


@dataclass(frozen=True)
class TargetFacts:
    """What the model needs to know about a server it judges."""

    protocol: Protocol
    devices: int
    alignment: int
    max_size: int
    #: Total memory every device announces (GET_DEVICE_MEMORY), or None when the devices disagree.
    memory: int | None = None


#: Devices asked for their memory at setup, at most (a server may claim any device count).
MEMORY_PROBE_DEVICES = 64


def learn_target(host: str, port: int, *, timeout: float = 5.0, protocol: Protocol | None = None) -> TargetFacts:
    """HELLO (version), DEVICE_COUNT, GET_ALIGNMENT and GET_MAX_SIZE of device 0, GET_DEVICE_MEMORY of each."""
    try:
        with RpcClient.connect(host, port, timeout=timeout, protocol=protocol) as c:
            if protocol is not None and c.server_version is not None and c.server_version[0] != protocol.major:
                v = ".".join(map(str, c.server_version))
                raise SetupError(f"the server announces protocol {v}, not {protocol.label} as --proto says")
            assert c.protocol is not None
            devices = c.device_count()
            alignment = c.get_alignment(0) if devices else 32
            max_size = c.get_max_size(0) if devices else 0
            totals = {c.get_device_memory(i)[1] for i in range(min(devices, MEMORY_PROBE_DEVICES))}
            memory = totals.pop() if len(totals) == 1 and devices <= MEMORY_PROBE_DEVICES else None
            return TargetFacts(c.protocol, devices, alignment, max_size, memory)
    except HandshakeError as exc:
        raise SetupError(f"{host}:{port}: {exc}") from None
    except (OSError, ConnectionClosed, ProtocolError) as exc:
        raise SetupError(f"cannot talk to {host}:{port}: {exc}") from None


def embedded_campaign(protocol: Protocol, options: Options, *, server_cls: type[Server] = Server,
                      devices: int = 1, **hooks: Callable[..., Any]) -> Campaign:
    """A campaign against a reference server (or a subclass) started here; call ``target.start()`` first."""
    config = fuzz_config(protocol, devices=devices)
    target = EmbeddedFuzzTarget(config, server_cls)
    options = replace(options, exact=True)
    return Campaign(target, protocol, config, options, devices=devices, alignment=config.device.alignment,
                    **hooks)


def target_campaign(target: Target, options: Options, *, protocol: Protocol | None = None,
                    kind: type[C] = Campaign, **hooks: Callable[..., Any]) -> C:  # type: ignore[assignment]
    """A campaign (``kind``: :class:`.campaign.Campaign` or the hunt) against a started external or spawned target;
    the model takes the facts it announces.

    The model's per-device budget is the total memory the target announces, so that a reference-like server and
    its twin grant and refuse the same allocations; when the devices disagree the fuzzer's own small budget is used
    and the example stops judging allocations once the target holds memory the model refused (see ``Example``).
    """
    facts = learn_target(target.host, target.port, timeout=options.timeout, protocol=protocol)
    if facts.devices < 1:
        raise SetupError("the server reports no device")
    memory = facts.memory if facts.memory is not None else FUZZ_DEVICE_MEMORY
    device = DeviceConfig(memory=memory, alignment=facts.alignment, max_size=facts.max_size)
    config = replace(fuzz_config(facts.protocol, devices=facts.devices), device=device)
    return kind(target, facts.protocol, config, options, devices=facts.devices, alignment=facts.alignment, **hooks)
