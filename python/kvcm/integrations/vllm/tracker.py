"""The scheduler's record of one vLLM request kvcm serves: :class:`RequestTracker`, with its
states explicit and its transitions as methods that check the state they leave (in the
manner of LMCache's request tracker).  The scheduler (:mod:`kvcm.integrations.vllm.scheduler`)
decides when a transition happens; the tracker holds what the request's blocks are in kvcm
and what of it is in flight, and refuses a transition its state does not allow.

Two things change over a request's life, independently:

* its **life** (:class:`Life`): ``RUNNING`` (vLLM runs it: its blocks are planned for saves
  as vLLM computes them) → ``RETIRING`` (finished or preempted: vLLM will not run it under
  this tracker again; its kvcm request closes once none of its transfers is in flight) →
  ``CLOSED`` (its kvcm request closed; what it committed stays in kvcm);
* whether it still **saves**: a tracker stops saving once (tier 0 cannot hold its blocks, a
  save failed, a roll-back it cannot resume from, or it was never admitted), and never
  starts again; what it committed stays.

Its blocks: ``[0, committed)`` are committed in kvcm (matched, or saved and confirmed),
``[committed, planned)`` have saves in flight or confirmed out of order (``confirmed``);
``epoch`` counts the times saves in flight stopped counting (a roll-back, a taint): a save
report of an older epoch is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Life(Enum):
    RUNNING = "running"
    RETIRING = "retiring"
    CLOSED = "closed"


class TrackerStateError(RuntimeError):
    """A transition the tracker's state does not allow (a bug of the scheduler)."""


@dataclass(eq=False)
class RequestTracker:
    """One vLLM request as kvcm serves it (module doc).  ``kv``: its kvcm cache (None when it
    was never admitted, and once closed)."""

    rid: str
    request: Any  # vLLM's Request (its all_token_ids grow as it decodes)
    kv: Any
    serial: int
    committed: int = 0  # blocks [0, committed) are committed in kvcm (matched or saved and confirmed)
    planned: int = 0  # blocks [0, planned): committed, or a save of them is in flight
    confirmed: set[int] = field(default_factory=set)  # blocks >= committed whose save is confirmed
    epoch: int = 0  # bumped when in-flight saves stop counting (a roll-back, a taint)
    loads: set[int] = field(default_factory=set)  # load ids in flight
    saves: dict[int, int] = field(default_factory=dict)  # save id in flight -> its epoch
    drain_dep: int = 0  # the drain its creation onboarded into (settled before it closes)
    tables: list[list[int]] = field(default_factory=list)  # vLLM's blocks of the request per KV cache
    # group (last seen; 0: vLLM's null block, e.g. outside a sliding window)
    held: bool = False  # request_finished answered True
    load_failed: bool = False  # a load of it failed (hybrid: reported by request)
    junction: int = 0  # sliding windows: a shared prefix's end (blocks) whose window is saved
    tail: int = 0  # partial_tail: the tokens its trailing partial block's save in flight covers
    life: Life = Life.RUNNING
    saving: bool = True

    def __post_init__(self) -> None:
        if self.kv is None:
            self.saving = False  # never admitted: nothing of it is saved

    # ------------------------------------------------------------------ reading the state

    @property
    def stopped(self) -> bool:
        """No more saves (what is committed stays)."""
        return not self.saving

    @property
    def retiring(self) -> bool:
        """Finished or preempted (closing, or closed)."""
        return self.life is not Life.RUNNING

    @property
    def block_ids(self) -> list[int]:
        """vLLM's blocks of the first KV cache group (the only one without the hybrid manager)."""
        return self.tables[0] if self.tables else []

    def idle(self, settled: int) -> bool:
        """None of its transfers is in flight (loads, saves, the drain that onboarded its
        pages: drains up to ``settled`` are settled)."""
        return not self.loads and not self.saves and self.drain_dep <= settled

    # ------------------------------------------------------------------ transitions

    def stop(self) -> bool:
        """Stop saving (any life but CLOSED); True the first time."""
        if self.life is Life.CLOSED:
            raise TrackerStateError(f"request {self.rid}: stop() after close")
        first, self.saving = self.saving, False
        return first

    def retire(self) -> None:
        """RUNNING → RETIRING: vLLM finished or preempted it."""
        if self.life is not Life.RUNNING:
            raise TrackerStateError(f"request {self.rid}: retire() while {self.life.value}")
        self.life = Life.RETIRING

    def close(self) -> Any:
        """RETIRING → CLOSED (once idle, or at shutdown); returns the kvcm cache to release
        (None: none was open)."""
        if self.life is Life.CLOSED:
            raise TrackerStateError(f"request {self.rid}: close() twice")
        kv, self.kv = self.kv, None
        self.life = Life.CLOSED
        return kv

    def roll_back(self, committed: int) -> None:
        """kvcm rolled its cache back to ``committed`` blocks: saves in flight stop counting
        and what follows is planned again."""
        if self.kv is None:
            raise TrackerStateError(f"request {self.rid}: roll_back() without a kvcm request")
        self.epoch += 1
        self.confirmed.clear()
        self.committed = self.planned = committed

    def taint(self, first_bad: int) -> bool:
        """vLLM's block ``first_bad`` of it held garbage when later blocks were computed:
        saves from there on stop counting and are planned again.  False: nothing of it was
        planned past that block (nothing changes)."""
        if self.planned <= max(first_bad, self.committed):
            return False
        self.epoch += 1
        self.confirmed = {k for k in self.confirmed if k < first_bad}
        self.planned = max(self.committed, min(self.planned, first_bad))
        return True

    def confirm(self, first: int, end: int) -> None:
        """Blocks ``[first, end)`` are written (their save confirmed, or nothing to write)."""
        self.confirmed.update(range(first, end))

    def commit_to(self, end: int) -> None:
        """Blocks up to ``end`` entered kvcm's tree."""
        self.confirmed -= set(range(self.committed, end))
        self.committed = end

    def plan_to(self, end: int) -> None:
        """Saves of blocks up to ``end`` are planned."""
        if not self.saving or self.life is not Life.RUNNING:
            raise TrackerStateError(f"request {self.rid}: saves planned while {self.life.value}, saving={self.saving}")
        self.planned = end


__all__ = ["Life", "RequestTracker", "TrackerStateError"]
