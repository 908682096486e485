"""``KvcmConnector``: kvcm's tiers (host, disk, shared) behind vLLM's ``KVConnectorBase_V1``.

A thin facade, as vLLM's own connectors are built: in the scheduler process it holds a
:class:`~kvcm.integrations.vllm.scheduler.KvcmScheduler` (kvcm's manager, one mirror per
request, planning), in each worker a :class:`~kvcm.integrations.vllm.worker.KvcmWorker`
(the rank's data plane and transfer engine); every vLLM hook goes to the one that exists.
How bytes move and what the connector needs from vLLM: DECISIONS.md "vLLM connector".

At construction (both roles) the facade checks the configuration and the host, derives the
model's identity for the shared tier's names and gives both sides one manager config
(:mod:`kvcm.integrations.vllm.startup`); the scheduler side logs one start line and the
capacity warnings (DECISIONS.md "A deployment that says what it does").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcm.api import DISK, GPU, SHARED
from kvcm.integrations.vllm import startup
from kvcm.integrations.vllm.handover import Handover, Role
from kvcm.integrations.vllm.identity import ModelSource, request_problem, request_scope
from kvcm.integrations.vllm.metadata import KvcmConnectorMetadata, KvcmWorkerMetadata
from kvcm.integrations.vllm.scheduler import KvcmScheduler
from kvcm.integrations.vllm.settings import KvLayout, SpecClasses
from kvcm.integrations.vllm.stats import LATEST, KvcmConnectorStats, KvcmPromMetrics
from kvcm.integrations.vllm.worker import KvcmWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvcmConnector", "KvcmConnectorMetadata", "KvcmWorkerMetadata"]

# under "vllm.": vLLM configures its own loggers only (an INFO line of "kvcm.*" would be dropped)
logger = init_logger(f"vllm.{__name__}")
# vLLM's hit source by kvcm tier number: kvcm's tier 0 (the manager's "gpu") is host memory here
_HIT_SOURCE = {GPU: CacheHitSource.HOST, DISK: CacheHitSource.DISK, SHARED: CacheHitSource.EXTERNAL_UNSPECIFIED}


class KvcmConnector(KVConnectorBase_V1, SupportsHMA):
    """kvcm's host, disk and shared tiers for vLLM (module doc).  ``SupportsHMA``: vLLM keeps
    its hybrid KV cache manager (one KV cache group per layer kind: sliding-window layers hold
    only their window); each group maps onto the kvcm life cycle of its kind
    (:class:`~kvcm.integrations.vllm.settings.KvLayout`)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        try:
            self._start(vllm_config, role, kv_cache_config)
        except ValueError as e:  # a configuration kvcm refuses: one ERROR line before vLLM's traceback
            startup.report_error(e)
            raise

    def _start(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # the policy and the keys: one-line errors naming the key (kvcm.integrations.vllm.startup;
        # vLLM's config resolution ran the same check before the model loaded)
        settings = startup.check_transfer_config(self._kv_transfer_config)
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise ValueError("KvcmConnector supports tensor parallelism, not pipeline parallelism "
                             f"(pipeline_parallel_size={par.pipeline_parallel_size})")
        from vllm.platforms import current_platform

        layout = KvLayout.from_kv_cache_config(kv_cache_config, current_platform.device_type, SpecClasses.of_vllm())
        world = par.tensor_parallel_size
        # the host's paths, the sizes against vLLM's block, the model's identity for the shared
        # tier: computed from the same files by the scheduler and by every rank, so all of them
        # name the store's objects alike
        facts = startup.EngineFacts.from_vllm(vllm_config, kv_cache_config, current_platform.device_type)
        prepared = startup.prepare(settings, layout, facts, lambda: ModelSource.from_vllm(vllm_config), world)
        self.sched: KvcmScheduler | None = None
        self.worker: KvcmWorker | None = None
        self._reported_inflight = 0
        self.handover: Handover | None = None
        kv_role = Role.of(self._kv_transfer_config, settings.save_decode_cache)  # disaggregated P/D (handover.py)
        if role == KVConnectorRole.SCHEDULER:
            ev = vllm_config.kv_events_config
            self.sched = KvcmScheduler(settings, layout, world,
                                       kv_events=bool(ev is not None and ev.enable_kv_cache_events),
                                       config=settings.manager_config(layout, 0, world, identity_tag=prepared.tag),
                                       scope=request_scope, skip=lambda request: request_problem(request) is not None)
            other = startup.shared_layout_warning(settings, layout, prepared, world)
            if other is not None:
                prepared.warnings.append(other)
            startup.announce(logger, settings, layout, facts, prepared, self.sched.mgr.backend_name, world)
            self.handover = Handover(self.sched, kv_role, settings.handover_wait_s)
            self.sched.shared_writes = kv_role.writes_shared
        else:
            rank = 0
            if world > 1:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
            self.worker = KvcmWorker(settings, layout, rank, world, num_blocks=kv_cache_config.num_blocks,
                                     config=settings.manager_config(layout, rank, world, identity_tag=prepared.tag))
            self.worker.shared_writes = kv_role.writes_shared
            self.worker.flush_saves = kv_role.flushes_saves

    @property
    def requires_kv_delivery(self) -> bool:
        # a cache, not a hand-off: a save dropped by a preemption is a future miss
        return False

    def _meta(self) -> KvcmConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        return meta

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None and isinstance(kv_connector_metadata, KvcmConnectorMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads are in before the forward; asynchronous ones are not read this step

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saved per step, every layer at once (wait_for_save)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        sending, recving, failed = self.worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        return self.worker.build_worker_meta()

    # ================================================================== both sides

    def get_kv_connector_stats(self) -> KvcmConnectorStats | None:
        side = self.worker if self.worker is not None else self.sched
        data = side.take_stats() if side is not None else None
        if self.sched is not None:
            # kvcm:bytes_in_flight (stats line and /metrics): reported whenever it changed, so
            # both end on the value it has now (0 once the saves are done), not a stale one
            now = self.sched.inflight_bytes
            if data is not None or now != self._reported_inflight:
                data = {**(data or {}), LATEST: now}
                self._reported_inflight = now
        return None if data is None else KvcmConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcmConnectorStats:
        return KvcmConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvcmPromMetrics:
        return KvcmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.sched is not None:
            self.sched.shutdown()

    # ================================================================== scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.handover is not None
        return self.handover.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self.sched is not None
        out: dict[CacheHitSource, int] = {}
        for tier, n in self.sched.planned_sources(request.request_id, num_external_tokens).items():
            src = _HIT_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.sched is not None
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.sched is not None
        self.sched.update_connector_output(connector_output.kv_connector_worker_meta)
        if self.sched.stats_dirty:
            self.sched.write_stats()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.handover is not None
        return self.handover.finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's hybrid manager calls this one (every group's blocks); kvcm's answer is the same:
        # hold the blocks while saves read them
        assert self.handover is not None
        return self.handover.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # an idle engine keeps stepping while kvcm's transfers are in flight, so their
        # reports come back (drains settle, held blocks are freed, mirrors close)
        return self.sched is not None and self.sched.busy()

    def take_events(self) -> list[Any]:
        """kvcm's tier events as vLLM ``KVCacheEvent``s (medium ``CPU`` for kvcm's host tier,
        ``STORAGE`` for disk, ``SHARED`` for the store), for vLLM's KV-event publisher."""
        if self.sched is None:
            return []
        return [_vllm_event(e) for e in self.sched.take_events()]

    def reset_cache(self) -> bool | None:
        assert self.sched is not None
        return self.sched.reset()


def _vllm_event(e: Any) -> Any:
    """A kvcm wire event (kvcm.fleet.wire) as vLLM's own struct (the same fields; kvcm's
    extensions are not set for full attention without partial reuse)."""
    from vllm.distributed import kv_events as ve

    kind = type(e).__name__
    if kind == "BlockStored":
        return ve.BlockStored(block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                              token_ids=list(e.token_ids), block_size=e.block_size, lora_id=e.lora_id,
                              medium=e.medium, lora_name=e.lora_name, extra_keys=e.extra_keys,
                              group_idx=e.group_idx, kv_cache_spec_kind=e.kv_cache_spec_kind,
                              kv_cache_spec_sliding_window=e.kv_cache_spec_sliding_window)
    if kind == "BlockRemoved":
        return ve.BlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium, group_idx=e.group_idx)
    return ve.AllBlocksCleared()
