"""Campaign mode for a target that dies often (``ggml-rpc fuzz --hunt``): upstream ``rpc-server`` 6.0/7.0.

The hypothesis campaign (:mod:`.campaign`) ends a round at every finding and shrinks it by re-running examples: fine for
a server that rarely fails, hopeless for one that dies every few hundred messages.  Here every example is a seeded
program (no hypothesis), judged by the same model and invariants (:class:`.example.Example`); a finding is recorded and
the campaign goes straight on (the target is restarted, the next example starts).  Besides the generic steps, examples
run *strategies* aimed at upstream's reported bug classes and what its builds die of: deep src chains, node-id and
row-index mutations, size headers of 2^63 and more, region edges, the other major's SET_TENSOR layout, a client that
leaves before its reply, and reads of fresh buffers (info leaks).

Findings are deduplicated by class -- (kind, signal and assertion or leak symptom, command, the message's flaw) --
and the first of each class is shrunk to a minimal reproducer on a fresh target (delta debugging over the requests of
the connection that failed, each candidate replayed by ``ggml-rpc replay``'s engine), then verified by one more
run against a fresh target.  Reports: ``findings.txt`` lines, ``findings.json``, and SARIF 2.1.0.
"""


from __future__ import annotations

import random
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ggml_rpc.conformance.harness import Target
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.conformance.sessions.replay import Replayer, ReplayError, replay
from ggml_rpc.conformance.sessions.replay_captures import capture_of_writes
from ggml_rpc.reference.config import ServerConfig
from ggml_rpc.reference.server import Server
from ggml_rpc.spec import Protocol

from .campaign import Campaign, Options
from .draws import RandomDraw
from .example import Example
from .findings import FuzzFinding, SavedFinding, Writes, death_symptom, flaw_class
from .hunt_strategies import STRATEGIES, strategy
from .memory import return_free_memory
from .oracle import ModelStall, clear_directory
from .reports import finding_dict, to_sarif, write_reports
from .setup import target_campaign
from .shadow import CANARY_TAG
from .steps import burst
from .targets import EmbeddedFuzzTarget, fuzz_config
from .transcripts import culprit, flatten, request_groups

#: Steps of one example (generic steps and strategies together).
HUNT_STEPS = 24
#: Longest burst of generic steps in one step of an example.
BURST = 32
#: Out of 100 steps, how many are strategies aimed at a known class (the rest: the generic generators).
STRATEGY_PERCENT = 35
#: Connections of an early-close reproducer (each leaves before its reply, its last bytes sent with the FIN).
EARLY_ROUNDS = 3
#: Replays spent shrinking one finding at most (each on a freshly restarted target).
SHRINK_TRIALS = 40



@dataclass
class HuntStats:
    findings_seen: int = 0
    classes: int = 0
    shrink_replays: int = 0
    verified: int = 0
    unverified: int = 0
    fuzzer_errors: int = 0
    #: Hits of classes another worker of the campaign had found first.
    shared_hits: int = 0


