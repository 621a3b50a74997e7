"""What the rows of one interop run share: folders, the models each peer reads, recorded pcaps, and the texts every
generation row is judged against (upstream's own server's, and its CPU-only run's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .models import ensure_models
from .peers import Peer
from .runs import UpstreamServer, completion, generated_text
from .zoo import ensure_zoo


class Workspace:
    """Folders and results shared by the rows of one run: models, recorded pcaps, CPU-only baselines."""

    def __init__(self, root: Path, pcap_dir: Path | None = None, zoo: list[str] | None = None,
                 zoo_dir: Path | None = None) -> None:
        self.root = root
        #: Zoo models (:data:`.zoo.ZOO` names) the rows run besides the standard ones, made in ``zoo_dir``.
        self.zoo = list(zoo or [])
        self.zoo_dir = zoo_dir or root / "zoo"
        self._zoo: dict[str, dict[str, Path]] = {}
        self.models_dir = root / "models"
        self.pcap_dir = pcap_dir or root / "pcaps"
        self.pcap_dir.mkdir(parents=True, exist_ok=True)
        self._models: dict[str, Path] | None = None
        self._baseline: dict[tuple[str, str], str] = {}
        self._upstream_text: dict[tuple[str, str], str] = {}
        #: CPU-only runs of upstream that did not all print the same text (peer label, model) -> the texts.
        self.baseline_disagreements: dict[tuple[str, str], list[str]] = {}
        self.recorded: dict[tuple[str, str], Path] = {}
        #: Manifest entries of every session recorded in ``pcap_dir`` (written beside them as manifest.json).
        self.manifest: list[dict[str, Any]] = []

    def record(self, pcap: Path, **entry: Any) -> None:
        self.manifest = [e for e in self.manifest if e["file"] != pcap.name]
        self.manifest.append({"file": pcap.name, "bytes": pcap.stat().st_size, **entry})

    def models(self, peer: Peer) -> dict[str, Path]:
        """The standard models, and the zoo models as ``peer``'s quantiser makes them."""
        if self._models is None:
            self._models = ensure_models(self.models_dir, peer.vocab)
        if not self.zoo:
            return self._models
        if peer.label not in self._zoo:
            self._zoo[peer.label] = ensure_zoo(self.zoo_dir, peer, self.zoo)
        return {**self._models, **self._zoo[peer.label]}

    def baseline(self, peer: Peer, model: str) -> str:
        """The same binary's CPU-only text (``-ngl 0``, no ``--rpc``): what every RPC run must print.

        Upstream's own CPU-only run is not always the same: 6.0.0's tiny-f16 printed a shorter text once in a
        loaded interop run and the full one in every run before and after.  So the baseline is what two CPU-only
        runs agree on (a third breaks a tie); runs that disagree are kept in :attr:`baseline_disagreements`."""
        key = (peer.label, model)
        if key not in self._baseline:
            texts: list[str] = []
            while len(texts) < 3:
                done = completion(peer, self.models(peer)[model], None)
                if not done.ok:
                    raise RuntimeError(f"CPU-only run failed: {done.why()}")
                texts.append(generated_text(done.stdout))
                agreed = [t for t in texts if texts.count(t) >= 2]
                if agreed:
                    self._baseline[key] = agreed[0]
                    break
            else:
                raise RuntimeError(f"three CPU-only runs of {model} printed three texts: {texts!r}")
            if len(set(texts)) > 1:
                self.baseline_disagreements[key] = texts
        return self._baseline[key]


    def upstream_text(self, peer: Peer, model: str) -> str:
        """What upstream's client prints with every layer on upstream's own server (no proxy): what a server that
        computes as upstream's must print.  Not always the CPU-only text: for the Q3_K_M zoo model upstream's own
        server and its CPU-only run print different texts (6.0.0, 7.0.0 and 8.0.0 alike)."""
        key = (peer.label, model)
        if key not in self._upstream_text:
            with UpstreamServer(peer, cache=False) as server:
                done = completion(peer, self.models(peer)[model], server.address)
            if not done.ok:
                raise RuntimeError(f"upstream client -> upstream server failed: {done.why()}")
            self._upstream_text[key] = generated_text(done.stdout)
        return self._upstream_text[key]

    def expected_text(self, peer: Peer, model: str) -> tuple[str, bool]:
        """(upstream's own RPC text, whether the CPU-only run printed the same)."""
        return self.upstream_text(peer, model), self.upstream_text(peer, model) == self.baseline(peer, model)


__all__ = ["Workspace"]
