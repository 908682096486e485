"""``KvcmWorker``: the worker side of the connector (one per vLLM worker: one per
tensor-parallel rank).  It owns the rank's data plane (kvcm's tier 0 in host memory, its
disk tier, its store client), the engine loop's half that applies copy runs
(``PlaneLoop(plane)``: the scheduler's ``ManagerLoop`` drains and reports) and the transfer
engine (:mod:`kvcm.integrations.vllm.transfer`) whose thread applies them, executes what the
scheduler planned, and reports back what finished.  It imports nothing of
vLLM (tests drive it without an engine).

vLLM's order per step (``kv_connector_model_runner_mixin``): ``handle_preemptions`` before
anything; ``start_load_kv`` before the forward when the step has synchronous loads, else
right after it; the forward; ``wait_for_save``; ``get_transfer_results``;
``get_block_ids_with_load_errors``; ``build_connector_worker_meta``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from kvcm.api import KVCacheManagerConfig
from kvcm.dataplane import DataPlane
from kvcm.engine_loop import PlaneLoop
from kvcm.integrations.vllm.handover import without_stores
from kvcm.integrations.vllm.metadata import KvcmConnectorMetadata, KvcmWorkerMetadata, RankReport
from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout, shard_config
from kvcm.integrations.vllm.stats import process_stats
from kvcm.integrations.vllm.transfer import CpuCopier, CudaCopier, TransferEngine, page_parts

logger = logging.getLogger(__name__)

PREEMPT_WAIT_S = 5.0  # handle_preemptions: saves not begun by then are cancelled (kvcm skips them)
SAME_STEP_LOAD_S = 0.5  # a step without a forward waits this long for its asynchronous loads
IDLE_WAIT_S = 0.005  # a step without a forward waits this long for a transfer to end (less spinning)
FLUSH_SAVES_S = 0.5  # a producer's step waits this long for its saves to be done (reported in the step)
# what a worker adds to vLLM's stats (blocks, hits and load errors are the scheduler's: counted
# once for every rank)
STATS_KEYS = ("loaded_bytes", "saved_bytes", "run_bytes", "saves_cancelled", "engine_errors")


class KvcmWorker:
    """One rank's worker side (module doc)."""

    def __init__(self, settings: ConnectorSettings, layout: KvLayout, rank: int = 0, world: int = 1,
                 num_blocks: int = 0, config: KVCacheManagerConfig | None = None) -> None:
        self.settings = settings
        self.layout = layout
        self.rank = rank
        self.world = world
        self.num_blocks = num_blocks
        # the manager's config as the scheduler has it (default settings.manager_config(layout,
        # rank, world)), its objects named with this rank
        base = config if config is not None else settings.manager_config(layout, rank, world)
        self.config = shard_config(base, rank)
        self.page_bytes = sum(layout.block_bytes)
        self.plane: DataPlane | None = None
        self.engine: TransferEngine | None = None
        self.meta: KvcmConnectorMetadata | None = None
        self.holds: set[str] = set()  # finished requests whose blocks vLLM keeps until we report them
        self.errors: set[int] = set()  # vLLM blocks to report as not loaded
        self.report = RankReport()
        self.stats: Counter[str] = Counter()  # since the last get_stats (vLLM's stats)
        self.last_gauges: dict[str, int] = {}
        self.shared_writes = True  # False: a consumer that does not write the shared tier (handover.Role)
        self.flush_saves = False  # True: a prefill instance reports each step's saves in that step (handover.Role)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"KvcmConnector: no KV cache tensor for layers {missing}")
        tensors = [kv_caches[n] for n in self.layout.layer_names]
        nblocks = self.num_blocks or tensors[0].shape[0]
        lay = self.layout
        groups = lay.groups or (0,) * len(tensors)
        device = tensors[0].device
        copiers = []
        for lc_groups in lay.lc_groups:  # one copier per kvcm life cycle: its page is one block of each layer
            idx = [i for i, g in enumerate(groups) if g in lc_groups]
            parts = page_parts([tensors[i] for i in idx], [lay.block_bytes[i] for i in idx], nblocks,
                               [lay.layer_names[i] for i in idx], [lc_groups.index(groups[i]) for i in idx])
            copiers.append(CudaCopier(parts, device) if device.type == "cuda" else CpuCopier(parts))
        s = self.settings
        self.plane = DataPlane(self.config, device="cpu", store=s.make_store(), shared_timeout_s=s.shared_timeout_s)
        self.engine = TransferEngine(PlaneLoop(self.plane), copiers if len(copiers) > 1 else copiers[0],
                                     self.page_bytes, fault_hook=s.fault_hook(), name=f"kvcm-transfer-r{self.rank}")

    # ------------------------------------------------------------------ the step

    def handle_preemptions(self, meta: KvcmConnectorMetadata) -> None:
        """vLLM preempted requests this step and reuses their blocks now: the saves that
        read them finish first (or, past PREEMPT_WAIT_S, those not begun are cancelled)."""
        if meta.preempted and self.engine is not None:
            t0 = time.perf_counter()
            self.engine.wait_saves(meta.preempted, PREEMPT_WAIT_S)
            self.report.counters["preempt_wait_us"] += int(1e6 * (time.perf_counter() - t0))

    def start_load_kv(self, meta: KvcmConnectorMetadata) -> None:
        """The step's copy runs, then its loads: asynchronous ones queued, synchronous ones
        done now (vLLM calls this before the forward when the step has any)."""
        self.meta = meta
        self.holds.update(meta.finished_holds)
        eng = self.engine
        if eng is None:
            raise RuntimeError("KvcmConnector: start_load_kv before register_kv_caches")
        if meta.drain_seq:
            runs, dropped = (meta.runs, 0) if self.shared_writes else without_stores(meta.runs)
            self.report.counters["shared_stores_skipped"] += dropped
            if any(len(r) for r in runs):
                eng.submit_runs(meta.drain_seq, runs)
            else:  # nothing left to run: the drain is done as it is
                self.report.drains.append((meta.drain_seq, []))
        async_loads = [x for x in meta.loads if not x.sync]
        if async_loads:
            eng.submit_loads(async_loads, eng.copier.forward_marker())
        sync = [x for x in meta.loads if x.sync]
        if sync:
            done = eng.sync_loads(sync)
            for x in sync:
                failed = done[x.load_id]
                self.report.loads[x.load_id] = failed
                self.errors.update(x.blocks[i] for i in failed)

    def wait_for_save(self, meta: KvcmConnectorMetadata) -> None:
        """Queue the step's saves (after the forward); nothing waits for them, except saves
        of sliding-window blocks vLLM frees at its next step (``meta.window_saves``: their
        requests' saves end before this step does, or vLLM could hand the blocks to another
        request whose forward overwrites them while kvcm still reads them)."""
        if meta.saves and self.engine is not None:
            self.engine.submit_saves(meta.saves, self.engine.copier.forward_marker())
            if meta.window_saves:
                t0 = time.perf_counter()
                self.engine.wait_saves(meta.window_saves, PREEMPT_WAIT_S)
                self.report.counters["window_save_wait_us"] += int(1e6 * (time.perf_counter() - t0))

    def get_transfer_results(self, finished_req_ids: set[str] | None = None) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call: held
        requests with no save left, asynchronous loads done (failed blocks included: their
        vLLM block ids go out in this pass's ``get_block_ids_with_load_errors``)."""
        eng = self.engine
        if eng is None:
            return set(), set(), set()
        if self.flush_saves and self.meta is not None and self.meta.saves:
            # a prefill instance: the step's saves (memory copies) are waited for, bounded, so
            # vLLM hears of them with this step's output and the next step writes their blocks
            # to the store — a finished prompt's hand-over does not wait for a further step
            # (one more forward, maybe a long prefill) before its store writes begin
            t0 = time.perf_counter()
            eng.flush_saves([sp.save_id for sp in self.meta.saves], FLUSH_SAVES_S)
            self.report.counters["flush_saves_wait_us"] += int(1e6 * (time.perf_counter() - t0))
        if self.meta is not None and not self.meta.forward:
            # a step without a forward has nothing else to do: its asynchronous loads are
            # waited for (bounded), so they are reported in this step and the requests run in
            # the next one (a request pays the bytes, not extra engine steps)
            loads = [x.load_id for x in self.meta.loads if not x.sync]
            if not loads or not eng.wait_loads(loads, SAME_STEP_LOAD_S):
                eng.wait_any(IDLE_WAIT_S)
        done = eng.take(asked=self.holds)
        sending = done.saves_done
        self.holds -= sending
        recving = set(done.load_reqs.values())
        failed: set[str] = set()
        for lid, blocks in done.failed_blocks.items():
            if not blocks:
                continue
            if self.layout.hybrid:
                # by request (vLLM recomputes it from its first token); vLLM also wants it in
                # finished_recving.  A block-level report kills a multi-group engine.
                failed.add(done.load_reqs[lid])
            else:
                self.errors.update(blocks)
        rep = self.report
        rep.drains += done.drains
        rep.saves.update(done.saves)
        rep.loads.update(done.loads)
        rep.counters.update(done.counters)
        self.stats.update({k: done.counters[k] for k in STATS_KEYS if done.counters.get(k)})
        if failed:
            rep.counters["failed_recving"] += len(failed)
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.errors = self.errors, set()
        self.report.counters["load_error_blocks"] += len(out)
        return out

    def build_worker_meta(self) -> KvcmWorkerMetadata | None:
        rep, self.report = self.report, RankReport()
        gauges = self.engine.gauges() if self.engine is not None else {}
        if rep.empty() and gauges == self.last_gauges:
            return None
        self.last_gauges = gauges
        rep.gauges = {**gauges, **process_stats()}
        rep.counters = Counter({k: v for k, v in rep.counters.items() if v})
        return KvcmWorkerMetadata({self.rank: rep})

    def take_stats(self) -> dict[str, int] | None:
        """This rank's counters since the last call (bytes moved, failures) and its bytes in
        flight now; None when nothing happened."""
        if not any(self.stats.values()):
            return None
        out = {k: v for k, v in self.stats.items() if v}
        if self.engine is not None:
            out["bytes_in_flight"] = self.engine.gauges()["bytes_in_flight"]
        self.stats = Counter()
        return out

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.plane is not None:
            self.plane.close()
