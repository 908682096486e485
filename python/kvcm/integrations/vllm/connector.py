"""``KvcmConnector``: kvcm's tiers (host, disk, shared) behind vLLM's ``KVConnectorBase_V1``.

vLLM owns the GPU pages and its own prefix cache; kvcm's manager (scheduler side) mirrors
each running request into a kvcm request whose pages live in kvcm's top tier, in host
memory, and kvcm moves them to disk and the shared store as it does for its own engine
(DECISIONS.md "vLLM connector").  Per engine step:

* scheduler, admitting a request (``get_num_new_matched_tokens``): one batched existence
  query in the shared store for the blocks past kvcm's local match, then
  ``create_kv_cache(prompt[:-1], shared_hits=...)`` and ``resume``: the matched pages are
  locked in tier 0 (the manager issues onboard ops for pages on disk or in the store).
  The answer is the whole blocks kvcm holds past vLLM's own hit.
* scheduler, building the step's metadata (``build_connector_meta``): blocks saved in an
  earlier step are committed (they enter kvcm's tree only once their bytes are there),
  loads are planned (kvcm slot -> the vLLM block allocated for it), the kvcm request grows
  to the blocks that are full after this step and a save is planned for each (vLLM block ->
  kvcm slot); then ONE drain of the manager's copy runs for the step.
* worker, before the forward (``start_load_kv``): the runs (offload to disk, onboard from
  disk or the store, store to the store: ``DataPlane.apply_runs``), then the loads, batched
  per layer.  A run that fails (a ``CopyError``: disk error, object missing or corrupted,
  store down or past its deadline) marks every tier-0 slot it should have filled; a load
  from such a slot is not done and its vLLM block is reported by
  ``get_block_ids_with_load_errors`` (vLLM recomputes it), and the failed ops go back to the
  scheduler (``build_connector_worker_meta``), which hands them to ``forget_copies``: kvcm
  forgets those pages and rolls its requests back; no byte that failed its check reaches
  vLLM's cache.
* worker, after the forward (``wait_for_save``): the saves, batched per layer, synchronously
  (so ``request_finished`` never has to keep vLLM's blocks: it answers False).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

import kvcm
from kvcm.api import GPU, SHARED, CopyError, CopyOp, CopyRun, KVCacheManagerConfig, Tier
from kvcm.dataplane import DataPlane
from kvcm.integrations.vllm import startup
from kvcm.integrations.vllm.identity import ModelSource, request_problem, request_scope
from kvcm.integrations.vllm.settings import KvLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# under "vllm.": vLLM configures its own loggers only (an INFO line of "kvcm.*" would be dropped)
logger = init_logger(f"vllm.{__name__}")
LC = 0  # one life cycle: full attention (KvLayout allows nothing else)
TIER_NAMES = {1: "host", 2: "disk", SHARED: "shared"}


@dataclass
class Transfer:
    """Blocks of one request to copy: ``kvcm_slots[i]`` (tier 0) <-> ``vllm_blocks[i]``."""

    req_id: str
    kvcm_slots: list[int]
    vllm_blocks: list[int]


@dataclass
class KvcmConnectorMetadata(KVConnectorMetadata):
    step: int
    runs: list[CopyRun] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class KvcmWorkerMetadata(KVConnectorWorkerMetadata):
    step: int
    failed_ops: list[CopyOp] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcmWorkerMetadata) and other.step == self.step
        ops = list(self.failed_ops) + [op for op in other.failed_ops if op not in self.failed_ops]
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0) + v
        return KvcmWorkerMetadata(self.step, ops, counters)


@dataclass
class _Req:
    """The scheduler's mirror of one vLLM request."""

    request: Any  # vllm Request (its all_token_ids grow as it decodes)
    kv: Any  # the kvcm cache, None once mirroring stopped
    lookup_computed: int  # vLLM's block-aligned local hit when kvcm was asked
    hit_blocks: int  # blocks kvcm matched
    load: tuple[int, int] | None = None  # blocks [a, b) to load in the next step
    saved: int = 0  # blocks [0, saved) are in kvcm pages (matched, loaded or saved)
    committed: int = 0  # blocks [0, committed) are committed in kvcm
    ntokens: int = 0  # the request's tokens when kvcm was asked
    answer: int = 0  # what get_num_new_matched_tokens answered
    allocated: bool = False  # vLLM allocated its blocks (update_state_after_alloc)


