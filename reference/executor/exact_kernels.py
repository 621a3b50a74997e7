"""The door to the compiled exact products (:mod:`.compiled`): loaded, with numba, when a product is first computed.

A process that never computes an exact product (a server that only stores tensors, a tool that decodes captures)
does not import numba.  The kernels' conventions (lane order, modes, vec_dot kinds) are :mod:`.simd_sums`'s, which
:mod:`.compiled` imports: the door is apart from them so that the two do not import each other.
"""

from __future__ import annotations

from types import ModuleType


def kernels() -> ModuleType:
    """The compiled kernels' module, imported (with numba) on first use."""
    # Lazy on purpose: a numba kernel module (see the module's docstring).
    from . import compiled

    return compiled


__all__ = ["kernels"]