class Hunt(Campaign):
    """Seeded examples without hypothesis; every finding recorded, the campaign goes on after each death."""

    def __init__(self, target: Target, protocol: Protocol, model_config: ServerConfig, options: Options, *,
                 devices: int = 1, alignment: int = 32, progress: Callable[[Campaign], None] | None = None,
                 on_finding: Callable[[SavedFinding], None] | None = None) -> None:
        super().__init__(target, protocol, model_config, options, devices=devices, alignment=alignment,
                         progress=progress, on_finding=on_finding)
        self.hunt = HuntStats()
        self._classes: dict[tuple, SavedFinding] = {}
        #: Every hit, per class id (the first is shrunk; the count says how often the class came back).
        self.hits: dict[str, int] = {}
        #: Src-chain depths the target outlived (see :func:`.hunt_strategies.deep_chain`).
        self.survived_deep: set[int] = set()
        #: A reference server a corruption's candidate reproducers must replay clean against (started when needed).
        self._reference_server: Server | None = None
        #: The reference server's own hash cache, when the target has one the model follows: a program that fills the
        #: cache and hits it replays clean only against a server that caches as the model did.
        self._reference_cache: tempfile.TemporaryDirectory | None = None

    # ---- the run -----------------------------------------------------------------------------------------------

    def run(self) -> list[SavedFinding]:
        warnings.simplefilter("ignore", RuntimeWarning)  # the model's executor on fuzzed numbers
        number = 0
        try:
            while not self.stop_requested:
                o = self.options
                if o.examples is not None and number >= o.examples:
                    self.stopped_because = "budget spent"
                    break
                if self.past_deadline():
                    self.stopped_because = "budget spent"
                    break
                if o.max_findings is not None and len(self.findings) >= o.max_findings:
                    self.stopped_because = f"{len(self.findings)} finding(s)"
                    break
                self._one(random.Random(o.seed * 1_000_003 + number))
                number += 1
                if self.gone:
                    self.stopped_because = f"target died: {self.gone}"
                    break
                if number % 64 == 0:
                    return_free_memory()
            else:
                self.stopped_because = "interrupted"
        finally:
            self._close_example()
            if self.model_cache is not None:
                self.model_cache.remove()
            if self._reference_server is not None:
                self._reference_server.stop()
                self._reference_server = None
            if self._reference_cache is not None:
                self._reference_cache.cleanup()
                self._reference_cache = None
        return self.findings

    def _one(self, rng: random.Random) -> None:
        ex = self.new_example()
        if ex.inert:
            return
        d = RandomDraw(rng)
        try:
            ex.prepare(ex.new_ref())
            for _ in range(self.options.steps):
                if ex.inert:
                    break
                if rng.randrange(100) < STRATEGY_PERCENT:
                    strategy(rng)(self, ex, d, rng)
                else:
                    # Seeded bursts of the generic generators carry the message rate (as in the machine).
                    burst(ex, rng, rng.randint(1, BURST))
            ex.finish()
        except FuzzFinding as finding:
            self._record(ex, finding)
        except ModelStall:
            self.hunt.fuzzer_errors += 1
        except OSError:
            # The target went away between two of the example's own checks: look again before the next one.
            self.mark_dead()
        finally:
            self._close_example()

    # ---- findings ------------------------------------------------------------------------------------------------

    def found(self, example: Example, finding: FuzzFinding) -> None:
        """Nothing to keep for hypothesis here (it would start the shrink clock that turns examples inert): the
        finding reaches :meth:`_record` as the exception it is."""

    def _record(self, ex: Example, finding: FuzzFinding) -> None:
        if self.stop_requested:
            return  # stopping: the failure may be the kit's own termination, and shrinking would outlast 2 s
        self.hunt.findings_seen += 1
        key = finding.signature
        saved = self._classes.get(key)
        if saved is not None:
            self.hits[saved.class_id] = self.hits.get(saved.class_id, 0) + 1
            return
        if self.store.shared is not None and self.store.shared.known(key):
            self.hunt.shared_hits += 1  # another worker has the class: no shrinking, verifying or saving here
            return
        at = culprit(ex.transcript)
        if at is None:
            return
        groups, msgs = request_groups(ex.transcript[at]), list(ex.sent[at])
        early = finding.broken is not None and finding.broken.startswith("early-close")
        verified: bool | None = None
        if self.target.can_restart and len(groups) == len(msgs):
            # A corruption's canary fills stay: without them a read returns the target's own fresh memory.
            pinned = {i for i, m in enumerate(msgs) if CANARY_TAG in m.tags} if finding.kind == "corruption" else set()
            kept = self._shrink(list(range(len(groups))), groups, finding, early, pinned)
            groups, msgs = [groups[i] for i in kept], [msgs[i] for i in kept]
            # Verified as the saved reproducer will be replayed: from a pcap file.
            verified = self._reproduces(groups, finding, early, from_file=True)
            # The death is the last request's that still reproduces it: a no-reply request before the one that
            # noticed the death (a GRAPH_COMPUTE before an ALLOC_BUFFER) takes the blame once shrinking shows it.
            last = msgs[-1]
            # A corruption stays blamed on its write: the last request is the read that saw it.
            if verified and finding.kind != "corruption" and (last.name, last.broken) != (finding.command,
                                                                                          finding.broken):
                finding.command, finding.broken = last.name, last.broken
                again = self._classes.get(finding.signature)
                if again is not None:
                    self._classes[key] = again
                    self.hits[again.class_id] = self.hits.get(again.class_id, 0) + 1
                    return
        saved = SavedFinding(finding.kind, finding.message, finding.command, finding.broken, messages=0,
                             connections=1, death=finding.death, shrunk=verified is not None, symptom=key[1],
                             flaw=flaw_class(finding.broken), first_seconds=round(self.stats.seconds, 2),
                             verified=verified, sanitizer=finding.sanitizer)
        self._classes[key] = self._classes[finding.signature] = saved
        self.hits[saved.class_id] = 1
        self.hunt.classes += 1
        if verified:
            self.hunt.verified += 1
        else:
            self.hunt.unverified += 1
            saved.notes.append("not verified: the reproducer did not fail a fresh target the same way"
                               if verified is False else "not verified: the target cannot be restarted")
        writes = flatten(groups)
        saved.messages = sum(1 for c, _ in writes if c)
        self.mark_dead()  # the next example checks the target (shrinking restarted it more than once)
        # A client that leaves before its reply: ``ggml-rpc replay`` leaves each connection where the client's FIN
        # does, the last request riding with it; repeated, for a platform where that cannot be arranged.  Shared
        # under the signature it was met with and, when shrinking moved the blame, the one it has now.
        rounds = EARLY_ROUNDS if early else 1
        self.store.keep(saved, [writes] * rounds, early=range(rounds) if early else (),
                        signatures=dict.fromkeys((key, finding.signature)), hits=self.hits[saved.class_id])

    def _shrink(self, order: list[int], groups: list[Writes], finding: FuzzFinding, early: bool,
                pinned: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Delta debugging over the requests after HELLO (indices into ``groups``): drop chunks, the last request
        included, while the program still fails a fresh target as the finding did; ``pinned`` requests stay. A
        candidate the reference does not replay clean is dropped at once (in this process, no restart): only the
        ones tried on a fresh target count against the budget."""
        head = order[:1] + [i for i in order[1:] if i in pinned]
        body = [i for i in order[1:] if i not in pinned]
        budget = SHRINK_TRIALS
        chunk = max(1, len(body) // 2)
        while chunk >= 1 and budget > 0 and len(body) > 1:
            i = 0
            removed = False
            while i < len(body) and budget > 0 and len(body) > 1:
                candidate = body[:i] + body[i + chunk:]
                if not candidate:
                    break
                program = [groups[k] for k in sorted(head + candidate)]
                if not self._clean(program, finding, early):
                    i += chunk
                    continue
                budget -= 1
                if self._reproduces(program, finding, early):
                    body = candidate
                    removed = True
                else:
                    i += chunk
            if not removed:
                chunk //= 2
        return sorted(head + body)

    def _reproduces(self, groups: list[Writes], finding: FuzzFinding, early: bool, *, from_file: bool = False) -> bool:
        """Does this program fail a freshly restarted target as the finding did (same class)?  ``from_file``: replayed
        from a pcap of it, as ``ggml-rpc replay`` replays a reproducer (else from the same capture in memory).

        The program must also replay clean against the reference: its recorded replies are the original example's,
        so a program that lost a request the later ones depended on (a write a read returns, a BUFFER_GET_BASE an
        address is relocated by) fails anywhere, for another reason than the finding's. (A src chain 300,000 deep
        is not worth the reference's seconds: its program is one message.)"""
        if not self._clean(groups, finding, early):
            return False
        self.hunt.shrink_replays += 1
        try:
            self.target.restart()
            self.stats.restarts += 1
        except Exception:
            return False
        self.clear_caches()  # the replay expects the cache state the example started with: empty
        if not self.alive():
            return False
        mark = self.target.sanitizer_count
        try:
            got = self._replay(groups, early, from_file=from_file, corruption=finding.kind == "corruption")
        finally:
            self._dead = True
        if finding.kind == "undefined-behaviour":
            # The fresh instrumented server must print a report of the same class again.
            return any(not r.fatal and r.symptom == finding.symptom for r in self.target.sanitizer_reports(mark))
        if finding.kind == "crash":
            if self.alive():
                return False
            return death_symptom(self.target.death_info()) == death_symptom(finding.death)
        return got == finding.kind

    def _clean(self, groups: list[Writes], finding: FuzzFinding, early: bool) -> bool:
        """Does the program replay clean against the reference (a src chain 300,000 deep is taken as it is)?"""
        if finding.broken is not None and finding.broken.startswith("deep"):
            return True
        at = self._reference()
        if self._reference_cache is not None:
            clear_directory(Path(self._reference_cache.name))  # the program expects the cache it started with: empty
        return self._replay(groups, early, at=at) == ""

    def _reference(self) -> tuple[str, int]:
        """Address of a reference server of the model's configuration in this process (started once)."""
        if self._reference_server is None:
            cache = None
            if self.model_cache is not None:
                self._reference_cache = tempfile.TemporaryDirectory(prefix="ggml-rpc-hunt-reference-cache-")
                cache = self._reference_cache.name
            self._reference_server = Server(replace(self.model_config, cache_dir=cache), "127.0.0.1", 0)
            threading.Thread(target=self._reference_server.serve_forever, daemon=True, name="hunt-reference").start()
        return "127.0.0.1", self._reference_server.port

    def _replay(self, groups: list[Writes], early: bool = False, *, from_file: bool = False, corruption: bool = False,
                at: tuple[str, int] | None = None) -> str:
        """Replay the program with ``ggml-rpc replay``'s engine (``early``: as a client that leaves before its last
        reply, EARLY_ROUNDS times) against the target (or the server ``at``); the kind of failure seen ('' if none).
        The capture is the pcap :func:`.write_session` makes of the program (``from_file``), or the same capture
        decoded in memory (what shrinking's many candidates use: writing and reading a file each is most of a
        replay's time).  ``corruption``: a read that returns other bytes than the reference's is a corruption (the
        program's reads are the oracle's)."""
        host, port = at if at is not None else (self.target.host, self.target.port)
        rounds = EARLY_ROUNDS if early else 1
        connections = [flatten(groups)] * rounds + [self.store.probe()]
        left = range(rounds) if early else ()
        try:
            if from_file:
                with tempfile.TemporaryDirectory(prefix="ggml-rpc-hunt-") as tmp:
                    pcap = Path(tmp) / "candidate.pcap"
                    write_session(pcap, connections, early=left)
                    report = replay([pcap], host, port, timeout=self.timeout)
            else:
                capture = capture_of_writes(connections, early=left)
                report = Replayer([capture], host, port, timeout=self.timeout).run()
        except ReplayError:
            return "crash"
        except Exception:
            return ""
        if report.ok:
            return ""
        kinds = {m.kind for m in report.mismatches}
        if "transport" in kinds:
            return "crash"
        if any(m.command in ("GET_TENSOR", "GET_TENSOR_2D") for m in report.mismatches):
            return "corruption" if corruption else "info-leak"
        return "wrong-reply"

    # ---- reports -------------------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Everything ``findings.json`` holds: the campaign's figures, the hunt's, and each class with its hits."""
        out = super().report()
        del out["classes"]  # listed last, with the hunt's hit counts
        return {**out, "shadow_reads": self.stats.shadow_reads, "findings_seen": self.hunt.findings_seen,
                "shrink_replays": self.hunt.shrink_replays,
                "shared_hits": self.hunt.shared_hits,
                "classes": [finding_dict(f, self.hits.get(f.class_id, 1)) for f in self.findings]}



def hunt_campaign(target: Target, options: Options, *, protocol: Protocol | None = None,
                  **hooks: Callable[..., Any]) -> Hunt:
    """A hunt against a started target; the model takes the facts the target announces (as target_campaign)."""
    return target_campaign(target, options, protocol=protocol, kind=Hunt, **hooks)


def embedded_hunt(protocol: Protocol, options: Options, *, server_cls: type | None = None,
                  **hooks: Callable[..., Any]) -> Hunt:
    """A hunt against the embedded reference server (or a variant); call ``target.start()`` first."""
    config = fuzz_config(protocol)
    target = EmbeddedFuzzTarget(config, server_cls or Server, cache=False)
    return Hunt(target, protocol, config, replace(options, exact=True), alignment=config.device.alignment,
                **hooks)



__all__ = ["HUNT_STEPS", "STRATEGIES", "Hunt", "embedded_hunt", "finding_dict", "hunt_campaign", "to_sarif",
           "write_reports"]
