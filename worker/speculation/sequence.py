"""Speculation's view of a sequence: what it keeps on one (DraftState) and what it reads and writes of one (the
Protocols below). The engine's Sequence (worker/engine/sequence.py) is a DraftedSequence, and a test may pass any
object with these attributes: speculation/ sits below engine/, so it names what it uses instead of importing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from radixcache.worker.speculation.own_index import OwnTokenIndex


@dataclass
class DraftState:
    """What the drafter keeps on a sequence (`draft_state`), made on its first draft."""

    own: OwnTokenIndex = field(default_factory=OwnTokenIndex)
    failures: int = 0  # drafts in a row with nothing accepted
    skip: int = 0  # chances left to skip


class DraftSampling(Protocol):
    @property
    def max_tokens(self) -> int: ...

    @property
    def speculate(self) -> bool: ...  # False: the request opted out of drafts


class DraftRequest(Protocol):
    @property
    def namespace(self) -> str: ...  # drafts come from this namespace's pages only

    @property
    def sampling(self) -> DraftSampling: ...


class DraftGrammar(Protocol):
    def accepts_prefix(self, tokens: list[int]) -> int: ...  # how many of tokens its grammar allows, in order


class DraftedSequence(Protocol):
    tokens: list[int]  # prompt + generated: the sampler appends to it
    num_computed: int  # tokens whose K/V is in the sequence's pages: accepting a draft token moves it
    draft_state: DraftState | None
    draft_tokens: int  # drafted and verified so far (the request's outputs report both)
    accepted_draft_tokens: int

    @property
    def request(self) -> DraftRequest: ...

    @property
    def matcher(self) -> DraftGrammar | None: ...  # a constrained request's grammar state

    @property
    def finish_reason(self) -> object | None: ...  # set once a sampled token ends the request

    @property
    def num_generated(self) -> int: ...
