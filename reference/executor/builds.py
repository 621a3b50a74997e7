"""Where the upstream builds the reference computes like differ in their arithmetic.

The reference reproduces upstream's x86-64 AVX2 CPU backend bit for bit, and that backend changes between releases:
8.0.0's build (b11739) dots Q2_0 weights with a vector kernel, where 6.0.0's and 7.0.0's run the generic C loop.
A server computes as the build of the protocol version it speaks; tools that run the executor directly get the
default (7.0.0's, the reference server's default version).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Build:
    """One upstream build's arithmetic, where it differs from another's."""

    #: Q2_0 x Q8_0 by the AVX2 kernel (eight lanes of four products per 32, a fused multiply-add by the float32
    #: product of the two fp16 scales, two accumulators taking alternate 64-weight blocks); otherwise the generic
    #: loop (an integer sum per 32, ``sumi += d1 * isum`` then ``sumf += d0 * sumi``, each fused).
    q2_0_vector: bool = False


#: The builds of the installed upstream peers (6.0.0: b10950, 7.0.0: b11434, 8.0.0: b11739; the packages are
#: ``conformance/upstream/peers.py``'s), by protocol major version (every product checked against each
#: peer's own ``ggml_vec_dot_*``, 8.0.0's through its private runtime: ``conformance/upstream/vec_dot_check.py``,
#: tests/upstream/test_vec_dot_check.py).
BUILDS: dict[int, Build] = {6: Build(), 7: Build(), 8: Build(q2_0_vector=True)}
DEFAULT_BUILD = BUILDS[7]


def build_for(major: int) -> Build:
    """The build a server speaking protocol ``major`` computes as (the newest known for a newer version)."""
    return BUILDS.get(major) or BUILDS[max(BUILDS)]
