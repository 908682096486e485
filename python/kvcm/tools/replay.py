"""Replay a trace through the public API exactly like an inference engine (SPEC sec. 14).

Per request, in trace order, one request in flight at a time::

    kv = mgr.create_kv_cache(prompt)              # match: reused prefix, SUSPENDED
    kv.resume()                                   # LOCKED on gpu (onboard / copy-on-write)
    kv.resize(len(prompt))                        # pages for the whole prompt
    mgr.drain_copy_runs()                         # the engine would execute these (a batched
                                                  # copy per run)
    kv.commit_input()                             # prompt blocks enter the tree (the prompt
                                                  # given at create: not handed over again)
    for step in outputs, output_step at a time:   # only with with_outputs=True
        cap += len(step); kv.resize(cap); mgr.drain_copy_runs(); kv.commit(step)
    kv.close()                                    # partial tail inserted, pages reusable

``output_step`` is how many output tokens one decode step commits: 1 (token by token), or
``tokens_per_block`` (a block at a time, as engines that commit finished blocks do).  The
caller tracks the capacity (``cap``), as an engine tracks its sequence lengths.

Model: one full-attention layer group (two ``AttentionLayer`` with ``bytes_per_token=1``),
so one page is ``2 * tokens_per_block`` bytes; quotas are given in blocks (pages) and
converted to bytes.  ``gpu_quota_blocks=None`` means unbounded: the sum of every request's
blocks plus one, which no replay can exhaust (no eviction ever happens).

A ``resume()`` or ``resize()`` that returns False is counted as a *preemption*.  With one
request in flight everything else in the cache is evictable, and both calls already evict
all they can before giving up, so a False means this request alone does not fit the gpu
quota: it is closed without running and counted in ``failed`` (its prompt tokens stay in
``prompt_tokens``, its match is not counted as reuse).  A decode ``resize`` that fails
ends that request's decoding (counted in ``preemptions`` and ``truncated``).

Timing uses ``time.perf_counter`` for reporting only; nothing that affects behaviour
depends on it.  ``manager_s`` is the time spent inside manager/cache calls (prompt
expansion excluded) and is what the rates are based on; ``wall_s`` is the whole loop.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManager, KVCacheManagerConfig
from kvcm.config import ceildiv
from kvcm.engine_loop import config_from_layout
from kvcm.tools.cmdline import fmt_int
from kvcm.tools.trace import TraceRequest, expand_outputs, expand_prompt, load_trace, total_blocks

BYTES_PER_TOKEN_PER_LAYER = 1
NUM_LAYERS = 2


def slot_bytes(tokens_per_block: int) -> int:
    """Bytes of one page in the replay model."""
    return NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER * tokens_per_block


def replay_config(
    tokens_per_block: int,
    gpu_quota_blocks: int,
    host_quota_blocks: int | None = None,
    enable_partial_reuse: bool = True,
) -> KVCacheManagerConfig:
    """The replay model's manager config, quotas in blocks (one page of :func:`slot_bytes`
    each: :func:`kvcm.engine_loop.config_from_layout`)."""
    layers = [AttentionLayer(i, BYTES_PER_TOKEN_PER_LAYER) for i in range(NUM_LAYERS)]
    return config_from_layout(tokens_per_block, layers, gpu_blocks=gpu_quota_blocks,
                              host_blocks=host_quota_blocks or 0, enable_partial_reuse=enable_partial_reuse)


@dataclass
class ReplayResult:
    """The outcome of one trace replay on one backend: reuse, evictions, copy ops, timing."""

    backend: str
    tokens_per_block: int
    gpu_quota_blocks: int
    host_quota_blocks: int | None
    enable_partial_reuse: bool
    with_outputs: bool
    output_step: int = 1  # output tokens per decode step
    requests: int = 0  # requests replayed (failed ones included)
    failed: int = 0  # requests that did not fit the gpu quota at all
    preemptions: int = 0  # resume()/resize() calls that returned False
    truncated: int = 0  # requests whose decoding stopped early on a failed resize
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    reused_tokens: int = 0  # sum of num_reused_tokens of the requests that ran
    reused_blocks: int = 0  # blocks touched by reuse (a partially reused block counts)
    output_tokens: int = 0
    output_blocks: int = 0  # blocks the committed outputs added (beyond the prompt's)
    offloads: int = 0  # pages moved one tier colder (from mgr.stats())
    onboards: int = 0  # pages moved back to gpu (from mgr.stats())
    drops: int = 0  # pages freed by eviction (from mgr.stats())
    copy_ops: dict[str, int] = field(default_factory=dict)  # drained copy ops by reason
    setup_s: float = 0.0  # manager construction
    manager_s: float = 0.0  # time inside manager and cache calls
    wall_s: float = 0.0  # the whole replay loop, prompt expansion included
    stats: dict = field(default_factory=dict, repr=False)  # the final mgr.stats()

    @property
    def hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def evictions(self) -> int:
        """Pages evicted: offloaded to a lower tier or dropped."""
        return self.offloads + self.drops

    @property
    def requests_per_s(self) -> float:
        """Requests per second of manager time."""
        return self.requests / self.manager_s if self.manager_s > 0 else float("inf")

    @property
    def us_per_block(self) -> float:
        """Manager time per block (prompt blocks, plus the blocks outputs added), in microseconds."""
        blocks = self.prompt_blocks + self.output_blocks
        return 1e6 * self.manager_s / blocks if blocks else 0.0

    def summary(self) -> dict[str, Any]:
        """The result as a plain dict (stats left out, derived rates added)."""
        d = {k: v for k, v in self.__dict__.items() if k != "stats"}
        d.update(
            hit_rate=self.hit_rate,
            evictions=self.evictions,
            requests_per_s=self.requests_per_s,
            us_per_block=self.us_per_block,
        )
        return d


# ---------------------------------------------------------------------------------------
# Reading mgr.stats()
# ---------------------------------------------------------------------------------------


def eviction_counts(stats: dict) -> tuple[int, int, int]:
    """``(offloads, onboards, drops)`` summed over life cycles: ``stats["lc"][i]`` holds
    each life cycle's cumulative counters (sec. 9)."""
    lcs = stats.get("lc", [])
    return (
        sum(c.get("offloads", 0) for c in lcs),
        sum(c.get("onboards", 0) for c in lcs),
        sum(c.get("drops", 0) for c in lcs),
    )


