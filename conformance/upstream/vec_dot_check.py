"""The executor's one-token products against an upstream build's own ``ggml_vec_dot_*``, type by type.

Each type's weights are quantised by the build's own ``from_float`` (random rows of several scales and lengths),
dotted with a random activation row by the build's ``vec_dot`` and by the executor computing as
:func:`~ggml_rpc.reference.executor.builds.build_for` says that version's build does; every output is compared bit
for bit.  A wheel peer's libraries need a newer C library than the system's: :func:`check_peer` runs this module
under the peer's private loader (``python -m ggml_rpc.conformance.upstream.vec_dot_check LIB_DIR --major N``)::

    python -m ggml_rpc.conformance.upstream.vec_dot_check BIN_DIR --major 7 [--types Q2_0,Q4_0] [--base NAME]
        [--cpu NAME]

prints one JSON object: per type name, [outputs that differ, outputs compared].  Exit code 0 when none differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from ggml_rpc.reference.executor import kdot, lowbit_dot, q8dot
from ggml_rpc.reference.executor.builds import build_for
from ggml_rpc.spec import TYPES

from .ggml_lib import BASE_LIBRARY, CPU_LIBRARY, GgmlLibrary
from .peers import RUNTIME_LIBDIR, Peer, libpython_dir, loader_argv, python_program

F = np.float32
_ROWS = 16
_LENGTHS = (256, 512, 4096)


def checked_types() -> dict[str, int]:
    """The types whose one-token product the executor computes in upstream's order from blocks ``from_float``
    makes (the grid types need an importance matrix to quantise: their kernels are checked by the tests)."""
    ids = [*q8dot.EXACT_TYPES, *lowbit_dot.LOWBIT_TYPES, *(t for t in kdot.K_TYPES if t not in kdot.GRID_FACTORS)]
    return {TYPES[t].name: t for t in sorted(ids)}


def _product(type_id: int, blocks: np.ndarray, x: np.ndarray, major: int) -> np.ndarray:
    if type_id in lowbit_dot.LOWBIT_TYPES:
        packed = lowbit_dot.pack_weights(type_id, blocks)
        return lowbit_dot.products(type_id, packed, x, vector=build_for(major).q2_0_vector)[0]
    if type_id in q8dot.EXACT_TYPES:
        return q8dot.products(type_id, q8dot.pack_weights(type_id, blocks), x, len(blocks), batch=False)[0]
    return kdot.products(type_id, kdot.pack_weights(type_id, blocks), x, len(blocks))[0]


def compare(lib: GgmlLibrary, type_id: int, major: int, seed: int = 0) -> tuple[int, int]:
    """(outputs that differ, outputs compared) for ``type_id`` between the build and the executor."""
    rng = np.random.default_rng(seed + type_id)
    vt = lib.vec_dot_type(type_id)
    info = TYPES[type_id]
    differ = compared = 0
    for k in _LENGTHS:
        w = (rng.standard_normal((_ROWS, k)) * rng.choice([0.02, 1.0, 30.0])).astype(F)
        blocks = np.asarray(lib.from_float(type_id, w), dtype=np.uint8).reshape(_ROWS, k // info.blck, info.size)
        x = (rng.standard_normal((1, k)) * rng.choice([0.01, 1.0, 50.0])).astype(F)
        act = lib.from_float(vt, x)
        want = np.array([lib.vec_dot(type_id, blocks[i], act) for i in range(_ROWS)], dtype=F)
        got = _product(type_id, blocks, x, major)
        differ += int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32)))
        compared += _ROWS
    return differ, compared


def check_peer(peer: Peer, types: list[str] | None = None, timeout: float = 600.0,
               major: int | None = None) -> dict[str, list[int]]:
    """This module's result for an installed ``peer`` (a wheel peer through its private loader), the executor
    computing as the build of ``major`` (default: the peer's own version) does."""
    args = ["--major", str(major or peer.major), *(["--types", ",".join(types)] if types else [])]
    if peer.kind == "wheel":
        lib_dir = peer.wheel_dir
        args += ["--base", BASE_LIBRARY + ".0", "--cpu", CPU_LIBRARY + ".0"]
        library_path = [peer.runtime_dir / RUNTIME_LIBDIR, peer.wheel_dir, libpython_dir() or ""]
        argv = loader_argv(peer.loader, library_path, python_program(), __name__, [str(lib_dir), *args])
    else:
        argv = [sys.executable, "-m", __name__, str(peer.test_backend_ops.parent), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"vec_dot check of {peer.version} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ggml_rpc.conformance.upstream.vec_dot_check",
                                     description="The executor's products against a build's ggml_vec_dot_*.")
    parser.add_argument("lib_dir", type=Path, help="the folder holding the build's libggml-base and libggml-cpu")
    parser.add_argument("--major", type=int, required=True, help="the protocol major version the build speaks")
    parser.add_argument("--types", help="comma-separated type names (default: every one checked)")
    parser.add_argument("--base", default=BASE_LIBRARY, help=f"base library's file name (default {BASE_LIBRARY})")
    parser.add_argument("--cpu", default=CPU_LIBRARY, help=f"CPU library's file name (default {CPU_LIBRARY})")
    args = parser.parse_args(argv)
    known = checked_types()
    names = args.types.split(",") if args.types else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown or unchecked type {unknown[0]!r} (choose from {', '.join(known)})")
    try:
        lib = GgmlLibrary(args.lib_dir, base=args.base, cpu=args.cpu)
    except OSError as exc:
        print(f"cannot load the build's libraries from {args.lib_dir}: {exc}", file=sys.stderr)
        return 2
    result = {name: list(compare(lib, known[name], args.major)) for name in names}
    print(json.dumps(result))
    return 1 if any(d for d, _ in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
