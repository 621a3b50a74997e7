"""The kit's server and client entry points on a wheel peer's libraries (protocol 8.0.0, ``llama-cpp-py-sync``).

The wheel has no programs of upstream's, only shared libraries and cffi bindings, so the kit drives them itself::

    python -m ggml_rpc.conformance.upstream.wheel_peer serve --host 127.0.0.1 --port P [--cache-dir DIR] [--threads N]
    python -m ggml_rpc.conformance.upstream.wheel_peer generate --model M --rpc H:P[,H:P...] [--split layer|tensor]
                                                                [--prompt TEXT] [--n-predict N] [--cpu-only]

Both run under the loader :meth:`Peer.wheel_argv` names (the libraries need a newer glibc than the system's), with the
wheel's package on ``PYTHONPATH``. This module imports only the standard library and the wheel, so that nothing else
of the kit is loaded under the other C library. ``generate`` prints the prompt and the generated text on stdout, as
``llama-completion`` does, and nothing else there; the libraries log on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

#: The one host a server may bind: upstream servers of the kit never listen beyond loopback.
LOOPBACK = "127.0.0.1"

#: The generation settings every run shares, so that CPU-only and RPC texts are comparable: greedy, seeded, a
#: small context, every layer offloaded to the RPC devices when there are some. Flash attention is on for every
#: run because the tensor split needs it, and a baseline computed otherwise could differ in the last bits.
SEED = 1
N_CTX = 256
N_GPU_LAYERS = 99
FLASH_ATTN_ON = 1


def _devices(ffi: object, backend: object, names: Sequence[str]) -> object:
    handles = [backend.ggml_backend_dev_by_name(n.encode()) for n in names]  # type: ignore[attr-defined]
    if any(h == ffi.NULL for h in handles):  # type: ignore[attr-defined]
        raise SystemExit(f"wheel_peer serve: no device named {names}")
    return ffi.new("ggml_backend_dev_t[]", handles)  # type: ignore[attr-defined]


def serve(host: str, port: int, cache_dir: str | None, threads: int) -> int:
    """Serve the CPU device on ``host:port`` until killed (the library's accept loop never returns)."""
    if host != LOOPBACK:
        print(f"wheel_peer serve: refusing to bind {host}: only {LOOPBACK}", file=sys.stderr)
        return 2
    from llama_cpp_py_sync._cffi_bindings import get_backend_lib, get_ffi, get_lib, get_rpc_lib

    core = get_lib()
    core.llama_backend_init()  # registers the backends the device lookup below needs
    ffi, backend, rpc = get_ffi(), get_backend_lib(), get_rpc_lib()
    devices = _devices(ffi, backend, ["CPU"])
    cache = ffi.NULL
    if cache_dir is not None:
        # upstream's rpc-server creates its cache folder before serving; the library itself does not.
        os.makedirs(cache_dir, exist_ok=True)
        cache = ffi.new("char[]", os.fsencode(cache_dir))
    endpoint = ffi.new("char[]", f"{host}:{port}".encode())
    rpc.ggml_backend_rpc_start_server(endpoint, cache, threads, 1, devices)
    print("wheel_peer serve: the RPC server stopped", file=sys.stderr)
    return 1


def generate(model: str, rpc: Sequence[str], split: str, prompt: str, n_predict: int, threads: int) -> int:
    """One greedy generation; prints the prompt followed by the generated text."""
    from llama_cpp_py_sync import Llama

    llm = Llama(model, n_ctx=N_CTX, n_gpu_layers=N_GPU_LAYERS, seed=SEED, n_threads=threads,
                n_threads_batch=threads, flash_attn_type=FLASH_ATTN_ON,
                rpc_servers=list(rpc) if rpc else None, split_mode=split if rpc else None)
    try:
        # temperature 0 is greedy; the other samplers are set neutral so that only the logits decide.
        text = llm.generate(prompt, max_tokens=n_predict, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                            repeat_penalty=1.0, seed=SEED)
    finally:
        llm.close()
    assert isinstance(text, str)
    sys.stdout.write(prompt + text + "\n")
    sys.stdout.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wheel_peer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="an RPC server of the CPU device, on loopback only")
    s.add_argument("--host", default=LOOPBACK)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--cache-dir", default=None, help="the server's hash cache (default: none)")
    s.add_argument("--threads", type=int, default=1)
    g = sub.add_parser("generate", help="a greedy generation through RPC servers (or the CPU only)")
    g.add_argument("--model", required=True)
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--rpc", help="H:P[,H:P...]")
    where.add_argument("--cpu-only", action="store_true", help="no RPC server: the baseline text")
    g.add_argument("--split", choices=("layer", "tensor"), default="layer")
    g.add_argument("--prompt", default="Hello world")
    g.add_argument("--n-predict", type=int, default=16)
    g.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.command == "serve":
        return serve(args.host, args.port, args.cache_dir, args.threads)
    rpc = [] if args.cpu_only else [a.strip() for a in args.rpc.split(",") if a.strip()]
    return generate(args.model, rpc, args.split, args.prompt, args.n_predict, args.threads)


if __name__ == "__main__":
    sys.exit(main())