def result_rows(results: dict[str, Any]) -> list[list[str]]:
    """The rows of the side-by-side table of ``{column: ReplayResult or the reason it did not run}``
    (``python -m kvcm replay``, ``bench replay``)."""
    def row(label: str, f: Callable[[Any], str]) -> list[str]:
        out = [label]
        for r in results.values():
            out.append(f(r) if not isinstance(r, str) else "")
        return out

    rows = [
        row("hit rate", lambda r: f"{100 * r.hit_rate:.2f}%"),
        row("reused tokens", lambda r: f"{fmt_int(r.reused_tokens)} / {fmt_int(r.prompt_tokens)}"),
        row("reused blocks", lambda r: fmt_int(r.reused_blocks)),
        row(
            "evictions (offload/drop)",
            lambda r: f"{fmt_int(r.evictions)} ({fmt_int(r.offloads)}/{fmt_int(r.drops)})",
        ),
        row("onboards", lambda r: fmt_int(r.onboards)),
        row("failed / preempted", lambda r: f"{r.failed} / {r.preemptions}"),
        row("requests/s", lambda r: f"{r.requests_per_s:,.1f}" if r.requests else "n/a"),
        row("us/block", lambda r: f"{r.us_per_block:.2f}"),
        row("manager s / wall s", lambda r: f"{r.manager_s:.2f} / {r.wall_s:.2f}"),
    ]
    # a backend that did not run: its reason in the first row, blanks below
    for j, r in enumerate(results.values(), 1):
        if isinstance(r, str):
            rows[0][j] = r
    return rows


# ---------------------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------------------


def replay_input(trace: Sequence[TraceRequest] | None, limit: int | None, tokens_per_block: int,
                 gpu_quota_blocks: int | None, with_outputs: bool) -> tuple[Sequence[TraceRequest], int]:
    """The requests a replay runs (None: the shipped trace; the first ``limit``) and its gpu
    quota in blocks (None: unbounded, every request's blocks plus one)."""
    if trace is None:
        trace = load_trace()
    if limit is not None:
        trace = trace[: max(0, limit)]
    if gpu_quota_blocks is None:
        gpu_quota_blocks = total_blocks(trace, tokens_per_block, with_outputs) + 1
    return trace, gpu_quota_blocks


