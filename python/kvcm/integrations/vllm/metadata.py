"""What the connector's two sides tell each other once per engine step.

scheduler -> every worker: :class:`KvcmConnectorMetadata` (vLLM hands it to each worker with
the step's ``SchedulerOutput``); every worker -> the scheduler: :class:`KvcmWorkerMetadata`
(vLLM aggregates the workers' objects with :meth:`KvcmWorkerMetadata.aggregate` before the
scheduler sees them).  Both cross process boundaries (pickled): plain data only.

Nothing here imports vLLM unless it is installed: the scheduler and worker classes run, and
are tested, without an engine (the classes then derive from ``object``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvcm.api import CopyOp, CopyRun

try:  # vLLM's marker bases, when vLLM is there (the engine checks nothing else of them)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as _MetaBase
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata as _WorkerMetaBase
except ImportError:  # engine-free use: tests of KvcmScheduler / KvcmWorker, other engines
    _MetaBase = object  # type: ignore[assignment,misc]
    _WorkerMetaBase = object  # type: ignore[assignment,misc]


@dataclass
class LoadPlan:
    """Blocks of one request to copy from kvcm's tier 0 into vLLM's cache: ``slots[i]`` ->
    ``blocks[i]``.  A slot of -1 is a block kvcm promised but cannot deliver (it fails: vLLM
    recomputes it).  ``sync``: the step's forward reads the blocks (vLLM called
    ``start_load_kv`` before it); else the request waits in WAITING_FOR_REMOTE_KVS and the
    worker reports it in ``finished_recving`` once every block is in (or failed).
    ``lc``: the kvcm life cycle of the slots; a block is a vLLM block id, or a tuple of
    them (one per vLLM KV cache group of the life cycle: KvLayout.lc_groups)."""

    load_id: int
    req_id: str
    slots: list[int]
    blocks: list
    sync: bool
    lc: int = 0


@dataclass
class SavePlan:
    """Blocks of one request to copy from vLLM's cache into kvcm's tier 0: ``blocks[i]`` ->
    ``slots[i]``, after the step's forward (the blocks are full once it ran).  ``lc`` and
    the blocks as in :class:`LoadPlan`."""

    save_id: int
    req_id: str
    blocks: list
    slots: list[int]
    lc: int = 0


@dataclass
class KvcmConnectorMetadata(_MetaBase):
    """One engine step, scheduler -> workers."""

    step: int
    drain_seq: int = 0  # the step's drain of kvcm copy runs (1, 2, ...; 0: the drain was empty)
    runs: list[CopyRun] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # their saves read blocks vLLM frees now
    finished_holds: list[str] = field(default_factory=list)  # finished; vLLM keeps their blocks until
    # the worker reports them in finished_sending (every save reading them done)
    forward: bool = True  # the step runs a forward (vLLM scheduled tokens)
    window_saves: list[str] = field(default_factory=list)  # requests whose saves read sliding-window
    # blocks vLLM frees at its next step: wait_for_save waits for them


@dataclass
class RankReport:
    """What one worker (one tensor-parallel rank) finished since its last report."""

    drains: list[tuple[int, list[CopyOp]]] = field(default_factory=list)  # (drain_seq, failed ops), in order
    saves: dict[int, bool] = field(default_factory=dict)  # save_id -> every block written
    # load_id -> positions (in the plan) of the blocks that did not load
    loads: dict[int, list[int]] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)  # since the last report
    gauges: dict[str, int] = field(default_factory=dict)  # now

    def empty(self) -> bool:
        return not (self.drains or self.saves or self.loads or any(self.counters.values()))


@dataclass
class KvcmWorkerMetadata(_WorkerMetaBase):
    """One engine step, workers -> scheduler: one :class:`RankReport` per rank."""

    ranks: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: KvcmWorkerMetadata) -> KvcmWorkerMetadata:
        if not isinstance(other, KvcmWorkerMetadata):
            raise TypeError(f"KvcmWorkerMetadata.aggregate: not a KvcmWorkerMetadata: {type(other).__name__}")
        both = set(self.ranks) & set(other.ranks)
        if both:
            raise ValueError(f"KvcmWorkerMetadata.aggregate: ranks {sorted(both)} reported twice in one step")
        return KvcmWorkerMetadata({**self.ranks, **other.ranks})
