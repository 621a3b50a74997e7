"""What an example needs of the campaign that runs it: a narrow interface instead of the whole campaign.

Rules of this module:

1. An :class:`~.example.Example` (its reply judge and the steps that drive it too) reaches the campaign only through
   :class:`ExampleHost`; anything else of the campaign (rounds, budgets, shrinking, reports) is not its business.
2. The campaign's several reasons for sending nothing more (target gone, shrinking out of time, budget spent, stop
   asked for) reach an example as one answer, :attr:`ExampleHost.examples_inert`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ggml_rpc.conformance.harness import Target
    from ggml_rpc.reference.config import ServerConfig
    from ggml_rpc.spec import Protocol as WireProtocol

    from .findings import FuzzFinding
    from .message import FuzzMessage
    from .oracle import ModelCache


class ExampleHost(Protocol):
    """The campaign as an example sees it."""

    target: Target
    protocol: WireProtocol
    devices: int
    alignment: int
    #: Seconds a reply may take.
    timeout: float
    #: Computed results must match the model exactly (the embedded reference), not within a tolerance.
    exact: bool
    model_config: ServerConfig
    #: The model's hash cache, when the target's can be followed (None otherwise).
    model_cache: ModelCache | None
    #: The target may hold cache entries the model cannot know of.
    cache_unknown: bool
    #: The shadow-memory oracle applies after every write.
    shadow: bool

    @property
    def seed(self) -> int:
        """The campaign's seed (the model's handles and bases are drawn from it)."""
        ...

    @property
    def examples_inert(self) -> bool:
        """Steps send nothing more (the target is gone, shrinking ran out of time, the budget is spent, or a stop
        was asked for)."""
        ...

    def alive(self) -> bool:
        """Does the target still accept connections?"""
        ...

    def mark_dead(self) -> None:
        """The target may have died: look before the next example."""
        ...

    def dead_before_example(self) -> None:
        """The target was found dead before the example sent anything of its own: counted, and brought back before
        the next example (see :meth:`.Example.dead_before_this_example`)."""
        ...

    def clear_target_cache(self) -> None:
        """Empty the target's cache folder (when the fuzzer owns it), the model's staying as it is."""
        ...

    def count_message(self, msg: FuzzMessage) -> None:
        """One message sent (for the campaign's figures)."""
        ...

    def found(self, example: object, finding: FuzzFinding) -> None:
        """The example broke an invariant (called before the finding is raised)."""
        ...


__all__ = ["ExampleHost"]