def replay(
    trace: Sequence[TraceRequest] | None,
    backend: str | None,
    tokens_per_block: int = 32,
    gpu_quota_blocks: int | None = None,
    host_quota_blocks: int | None = None,
    enable_partial_reuse: bool = True,
    with_outputs: bool = False,
    output_step: int = 1,
    limit: int | None = None,
    progress: bool = False,
    check_invariants: bool = False,
) -> ReplayResult:
    """Replay ``trace`` (None: the shipped trace) on ``backend`` (None: ``kvcm.backend``).

    Raises whatever the backend raises (e.g. NotImplementedError from a backend stage
    that lacks the request life cycle)."""
    trace, gpu_quota_blocks = replay_input(trace, limit, tokens_per_block, gpu_quota_blocks, with_outputs)
    B = tokens_per_block
    if backend is None:
        import kvcm

        backend = kvcm.backend
    if type(output_step) is not int or output_step < 1:
        raise ValueError(f"output_step must be an int >= 1, got {output_step!r}")
    res = ReplayResult(backend, B, gpu_quota_blocks, host_quota_blocks, enable_partial_reuse, with_outputs,
                       output_step)
    cfg = replay_config(B, gpu_quota_blocks, host_quota_blocks, enable_partial_reuse)

    clock = time.perf_counter
    t0 = clock()
    mgr = KVCacheManager(cfg, backend=backend)
    t1 = clock()
    res.setup_s = t1 - t0

    bar = None
    if progress:
        from kvcm.tools.progress import Progress

        bar = Progress(len(trace), f"replay {backend}")
    ops: Counter[str] = Counter()
    mgr_s = 0.0
    try:
        for req in trace:
            mgr_s += _replay_request(mgr, req, res, ops, with_outputs)
            if bar:
                bar.update()
        for run in mgr.drain_copy_runs():
            ops[run.reason] += len(run)
        if check_invariants:
            mgr.check_invariants()
        res.stats = mgr.stats()
    finally:
        if bar:
            bar.close()
    res.manager_s = mgr_s
    res.wall_s = clock() - t1
    res.copy_ops = dict(sorted(ops.items()))
    res.offloads, res.onboards, res.drops = eviction_counts(res.stats)
    return res


def request_input(res: ReplayResult, req: TraceRequest, with_outputs: bool) -> tuple[list[int], Sequence[int]]:
    """One trace request's prompt and outputs (none unless ``with_outputs``), counted into
    ``res`` as a request and its prompt tokens and blocks."""
    prompt = expand_prompt(req)
    outputs = expand_outputs(req.index, req.output_length) if with_outputs else ()
    res.requests += 1
    res.prompt_tokens += len(prompt)
    res.prompt_blocks += ceildiv(len(prompt), res.tokens_per_block)
    return prompt, outputs


def _replay_request(mgr: KVCacheManager, req: TraceRequest, res: ReplayResult, ops: Counter[str],
                    with_outputs: bool) -> float:
    """One request of the replay: create, resume, resize and commit its prompt (a request
    that does not fit is counted failed and closed), then decode its outputs one token per
    step.  Counts into ``res`` and ``ops`` (drained copy ops by reason); returns the time
    spent in manager and cache calls."""
    B = res.tokens_per_block
    clock = time.perf_counter
    prompt, outputs = request_input(res, req, with_outputs)
    n = len(prompt)
    # the engine executes these, a batched copy per run (kvcm.api.CopyRun); counted by reason
    # off the clock
    drained: list[list] = []
    ts = clock()
    kv = mgr.create_kv_cache(prompt)
    ok = kv.resume()
    if ok:
        ok = kv.resize(n)
    if not ok:
        kv.close()
        drained.append(mgr.drain_copy_runs())
        spent = clock() - ts
        res.preemptions += 1
        res.failed += 1
        _count_ops(ops, drained)
        return spent
    reused = kv.num_reused_tokens
    drained.append(mgr.drain_copy_runs())
    kv.commit_input()  # the rest of the prompt given at create
    cap = n
    k = res.output_step
    done = 0
    truncated = False
    for i in range(0, len(outputs), k):
        step = outputs[i : i + k]
        cap += len(step)
        if not kv.resize(cap):
            truncated = True
            break
        drained.append(mgr.drain_copy_runs())
        kv.commit(step)
        done += len(step)
    kv.close()
    spent = clock() - ts
    if truncated:
        res.preemptions += 1
        res.truncated += 1
    res.output_tokens += done
    res.output_blocks += ceildiv(n + done, B) - ceildiv(n, B)
    res.reused_tokens += reused
    res.reused_blocks += ceildiv(reused, B)
    _count_ops(ops, drained)
    return spent


def _count_ops(ops: Counter[str], drained: list[list]) -> None:
    for runs in drained:
        for run in runs:
            ops[run.reason] += len(run)


__all__ = ["ReplayResult", "eviction_counts", "replay", "replay_config", "replay_input", "request_input", "slot_bytes"]
