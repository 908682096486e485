"""A measuring stick for ``bench replay``, NOT a backend: the least a pure-Python prefix
cache has to do for the replay's workload, timed in the same run as the backends.

``MinimalPrefixCache`` is what the issue-12 target is measured against: chained SHA-256
block keys (hashed from one packed buffer per prompt) in one dict, an ordered LRU of the
blocks no request uses (``OrderedDict``: O(1) touch, O(1) oldest), a refcount per block,
and a free list of block ids.  Nothing else: no tiers (one pool of the gpu quota; eviction drops),
no partial blocks (only full blocks are cached; a partial tail is allocated and freed),
no events, no stats, no copy ops, no checks, no snapshot.  An evicted block's
descendants stay in the dict until they are evicted themselves (they are unreachable, as
in vLLM's hash-keyed cache).

``replay_floor`` drives it exactly like :func:`kvcm.tools.replay.replay` drives a manager
(match, allocate the rest of the prompt, commit, optionally decode the outputs
``output_step`` tokens at a time, close; one request in flight) and returns a :class:`kvcm.tools.replay.ReplayResult`
with ``backend="floor"`` whose ``manager_s`` is the time inside the cache's methods.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvcm.config import ceildiv
from kvcm.keys import scope_root_key
from kvcm.tools.replay import ReplayResult, replay_input, request_input
from kvcm.tools.trace import TraceRequest, load_trace

FLOOR = "floor"


class _Block:
    """A cached full block: its id and how many requests use it."""

    __slots__ = ("id", "refs")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.refs = 1


class MinimalPrefixCache:
    """Dict of chained keys -> block, an LRU of unreferenced blocks, refcounts."""

    def __init__(self, tokens_per_block: int, num_blocks: int) -> None:
        self.B = tokens_per_block
        self.root = scope_root_key(None)
        self.cached: dict[bytes, _Block] = {}
        self.lru: OrderedDict[bytes, _Block] = OrderedDict()  # unreferenced, oldest first
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id
        self.evictions = 0

    def keys(self, tokens: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Chained SHA-256 of every full block (one packed buffer, sliced per block)."""
        sha = hashlib.sha256
        step = 4 * self.B
        buf = struct.pack(f"<{len(tokens) // self.B * self.B}I", *tokens[: len(tokens) // self.B * self.B])
        key = self.root if parent is None else parent
        out = []
        for i in range(0, len(buf), step):
            key = sha(key + buf[i : i + step]).digest()
            out.append(key)
        return out

    def match(self, keys: list[bytes]) -> list[_Block]:
        """The cached prefix, referenced (leaving the LRU)."""
        out = []
        cached, lru = self.cached, self.lru
        for k in keys:
            b = cached.get(k)
            if b is None:
                break
            if b.refs == 0:
                del lru[k]
            b.refs += 1
            out.append(b)
        return out

    def allocate(self, n: int) -> list[int] | None:
        """``n`` block ids, evicting the least recently released blocks; None when they do
        not fit (nothing changes)."""
        if n > len(self.free) + len(self.lru):
            return None
        free = self.free
        while len(free) < n:
            k, b = self.lru.popitem(last=False)
            del self.cached[k]
            free.append(b.id)
            self.evictions += 1
        return [free.pop() for _ in range(n)]

    def commit(self, keys: list[bytes], ids: list[int]) -> list[_Block]:
        """Cache the full blocks ``keys`` with their ``ids`` (a key cached meanwhile keeps
        its block; ours goes back to the free list)."""
        out = []
        cached, lru = self.cached, self.lru
        for k, i in zip(keys, ids):
            b = cached.get(k)
            if b is None:
                b = cached[k] = _Block(i)
            else:
                if b.refs == 0:
                    del lru[k]
                b.refs += 1
                self.free.append(i)
            out.append(b)
        return out

    def release(self, keys: list[bytes], blocks: list[_Block], private: list[int]) -> None:
        """A request ends: its blocks go to the LRU's young end, deepest first (so they are
        evicted last-block-first); its uncached ids are freed."""
        lru = self.lru
        for k, b in zip(reversed(keys), reversed(blocks)):
            b.refs -= 1
            if b.refs == 0:
                lru[k] = b
        self.free.extend(private)


def _replay_one(cache: MinimalPrefixCache, prompt: list[int], outputs: Sequence[int], step: int,
                ) -> tuple[bool, int, int]:
    """One request: ``(ran, reused tokens, output tokens)``; outputs ``step`` at a time."""
    B = cache.B
    keys = cache.keys(prompt)
    hit = cache.match(keys)
    m = len(hit)
    ids = cache.allocate(ceildiv(len(prompt), B) - m)
    if ids is None:
        cache.release(keys[:m], hit, [])
        return False, 0, 0
    nfull = len(keys)
    blocks = hit + cache.commit(keys[m:], ids[: nfull - m])
    pending = ids[nfull - m:]  # the partial tail's block, if any
    tail = prompt[nfull * B:]
    done = 0
    for s in range(0, len(outputs), step):
        chunk = outputs[s:s + step]
        more = cache.allocate(ceildiv(len(tail) + len(chunk), B) - len(pending))
        if more is None:
            break
        pending += more
        tail += chunk
        done += len(chunk)
        while len(tail) >= B:  # a block is full: it is cached
            (key,) = cache.keys(tail[:B], keys[-1] if keys else None)
            keys.append(key)
            blocks += cache.commit([key], [pending.pop(0)])
            tail = tail[B:]
    cache.release(keys, blocks, pending)
    return True, m * B, done


def replay_floor(trace: Sequence[TraceRequest] | None, tokens_per_block: int = 32,
                 gpu_quota_blocks: int | None = None, host_quota_blocks: int | None = None,
                 with_outputs: bool = False, output_step: int = 1, limit: int | None = None) -> ReplayResult:
    """The floor's replay of ``trace`` with one pool of the gpu quota (no tiers here: a
    host quota is ignored, so the requests that do not fit are the backends' ones)."""
    trace, gpu_quota_blocks = replay_input(trace, limit, tokens_per_block, gpu_quota_blocks, with_outputs)
    B = tokens_per_block
    res = ReplayResult(FLOOR, B, gpu_quota_blocks, host_quota_blocks, False, with_outputs, output_step)
    clock = time.perf_counter
    t0 = clock()
    cache = MinimalPrefixCache(B, gpu_quota_blocks)
    t1 = clock()
    res.setup_s = t1 - t0
    spent = 0.0
    for req in trace:
        prompt, outputs = request_input(res, req, with_outputs)
        n = len(prompt)
        ts = clock()
        ran, reused, done = _replay_one(cache, prompt, outputs, output_step)
        spent += clock() - ts
        if not ran:
            res.failed += 1
            res.preemptions += 1
            continue
        res.reused_tokens += reused
        res.reused_blocks += ceildiv(reused, B)
        res.output_tokens += done
        res.output_blocks += ceildiv(n + done, B) - ceildiv(n, B)
        if done < len(outputs):
            res.preemptions += 1
            res.truncated += 1
    res.manager_s = spent
    res.wall_s = clock() - t1
    res.drops = cache.evictions
    return res


# ---------------------------------------------------------------------------------------
# one replay in a child process (bench replay): time and peak RSS of one implementation
# ---------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Start the peak RSS (VmHWM) over from the current RSS, so the trace load's transient
    peak (JSON parsing, larger than a small cache) is not taken for the cache's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then includes the trace load
        pass


def _peak_rss_bytes() -> int:
    """Peak RSS since :func:`_reset_peak_rss` (VmHWM), else the process's lifetime peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_replay(impl: str, limit: int, tokens_per_block: int, gpu: int | None, host: int | None,
                   outputs: bool = False, output_step: int = 1) -> dict:
    """Run ``impl`` (a backend name or ``floor``) over the replay in this process, meant
    to be a fresh child so that its peak RSS is its own (a warm-up run, then the timed one): ``{"result": ReplayResult fields,
    "peak_rss": bytes, "base_rss": bytes}`` (base: after imports and the trace load,
    before the manager is built), or ``{"why": reason}`` when the backend cannot run."""
    import dataclasses
    import gc

    from kvcm.tools.cmdline import run_guarded
    from kvcm.tools.replay import replay

    trace = load_trace(limit=limit)
    base = _rss_bytes()
    _reset_peak_rss()
    # Two runs, the second timed: the first pays a fresh process's first-touch page faults
    # for every byte the cache grows into, a cost a long-running server pays once, not per
    # request (it reuses freed memory); every implementation gets the same protocol, and the
    # peak RSS is still one run's, since the second reuses what the first freed.
    for _ in range(2):
        if impl == FLOOR:
            res, why = run_guarded(lambda: replay_floor(trace, tokens_per_block, gpu, host, outputs, output_step))
        else:
            res, why = run_guarded(lambda: replay(trace, impl, tokens_per_block=tokens_per_block,
                                                  gpu_quota_blocks=gpu, host_quota_blocks=host, with_outputs=outputs,
                                                  output_step=output_step))
        if why is not None:
            return {"why": why}
        gc.collect()
    peak = _peak_rss_bytes()
    fields = {f.name: getattr(res, f.name) for f in dataclasses.fields(res) if f.name != "stats"}
    return {"result": fields, "peak_rss": peak, "base_rss": base}


REPLAY_CHILD = (
    "import json, sys; from kvcm.bench.floor import measure_replay; a = json.loads(sys.argv[1]); "
    "print(json.dumps(measure_replay(**a)))"
)