def _counters() -> dict[str, int]:
    return dict.fromkeys(
        ("lookups", "lookup_tokens", "matched_blocks", "loaded_blocks", "hit_blocks_host", "hit_blocks_disk",
         "hit_blocks_shared", "saved_blocks", "load_error_blocks", "failed_ops", "rollbacks", "mirror_stops",
         "skipped_requests", "steps"), 0)


class KvcmConnector(KVConnectorBase_V1):
    """kvcm's host, disk and shared tiers for vLLM (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.scheduler_config.async_scheduling:
            # failed copies are reported to the manager for the step that issued them
            # (forget_copies takes the last drain's ops): the scheduler must not run ahead
            raise ValueError("KvcmConnector needs async_scheduling=False (--no-async-scheduling)")
        from vllm.platforms import current_platform

        # the policy, the keys, the paths, the sizes against vLLM's block, the model's identity
        # (kvcm.integrations.vllm.startup): one-line errors naming the key
        self.settings = startup.check_transfer_config(self._kv_transfer_config)
        self.layout = KvLayout.from_kv_cache_config(kv_cache_config, current_platform.device_type)
        self.B = self.layout.block_size
        self.facts = startup.EngineFacts.from_vllm(vllm_config, kv_cache_config, current_platform.device_type)
        self.prepared = startup.prepare(self.settings, self.layout, self.facts, lambda: ModelSource.from_vllm(vllm_config),
                                        vllm_config.parallel_config.tensor_parallel_size)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker(vllm_config)

    # ================================================================== scheduler side

    def _init_scheduler(self) -> None:
        s = self.settings
        self.config = s.manager_config(self.layout, identity_tag=self.prepared.tag)
        self.mgr = kvcm.KVCacheManager(self.config, backend=s.backend)
        startup.announce(logger, s, self.layout, self.facts, self.prepared, self.mgr.backend_name)
        self.lookup_plane: DataPlane | None = None
        if s.shared is not None:
            # lookups only: a plane with one tier-0 slot and the same store and layout fingerprint
            # (objects are named by it), so the query has the data plane's deadline and fault rules
            slot = self.B * sum(self.layout.block_bytes)
            cfg = KVCacheManagerConfig(self.B, self.config.layers, [Tier("gpu", slot), self.config.tiers[-1]],
                                       enable_partial_reuse=False, shared_write=s.shared_write,
                                       shared_namespace=self.config.shared_namespace)
            self.lookup_plane = DataPlane(cfg, store=s.make_store(), shared_timeout_s=s.shared_timeout_s)
        self.reqs: dict[str, _Req] = {}
        self.by_cache: dict[Any, str] = {}  # kvcm cache id -> vLLM request id
        self.step = 0
        self.counters = _counters()
        self.worker_counters: dict[str, int] = {}
        self.seconds = {"match": 0.0, "meta": 0.0}  # scheduler time in the connector (reporting only)
        self.stats_dirty = False
        self.publisher = None
        if s.events_endpoint is not None:
            from kvcm.fleet.publisher import EventPublisher

            # kvcm's tier 0 is host memory here: announced as CPU, disk as STORAGE, the store as SHARED
            self.publisher = EventPublisher(self.mgr, s.events_endpoint, replay_endpoint=s.events_replay_endpoint,
                                            media=("CPU", "CPU", "STORAGE", "SHARED"))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        try:
            return self._match(request, num_computed_tokens)
        finally:
            self.seconds["match"] += time.perf_counter() - t0

    def _match(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        tokens = list(request.all_token_ids)
        old = self.reqs.get(rid)
        if (old is not None and old.kv is not None and not old.allocated and old.ntokens == len(tokens)
                and old.lookup_computed == num_computed_tokens):
            # asked again for a request vLLM could not allocate yet: the same answer, no second
            # lookup, match and onboarding (its pages stay locked while it waits)
            return old.answer, False
        self.reqs.pop(rid, None)
        if old is not None:  # an earlier answer for other inputs: undo it
            self._release(old)
        if len(tokens) <= self.B:
            return 0, False
        if request_problem(request) is not None:  # its KV depends on more than its tokens (LoRA, images)
            self.counters["skipped_requests"] += 1
            return 0, False
        scope = request_scope(request)  # vLLM's cache_salt: kvcm's reuse scope
        prefix = tokens[:-1]  # the last token's logits must be computed
        self.counters["lookups"] += 1
        self.counters["lookup_tokens"] += len(prefix)
        hits = None
        if self.lookup_plane is not None:
            hits = self.lookup_plane.shared_lookup(self.mgr.shared_candidates(prefix, scope))  # ONE batched query
        kv = self.mgr.create_kv_cache(prefix, scope=scope, shared_hits=hits)
        if not kv.resume():  # tier 0 is full of locked pages: this request is not mirrored
            kv.close()
            self.counters["mirror_stops"] += 1
            return 0, False
        hit = kv.num_committed_tokens // self.B
        answer = max(0, hit * self.B - num_computed_tokens)
        st = _Req(request, kv, num_computed_tokens, hit, saved=hit, committed=hit, ntokens=len(tokens),
                  answer=answer)
        self.reqs[rid] = st
        self.by_cache[kv.id] = rid
        self.counters["matched_blocks"] += hit
        return answer, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        st.allocated = True
        if st.kv is None or num_external_tokens <= 0:
            return
        a = st.lookup_computed // self.B
        st.load = (a, a + num_external_tokens // self.B)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        t0 = time.perf_counter()
        try:
            return self._build_meta(scheduler_output)
        finally:
            self.seconds["meta"] += time.perf_counter() - t0

    def _build_meta(self, scheduler_output: SchedulerOutput) -> KvcmConnectorMetadata:
        so = scheduler_output
        self.step += 1
        self.counters["steps"] += 1
        for rid in so.preempted_req_ids or ():
            st = self.reqs.pop(rid, None)
            if st is not None:  # its blocks are freed by vLLM: keep what was saved, stop mirroring
                self._release(st)
        meta = KvcmConnectorMetadata(self.step)
        scheduled = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        load_slots: list[tuple[int, str]] = []
        for rid, computed in scheduled:
            st = self.reqs.get(rid)
            if st is None or st.kv is None:
                continue
            self._commit_saved(st)
            if st.kv is None:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
            slots = st.kv.page_indices(LC)
            if st.load is not None:
                a, b = st.load
                st.load = None
                t = Transfer(rid, slots[a:b], block_ids[a:b])
                meta.loads.append(t)
                load_slots += [(s, rid) for s in t.kvcm_slots]
            full = min(computed + so.num_scheduled_tokens.get(rid, 0), len(st.request.all_token_ids)) // self.B
            full = min(full, len(block_ids))
            if full > st.saved:
                if st.kv.capacity < full * self.B and not st.kv.resize(full * self.B):
                    self._stop(st)  # tier 0 cannot hold it: what is committed stays
                    continue
                slots = st.kv.page_indices(LC)
                meta.saves.append(Transfer(rid, slots[st.saved:full], block_ids[st.saved:full]))
                self.counters["saved_blocks"] += full - st.saved
                st.saved = full
        meta.runs = self.mgr.drain_copy_runs()  # the step's one drain (forget_copies takes its ops)
        self._count_hits(meta.runs, load_slots)
        if self.publisher is not None:
            self.publisher.publish(self.mgr.take_events())
        return meta

    def _count_hits(self, runs: list[CopyRun], load_slots: list[tuple[int, str]]) -> None:
        """Blocks loaded into vLLM by where kvcm had them: an onboard into the slot this step
        came from disk or the store, any other slot was in host memory already."""
        src = {}
        for run in runs:
            if run.reason == "onboard" and run.dst_tier == GPU:
                for d in run.dst_slots:
                    src[d] = run.src_tier
        for slot, _ in load_slots:
            self.counters["loaded_blocks"] += 1
            self.counters["hit_blocks_" + TIER_NAMES.get(src.get(slot, 1), "host")] += 1

    def update_connector_output(self, connector_output: Any) -> None:
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, KvcmWorkerMetadata):
            self._worker_output(wm)
        if self.stats_dirty:
            self.stats_dirty = False
            self._write_stats()

    def _worker_output(self, wm: KvcmWorkerMetadata) -> None:
        for k, v in wm.counters.items():
            self.worker_counters[k] = self.worker_counters.get(k, 0) + v
        if not wm.failed_ops:
            return
        if wm.step != self.step:
            raise RuntimeError(f"KvcmConnector: failed copies of step {wm.step} reported at step {self.step}")
        self.counters["failed_ops"] += len(wm.failed_ops)
        for cache_id in self.mgr.forget_copies(wm.failed_ops):
            rid = self.by_cache.get(cache_id)
            st = self.reqs.get(rid) if rid is not None else None
            if st is None or st.kv is None:
                continue
            # rolled back and SUSPENDED at its re-match: blocks past it are saved again from
            # vLLM (which recomputes the ones whose load failed) once it runs on
            self.counters["rollbacks"] += 1
            st.committed = st.saved = st.kv.num_committed_tokens // self.B
            st.load = None
            st.ntokens = -1  # a request still waiting is matched again when vLLM asks next
            if not st.kv.resume():
                self._stop(st)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self.reqs.pop(request.request_id, None)
        if st is not None:
            self._release(st)
        self.stats_dirty = True  # written once this step's worker output is in
        return False, None  # saves are synchronous: nothing of vLLM's blocks is still being read

    def _commit_saved(self, st: _Req) -> None:
        """Commit the blocks whose saves ran in an earlier step (their bytes are in the pages)."""
        if st.kv is None or st.saved <= st.committed:
            return
        tokens = st.request.all_token_ids[st.committed * self.B: st.saved * self.B]
        st.kv.commit(list(tokens))
        st.committed = st.saved

    def _stop(self, st: _Req) -> None:
        self.counters["mirror_stops"] += 1
        self._close_kv(st)

    def _release(self, st: _Req) -> None:
        """The request leaves (finished, preempted, or asked again): what its last step saved
        is committed, then the kvcm request closes; its pages stay reusable."""
        if st.kv is not None and st.load is None:
            self._commit_saved(st)
        self._close_kv(st)

    def _close_kv(self, st: _Req) -> None:
        if st.kv is not None:
            self.by_cache.pop(st.kv.id, None)
            st.kv.close()
            st.kv = None

    def _write_stats(self) -> None:
        path = self.settings.stats_file
        if path is None:
            return
        data = {"counters": self.counters, "worker": self.worker_counters, "seconds": self.seconds,
                "namespace": self.config.shared_namespace,
                "manager": self.mgr.stats(),
                "lookup": None if self.lookup_plane is None else self.lookup_plane.shared_stats}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, default=str)
        os.replace(tmp, path)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache``: kvcm drops every reusable page it holds locally (the
        shared store is the fleet's and is left alone)."""
        self.mgr.clear_reusable()
        return True

    def take_events(self):  # vLLM's own event path: kvcm's events go out through kvcm's publisher
        return ()

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._write_stats()
            if self.publisher is not None:
                self.publisher.close()
            if self.lookup_plane is not None:
                self.lookup_plane.close()
        elif getattr(self, "plane", None) is not None:
            self.plane.close()

    # ================================================================== worker side

    def _init_worker(self, vllm_config: VllmConfig) -> None:
        rank, world = 0, vllm_config.parallel_config.tensor_parallel_size
        if world > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        self.config = self.settings.manager_config(self.layout, rank, world, identity_tag=self.prepared.tag)
        self.plane: DataPlane | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.load_errors: set[int] = set()
        self.worker_meta: KvcmWorkerMetadata | None = None
        self.lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"KvcmConnector: no KV cache tensor for layers {missing}")
        self.kv_caches = [kv_caches[n] for n in self.layout.layer_names]
        for name, t, nbytes in zip(self.layout.layer_names, self.kv_caches, self.layout.block_bytes, strict=True):
            if t[0].numel() * t.element_size() != nbytes:
                raise ValueError(f"KvcmConnector: layer {name}: a block is {t[0].numel() * t.element_size()} bytes, "
                                 f"the KV cache spec says {nbytes} (is dim 0 the block?)")
        s = self.settings
        self.plane = DataPlane(self.config, device="cpu", store=s.make_store(), shared_timeout_s=s.shared_timeout_s)
        self.offsets = []
        off = 0
        for nbytes in self.layout.block_bytes:
            self.offsets.append((off, nbytes))
            off += nbytes

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        t0 = time.perf_counter()
        wm = self.worker_meta = KvcmWorkerMetadata(meta.step)
        bad: set[int] = set()  # tier-0 slots a failed op should have filled
        if meta.runs:
            before = dict(self.plane.shared_stats)
            try:
                self.plane.apply_runs(meta.runs)
            except CopyError as e:
                wm.failed_ops = list(e.ops)
                bad = {op.dst_slot for op in e.ops if op.dst_tier == GPU and op.lc == LC}
                logger.warning("kvcm: %d copy ops failed (%s); their blocks are recomputed", len(e.ops), e.cause)
            for k in ("load_failures", "timeouts", "lookup_errors", "removed_bad", "stores", "loads"):
                wm.counters["shared_" + k] = self.plane.shared_stats[k] - before[k]
        for t in meta.loads:
            ok = [i for i, s in enumerate(t.kvcm_slots) if s not in bad]
            self.load_errors.update(b for s, b in zip(t.kvcm_slots, t.vllm_blocks, strict=True) if s in bad)
            if ok:
                self._copy_in([t.kvcm_slots[i] for i in ok], [t.vllm_blocks[i] for i in ok])
        wm.counters["load_error_blocks"] = len(self.load_errors)
        wm.counters["load_us"] = int(1e6 * (time.perf_counter() - t0))  # runs + loads (reporting only)

    def _copy_in(self, slots: list[int], blocks: list[int]) -> None:
        pool = self.plane.pool(GPU, LC)
        src = pool.index_select(0, torch.tensor(slots, dtype=torch.long))
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv_caches[0].device)
        for kv, (off, n) in zip(self.kv_caches, self.offsets, strict=True):
            rows = src[:, off:off + n].contiguous().view(kv.dtype).view(len(blocks), *kv.shape[1:])
            kv.index_copy_(0, idx, rows.to(kv.device))

    def _copy_out(self, blocks: list[int], slots: list[int]) -> None:
        pool = self.plane.pool(GPU, LC)
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv_caches[0].device)
        out = torch.empty((len(slots), pool.shape[1]), dtype=torch.uint8)
        for kv, (off, n) in zip(self.kv_caches, self.offsets, strict=True):
            out[:, off:off + n] = kv.index_select(0, idx).cpu().contiguous().view(torch.uint8).view(len(slots), n)
        pool.index_copy_(0, torch.tensor(slots, dtype=torch.long), out)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv completed the step's loads

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # saved per step, every layer at once, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        t0 = time.perf_counter()
        for t in meta.saves:
            self._copy_out(t.vllm_blocks, t.kvcm_slots)
        if self.worker_meta is not None:
            self.worker_meta.counters["saved_blocks"] = sum(len(t.vllm_blocks) for t in meta.saves)
            self.worker_meta.counters["save_us"] = int(1e6 * (time.perf_counter() - t0))

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        wm, self.worker_meta = self.worker_meta, None
        return wm

