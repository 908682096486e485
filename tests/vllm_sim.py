"""An engine-free stand-in for vLLM's scheduler and workers, driving kvcm's connector halves
(:class:`KvcmScheduler`, one :class:`KvcmWorker` per tensor-parallel rank) through vLLM
0.32's connector protocol — the same calls, in the same order, as
``vllm/v1/core/sched/scheduler.py`` and ``vllm/v1/worker/kv_connector_model_runner_mixin.py``
make them — without importing vLLM.  Written for these tests (read vLLM, copied nothing).

What it models: a paged KV cache of ``num_blocks`` blocks per rank with a local prefix
cache (full blocks named by their token prefix, shared, evicted LRU when free); a
waiting queue and a running list (``max_num_seqs``, a token budget, chunked prefill);
preemption when blocks run out; asynchronous loads (WAITING_FOR_REMOTE_KVS until every rank
reports ``finished_recving``); load errors (``invalid_block_ids``: the request is rewound to
the first failed block, its step output dropped); ``request_finished`` holding blocks until
``finished_sending``; aborts; and async scheduling's order (step N+1 scheduled before the
output of step N is processed; a decoding request's next position is a placeholder whose
token only the worker knows).

The "model" is exact by construction: the KV of position ``p`` of a sequence is a function
of its tokens ``[0, p]`` (and the layer and rank), and the next token a function of the
sequence.  Each forward first writes the KV of its scheduled positions, then checks that
every position before them holds the right values, which is what attention reads: a wrong
byte anywhere (a wrong load, a stale page, a save of garbage served later) is caught, unless
vLLM drops that step's output (a failed load of that very step).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

MOD = (1 << 31) - 1
VALUE_MOD = 1 << 20  # values exact in float32


def _h(prev: int, tok: int) -> int:
    return (prev * 1_000_003 + tok + 1) % MOD


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: str = "WAITING"
    blocks: list[int] = field(default_factory=list)
    placeholders: int = 0  # positions scheduled past the known tokens (async scheduling)
    hashes: list[int] = field(default_factory=list)  # prefix hash after each known token
    num_preemptions: int = 0
    load_failed: bool = False
    recv_done: bool = False
    epoch: int = 0  # bumped when rewound: in-flight outputs scheduled before are dropped
    held: bool = False  # finished, blocks kept until finished_sending
    kv_transfer_params: dict | None = None  # what the client passed (disaggregated P/D: the hand-over)

    def __post_init__(self) -> None:
        h = 0
        for t in self.prompt:
            h = _h(h, t)
            self.hashes.append(h)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def append(self, tok: int) -> None:
        self.output.append(tok)
        self.hashes.append(_h(self.hashes[-1], tok))

    def hash_at(self, p: int) -> int:
        """The prefix hash through position ``p`` (one placeholder past the known tokens)."""
        if p < len(self.hashes):
            return self.hashes[p]
        assert p == len(self.hashes), (self.request_id, p, len(self.hashes))
        return _h(self.hashes[-1], next_token(self.hashes[-1]))


def next_token(h: int, vocab: int = 500) -> int:
    return h % (vocab - 1) + 1


def values(hashes: torch.Tensor, layer: int, rank: int, heads: int) -> torch.Tensor:
    """KV of positions with prefix hashes ``hashes``: ``[n, heads]`` float32."""
    base = hashes.to(torch.int64)[:, None] + 7919 * layer + 104_729 * rank + torch.arange(heads)[None, :]
    return (base % VALUE_MOD).to(torch.float32)


@dataclass
class BlockState:
    reqs: dict[str, list[int]]

    def get_block_ids(self, rid: str) -> tuple[list[int], ...] | None:
        ids = self.reqs.get(rid)
        return None if ids is None else (list(ids),)


@dataclass
class SchedOut:
    step: int
    num_scheduled_tokens: dict[str, int]
    starts: dict[str, int]
    epochs: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    has_sync_kv_loads: bool
    kv_connector_block_state: BlockState | None
    kv_connector_metadata: Any = None
    scheduled_new_reqs: list = field(default_factory=list)
    scheduled_cached_reqs: Any = None


@dataclass
class Output:
    finished_sending: set[str]
    finished_recving: set[str]
    invalid_block_ids: set[int]
    kv_connector_worker_meta: Any
    wrong_reads: dict[str, int]  # request -> first position whose KV was wrong when read
    stats: list[dict]


class Sim:
    """vLLM's scheduler + ``len(workers)`` ranks (module doc)."""

    def __init__(self, sched: Any, workers: list[Any], *, num_blocks: int, block_size: int, layers: int = 2,
                 heads: int = 4, max_num_seqs: int = 4, budget: int = 512, async_scheduling: bool = False,
                 prefix_cache: bool = True, device: str = "cpu") -> None:
        self.sched, self.workers = sched, workers
        self.B, self.layers, self.heads = block_size, layers, heads
        self.num_blocks = num_blocks
        self.max_num_seqs, self.budget = max_num_seqs, budget
        self.async_scheduling = async_scheduling
        self.prefix_cache = prefix_cache
        self.device = torch.device(device)
        self.kv = [[torch.zeros((num_blocks, block_size, heads), device=self.device) for _ in range(layers)]
                   for _ in workers]
        for w, kvs in zip(workers, self.kv, strict=True):
            w.register_kv_caches({name: t for name, t in zip(w.layout.layer_names, kvs, strict=True)})
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU: first out first
        self.ref = Counter()
        self.cached: dict[int, int] = {}  # prefix hash of a full block -> block
        self.block_key: dict[int, int] = {}
        self.requests: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.finished: dict[str, list[int]] = {}
        self.finished_ids: set[str] = set()
        self.preempted_now: set[str] = set()
        self.step_no = 0
        self.pending: tuple[SchedOut, Output] | None = None  # async scheduling: the output not yet processed
        self.counters: Counter[str] = Counter()
        self.agg_send: Counter[str] = Counter()
        self.agg_recv: Counter[str] = Counter()
        self.violations: list[str] = []

    # ------------------------------------------------------------------ requests

    def add(self, rid: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None) -> None:
        if len(prompt) + max_tokens > self.num_blocks * self.B:  # vLLM's max_model_len check
            raise ValueError(f"{rid}: {len(prompt)} + {max_tokens} tokens do not fit {self.num_blocks} blocks")
        r = Req(rid, list(prompt), max_tokens, kv_transfer_params=kv_transfer_params)
        self.requests[rid] = r
        self.waiting.append(r)

    def abort(self, rid: str) -> None:
        r = self.requests.get(rid)
        if r is None or r.status == "FINISHED":
            return
        self.counters["aborts"] += 1
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        delay = r.status == "WAITING_FOR_REMOTE_KVS" and not r.recv_done
        self._finish(r, delay)

    def _finish(self, r: Req, delay: bool = False) -> None:
        r.status = "FINISHED"
        self.finished[r.request_id] = list(r.output)
        self.finished_ids.add(r.request_id)
        hold = self.sched.request_finished(r, list(r.blocks))  # vLLM: the blocks of its computed tokens
        if hold:
            r.held = True
            self.counters["holds"] += 1
        if not hold and not delay:
            self._free(r)
            del self.requests[r.request_id]

    # ------------------------------------------------------------------ blocks

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            key = self.block_key.pop(b, None)
            if key is not None and self.cached.get(key) == b:
                del self.cached[key]
            self.ref[b] = 1
            out.append(b)
        return out

    def _free(self, r: Req) -> None:
        for b in reversed(r.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                del self.ref[b]
                self.free[b] = None
        r.blocks = []

    def _cache_blocks(self, r: Req, upto: int) -> None:
        if not self.prefix_cache:
            return
        for i in range(min(upto, r.num_tokens) // self.B):
            key = r.hashes[(i + 1) * self.B - 1]
            b = r.blocks[i]
            if key not in self.cached:
                self.cached[key] = b
                self.block_key[b] = key

    def _local_hit(self, r: Req) -> list[int]:
        if not self.prefix_cache:
            return []
        out = []
        for i in range((r.num_tokens - 1) // self.B):
            b = self.cached.get(r.hashes[(i + 1) * self.B - 1])
            if b is None:
                break
            out.append(b)
        return out

    def _need(self, r: Req, tokens: int) -> int:
        return max(0, -(-tokens // self.B) - len(r.blocks))

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedOut:
        self.step_no += 1
        budget = self.budget
        sched: dict[str, int] = {}
        starts: dict[str, int] = {}
        preempted: list[Req] = []
        has_sync = False
        for r in list(self.running):
            if r not in self.running:
                continue
            if len(r.output) + r.placeholders >= r.max_tokens:
                continue
            n = min(r.num_tokens + r.placeholders - r.num_computed_tokens, budget)
            if n <= 0:
                continue
            while True:
                need = self._need(r, r.num_computed_tokens + n)
                got = self._alloc(need)
                if got is not None:
                    r.blocks += got
                    break
                victim = self.running[-1]
                self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                sched.pop(victim.request_id, None)
                if victim is r:
                    break
            if r not in self.running:
                continue
            sched[r.request_id] = n
            starts[r.request_id] = r.num_computed_tokens
            budget -= n
        if not preempted:
            for r in list(self.waiting):
                if budget <= 0 or len(self.running) >= self.max_num_seqs:
                    break
                if r.status == "WAITING_FOR_REMOTE_KVS":
                    if not r.recv_done:
                        continue
                    self._promote(r)
                load_async = False
                ext = 0
                if r.num_computed_tokens == 0:
                    local = self._local_hit(r)
                    n_local = len(local) * self.B
                    ext, load_async = self.sched.get_num_new_matched_tokens(r, n_local)
                    if ext is None:  # the connector cannot tell yet: skipped this step, asked again
                        self.counters["ask_later"] += 1
                        continue
                    computed = n_local + ext
                    for b in local:  # claimed first: allocating must not evict them
                        if self.ref[b] == 0:
                            self.free.pop(b, None)
                        self.ref[b] += 1
                    r.blocks = list(local)
                    # an asynchronous load holds its blocks while no forward runs: admitted only
                    # when the whole request fits beside the other loads' reservations
                    reserved = sum(self._need(w, w.num_tokens) for w in self.waiting
                                   if w.status == "WAITING_FOR_REMOTE_KVS")
                    fits = not load_async or self._need(r, r.num_tokens) + reserved <= len(self.free)
                    got = self._alloc(self._need(r, computed if load_async else r.num_tokens)) if fits else None
                    if got is None:
                        self._free(r)
                        break
                    r.blocks += got
                    r.num_computed_tokens = computed
                    self.sched.update_state_after_alloc(r, list(r.blocks), ext)
                    if not load_async:
                        self._cache_blocks(r, computed)
                else:
                    need = self._need(r, r.num_tokens)
                    got = self._alloc(need)
                    if got is None:
                        break
                    r.blocks += got
                    self.sched.update_state_after_alloc(r, list(r.blocks), 0)
                if load_async:
                    r.status = "WAITING_FOR_REMOTE_KVS"
                    r.recv_done = False
                    self.counters["async_loads"] += 1
                    continue
                self.waiting.remove(r)
                self.running.append(r)
                r.status = "RUNNING"
                n = min(r.num_tokens - r.num_computed_tokens, budget)
                sched[r.request_id] = n
                starts[r.request_id] = r.num_computed_tokens
                budget -= n
                has_sync |= ext > 0
        so = SchedOut(self.step_no, sched, starts, {rid: self.requests[rid].epoch for rid in sched},
                      sum(sched.values()), {r.request_id for r in preempted} | self.preempted_now,
                      self.finished_ids, has_sync,
                      BlockState({rid: list(self.requests[rid].blocks) for rid in sched}))
        self.preempted_now = set()
        self.finished_ids = set()
        so.kv_connector_metadata = self.sched.build_connector_meta(so)
        so.kv_connector_block_state = None
        for rid, n in sched.items():  # vLLM's _update_after_schedule
            r = self.requests[rid]
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens + r.placeholders:
                r.placeholders += 1  # this step samples a token
            self._cache_blocks(r, min(r.num_computed_tokens, r.num_tokens))
        return so

    def _preempt(self, r: Req) -> None:
        self.counters["preemptions"] += 1
        self._free(r)
        r.status = "PREEMPTED"
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        r.epoch += 1
        self.waiting.appendleft(r)
        self.preempted_now.add(r.request_id)

    def _promote(self, r: Req) -> None:
        """vLLM's _update_waiting_for_remote_kv: the load is in (or failed: rewound)."""
        if r.load_failed and r.num_computed_tokens == 0:
            self._free(r)
        self._cache_blocks(r, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.num_computed_tokens -= 1
        r.status = "PREEMPTED" if r.num_preemptions else "WAITING"
        r.load_failed = False

    def execute(self, so: SchedOut) -> Output:
        meta = so.kv_connector_metadata
        sending, recving, invalid = Counter(), Counter(), set()
        wm = None
        wrong: dict[str, int] = {}
        stats = []
        for rank, w in enumerate(self.workers):
            w.handle_preemptions(meta)
            if so.has_sync_kv_loads:
                w.start_load_kv(meta)
            for rid, n in so.num_scheduled_tokens.items():
                bad = self._forward(rank, self.requests[rid], so.starts[rid], n)
                if bad is not None:
                    wrong[rid] = min(bad, wrong.get(rid, bad))
            if not so.has_sync_kv_loads:
                w.start_load_kv(meta)
            w.wait_for_save(meta)
            s, rc, _ = w.get_transfer_results(so.finished_req_ids)
            sending.update(s)
            recving.update(rc)
            invalid |= w.get_block_ids_with_load_errors()
            m = w.build_worker_meta()
            if m is not None:
                wm = m if wm is None else wm.aggregate(m)
            st = w.take_stats()
            if st:
                stats.append(st)
        world = len(self.workers)
        self.agg_send.update(sending)
        self.agg_recv.update(recving)
        fs = {r for r, c in self.agg_send.items() if c >= world}
        fr = {r for r, c in self.agg_recv.items() if c >= world}
        for r in fs:
            del self.agg_send[r]
        for r in fr:
            del self.agg_recv[r]
        return Output(fs, fr, invalid, wm, wrong, stats)

    def _forward(self, rank: int, r: Req, start: int, n: int) -> int | None:
        """Write the KV of positions [start, start+n), then check the KV of [0, start)."""
        kvs, dev = self.kv[rank], self.device
        pos = torch.arange(start, start + n)
        hashes = torch.tensor([r.hash_at(p) for p in range(start, start + n)])
        blocks = torch.tensor([r.blocks[p // self.B] for p in pos.tolist()]).to(dev)
        offs = (pos % self.B).to(dev)
        for layer, t in enumerate(kvs):
            t[blocks, offs] = values(hashes, layer, rank, self.heads).to(dev)
        if start == 0:
            return None
        pos = torch.arange(0, start)
        hashes = torch.tensor(r.hashes[:start])
        blocks = torch.tensor([r.blocks[p // self.B] for p in pos.tolist()]).to(dev)
        offs = (pos % self.B).to(dev)
        for layer, t in enumerate(kvs):
            ok = (t[blocks, offs] == values(hashes, layer, rank, self.heads).to(dev)).all(dim=1).cpu()
            if not bool(ok.all()):
                return int((~ok).nonzero()[0])
        return None

    def update(self, so: SchedOut, out: Output) -> None:
        """vLLM's update_from_output: load errors, sampled tokens, finishes, then the
        connector's output (update_connector_output), finished_recving / finished_sending."""
        failed_reqs: set[str] = set()
        if out.invalid_block_ids:
            failed_reqs = self._invalid(out.invalid_block_ids, so)
        for rid, n in so.num_scheduled_tokens.items():
            r = self.requests.get(rid)
            if r is None or r.status == "FINISHED":
                continue
            if so.starts[rid] + n >= len(r.hashes) and r.placeholders > 0 and so.epochs[rid] == r.epoch:
                r.placeholders -= 1
            if rid in failed_reqs or so.epochs[rid] != r.epoch:
                continue  # dropped: rescheduled from where its KV is good
            if rid in out.wrong_reads:
                self.violations.append(f"step {so.step}: {rid} read wrong KV at position {out.wrong_reads[rid]}")
            if so.starts[rid] + n >= r.num_tokens:  # the step sampled the next token
                r.append(next_token(r.hashes[-1]))
                if len(r.output) >= r.max_tokens:
                    self.running.remove(r)
                    self._finish(r)
        self.sched.update_connector_output(out.kv_connector_worker_meta)
        for rid in out.finished_recving:
            r = self.requests[rid]
            if r.status == "WAITING_FOR_REMOTE_KVS":
                r.recv_done = True
            else:  # aborted while loading: its blocks go now
                assert r.status == "FINISHED", (rid, r.status)
                if not r.held:
                    self._free(r)
                    del self.requests[rid]
        for rid in out.finished_sending:
            r = self.requests[rid]
            assert r.status == "FINISHED" and r.held, (rid, r.status, r.held)
            self._free(r)
            del self.requests[rid]

    def _invalid(self, invalid: set[int], so: SchedOut) -> set[str]:
        """vLLM's _handle_invalid_blocks (recompute policy)."""
        self.counters["invalid_blocks"] += len(invalid)
        failed = set()
        for r in list(self.running) + [w for w in self.waiting if w.status == "WAITING_FOR_REMOTE_KVS"]:
            computed = r.num_computed_tokens - so.num_scheduled_tokens.get(r.request_id, 0)
            for i, b in enumerate(r.blocks[:-(-computed // self.B)]):
                if b in invalid:
                    r.num_computed_tokens = i * self.B
                    if r.status == "WAITING_FOR_REMOTE_KVS":
                        r.load_failed = True
                    else:
                        failed.add(r.request_id)
                        r.epoch += 1
                        r.placeholders = 0
                    break
        for b in invalid:  # garbage until recomputed: not a prefix hit for anyone
            key = self.block_key.pop(b, None)
            if key is not None and self.cached.get(key) == b:
                del self.cached[key]
        return failed

    def step(self) -> None:
        so = self.schedule()
        if self.async_scheduling:
            if self.pending is not None:
                self.update(*self.pending)
            self.pending = (so, self.execute(so))
        else:
            self.update(so, self.execute(so))

    def run(self, max_steps: int = 20_000) -> None:
        """Step until every request finished and the connector has nothing in flight."""
        for _ in range(max_steps):
            if not self.requests and not self.sched.busy():
                if self.pending is None:
                    return
                self.update(*self.pending)
                self.pending = None
                continue
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps: {self.sched.pending()} requests={list(self.requests)}")


# ---------------------------------------------------------------------------------------
# A connector rig: the scheduler, its workers and the Sim, from kv_connector_extra_config


SIM_BLOCK, SIM_HEADS, SIM_LAYERS = 16, 4, 2


def sim_layout() -> Any:
    from kvcm.integrations.vllm.settings import KvLayout

    nbytes = SIM_BLOCK * SIM_HEADS * 4
    return KvLayout(SIM_BLOCK, tuple(f"layer{i}" for i in range(SIM_LAYERS)), (nbytes,) * SIM_LAYERS, "sim")


SIM_PAGE = SIM_BLOCK * SIM_HEADS * 4 * SIM_LAYERS


SIM_IDENTITY = "model:sim"  # what the connector derives from the model's weights (a shared tier's names)


def rig(extra: dict, *, world: int = 1, num_blocks: int = 24, kv_events: bool = False, scope: Any = None,
        skip: Any = None, identity: str = SIM_IDENTITY, **sim_kw: Any) -> Sim:
    from kvcm.integrations.vllm.scheduler import KvcmScheduler
    from kvcm.integrations.vllm.settings import ConnectorSettings
    from kvcm.integrations.vllm.worker import KvcmWorker

    settings = ConnectorSettings.parse(extra)
    layout = sim_layout()
    # as the connector's facade: the manager config, the model's identity in its names, for the
    # scheduler and every rank
    config = settings.manager_config(layout, 0, world, identity_tag=identity)
    sched = KvcmScheduler(settings, layout, world, kv_events=kv_events, config=config, scope=scope, skip=skip)
    workers = [KvcmWorker(settings, layout, r, world, num_blocks=num_blocks,
                          config=settings.manager_config(layout, r, world, identity_tag=identity))
               for r in range(world)]
    return Sim(sched, workers, num_blocks=num_blocks, block_size=SIM_BLOCK, heads=SIM_HEADS, layers=SIM_LAYERS,
               **sim_kw)


def close(sim: Sim) -> None:
    for w in sim.workers:
        w.shutdown()
    sim.sched.shutdown()


class Chats:
    """A multi-turn chat workload: ``n`` conversations sharing a system prompt, each turn a
    new user message appended to the whole history, the reply appended after."""

    def __init__(self, n: int = 6, system: int = 50, user: int = 30, reply: int = 8, seed: int = 1) -> None:
        import random

        self.rng = random.Random(seed)
        system_tokens = [self.rng.randrange(1, 500) for _ in range(system)]
        self.chats = [list(system_tokens) for _ in range(n)]
        self.user, self.reply = user, reply
        self.turns = 0

    def add_turn(self, sim: Sim) -> list[str]:
        ids = []
        for i, c in enumerate(self.chats):
            c += [self.rng.randrange(1, 500) for _ in range(self.user)]
            rid = f"t{self.turns}c{i}"
            sim.add(rid, list(c), self.reply)
            ids.append(rid)
        self.turns += 1
        return ids

    def finish_turn(self, sim: Sim, ids: list[str]) -> None:
        for rid, c in zip(ids, self.chats, strict=True):
            c += sim.finished[rid]

    def run(self, sim: Sim, turns: int) -> None:
        for _ in range(turns):
            ids = self.add_turn(sim)
            sim.run()
            self.finish_turn(sim, ids)
