"""numba's cached kernels are dropped when any executor source changes, not only the kernel's own file."""

from __future__ import annotations

from pathlib import Path

from ggml_rpc.reference.executor import kernel_cache


def test_the_cache_follows_every_source_file(tmp_path: Path) -> None:
    (tmp_path / "kernels.py").write_text("x = 1\n")
    (tmp_path / "intrinsics.py").write_text("y = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def cached() -> list[str]:
        for name in ("kernels.k-10.py311.nbi", "kernels.k-10.py311.1.nbc"):
            (cache / name).touch()
        return sorted(p.name for p in cache.iterdir())

    cached()
    assert kernel_cache.refresh(tmp_path)  # no record of the sources yet: dropped
    assert not list(cache.glob("*.nb*"))
    kept = cached()
    assert not kernel_cache.refresh(tmp_path)  # same sources: kept
    assert sorted(p.name for p in cache.iterdir()) == kept
    (tmp_path / "intrinsics.py").write_text("y = 2\n")  # only the other module changed
    assert kernel_cache.refresh(tmp_path)
    assert not list(cache.glob("*.nb*"))
    assert (cache / "kernels.sources.sha256").read_text() == kernel_cache.sources_digest(tmp_path)


def test_preload_loads_what_a_former_process_compiled() -> None:
    """A kernel one process called is loaded by the next one's preload, from the cache, before any call."""
    import subprocess
    import sys

    use = ("import numpy as np; from ggml_rpc.reference.executor import fdot; "
           "fdot.tinyblas(np.ones((4, 8), np.float32), np.ones((3, 8), np.float32))")
    subprocess.run([sys.executable, "-c", use], check=True, timeout=300)
    probe = ("from ggml_rpc.reference.executor import float_kernels as fk, kernel_cache; "
             "loaded, _ = kernel_cache.preload(); "
             "print(loaded, len(fk.tinyblas.signatures), fk.tinyblas._cache_hits.total())")
    out = subprocess.run([sys.executable, "-c", probe], check=True, timeout=300, capture_output=True, text=True)
    loaded, signatures, hits = (int(v) for v in out.stdout.split())
    assert loaded >= 1 and signatures >= 1
    assert hits == signatures  # every one found in the cache, none compiled
