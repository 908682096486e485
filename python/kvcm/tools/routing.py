"""KV-aware routing across instances: replay a trace through N managers behind the router.

Each instance is a ``KVCacheManager`` (the replay model of ``kvcm.tools.replay``: one
full-attention layer group, ``enable_partial_reuse=False`` so the router index is exact)
whose events reach one ``RouterIndex`` through a ``LoopbackLink`` (the publisher's
translation and vLLM wire encoding, the router's decoding; no sockets, so the result does
not depend on thread timing).  Requests are routed one at a time in trace order; each runs
like an engine request (match, resume, resize, commit the prompt, close) on its instance.

Policies (all deterministic):

* ``round-robin`` — request ``k`` goes to instance ``k mod N``;
* ``random`` — uniform, ``random.Random(seed)``;
* ``least-loaded`` — the smallest load (below), ties to the lower index;
* ``kv`` — the soonest estimated prefill completion: instance ``i`` would first finish its
  queued prefill work ``load_i``, then compute the prompt's uncached tokens
  ``prompt - reuse_i`` (``reuse_i`` = the router's answer for ``i``), so it picks the
  largest ``reuse_i - weight * load_i`` (``weight`` 1: a reused token and a queued token
  cost the same; ties to fewer requests routed so far, then the lower index).

Load: the prefill tokens (prompt minus reused) of the requests routed to the instance among
the last ``window`` requests (default ``4 * N``), a stand-in for its queue at a steady
arrival rate.  Reported balance: max / mean of requests and of prompt tokens per instance.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcm.api import KVCacheManager
from kvcm.fleet.loopback import LoopbackLink
from kvcm.fleet.router_index import RouterIndex, RouterModel
from kvcm.tools.replay import replay_config
from kvcm.tools.trace import TraceRequest, expand_prompt, unique_blocks

POLICIES: tuple[str, ...] = ("kv", "round-robin", "random", "least-loaded")


@dataclass
class RouteResult:
    """The outcome of routing a trace with one policy over N instances."""

    policy: str
    instances: int
    requests: int = 0
    failed: int = 0  # requests that did not fit an instance's gpu quota
    prompt_tokens: int = 0
    reused_tokens: int = 0  # what the instances actually reused (num_reused_tokens)
    mispredicted: int = 0  # requests where the router's answer != the instance's reuse
    per_instance_requests: list[int] = field(default_factory=list)
    per_instance_tokens: list[int] = field(default_factory=list)
    wire_bytes: int = 0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens, over all instances."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @staticmethod
    def _imbalance(xs: Sequence[int]) -> float:
        mean = sum(xs) / len(xs) if xs else 0.0
        return max(xs) / mean if mean else 0.0

    @property
    def request_imbalance(self) -> float:
        """max / mean requests per instance (1.0 = perfectly even)."""
        return self._imbalance(self.per_instance_requests)

    @property
    def token_imbalance(self) -> float:
        """max / mean prompt tokens per instance."""
        return self._imbalance(self.per_instance_tokens)


class _Chooser:
    def __init__(self, policy: str, n: int, seed: int, window: int, weight: float) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choices: {', '.join(POLICIES)}")
        self.policy, self.n, self.weight = policy, n, weight
        self.rng = random.Random(seed)
        self.k = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=window)  # (instance, prefill tokens)
        self.load = [0] * n
        self.count = [0] * n

    def choose(self, reuse: dict[int, int]) -> int:
        n, k = self.n, self.k
        self.k += 1
        if self.policy == "round-robin":
            return k % n
        if self.policy == "random":
            return self.rng.randrange(n)
        if self.policy == "least-loaded":
            return min(range(n), key=lambda i: (self.load[i], i))
        return max(range(n), key=lambda i: (reuse[i] - self.weight * self.load[i], -self.count[i], -i))

    def record(self, instance: int, prefill_tokens: int) -> None:
        if len(self.recent) == self.recent.maxlen:
            old_i, old_t = self.recent[0]
            self.load[old_i] -= old_t
        self.recent.append((instance, prefill_tokens))
        self.load[instance] += prefill_tokens
        self.count[instance] += 1


def default_gpu_blocks(trace: Sequence[TraceRequest], n: int, tokens_per_block: int) -> int:
    """Per-instance gpu quota: the trace's distinct blocks spread over the fleet."""
    return max(1, -(-unique_blocks(trace, tokens_per_block) // n))


def route_trace(
    trace: Sequence[TraceRequest],
    instances: int,
    policy: str,
    *,
    tokens_per_block: int = 32,
    gpu_quota_blocks: int | None = None,
    backend: str | None = None,
    seed: int = 0,
    window: int | None = None,
    weight: float = 1.0,
    on_request: Callable[[], object] | None = None,
) -> RouteResult:
    """Route ``trace`` over ``instances`` managers with ``policy`` (see the module doc)."""
    if instances < 1:
        raise ValueError("instances must be >= 1")
    B = tokens_per_block
    quota = gpu_quota_blocks if gpu_quota_blocks is not None else default_gpu_blocks(trace, instances, B)
    cfg = replay_config(B, quota, enable_partial_reuse=False)
    router = RouterIndex(RouterModel.from_config(cfg))
    mgrs = [KVCacheManager(cfg, backend=backend) for _ in range(instances)]
    links = [LoopbackLink(m, router, i) for i, m in enumerate(mgrs)]
    chooser = _Chooser(policy, instances, seed, window or 4 * instances, weight)
    res = RouteResult(policy, instances, per_instance_requests=[0] * instances,
                      per_instance_tokens=[0] * instances)
    t0 = time.perf_counter()
    for req in trace:
        prompt = expand_prompt(req)
        reuse = router.reuse_all(prompt)
        i = chooser.choose(reuse)
        mgr = mgrs[i]
        kv = mgr.create_kv_cache(prompt)
        reused = kv.num_reused_tokens
        ok = kv.resume() and kv.resize(len(prompt))
        if ok:
            start = kv.num_committed_tokens
            kv.commit(prompt[start:])
        kv.close()
        mgr.drain_copy_ops()
        links[i].step()
        res.requests += 1
        res.prompt_tokens += len(prompt)
        res.per_instance_requests[i] += 1
        res.per_instance_tokens[i] += len(prompt)
        if not ok:
            res.failed += 1
            reused = 0
        elif reuse[i] != reused:
            res.mispredicted += 1
        res.reused_tokens += reused
        chooser.record(i, len(prompt) - reused)
        if on_request is not None:  # progress display only
            on_request()
    res.wall_s = time.perf_counter() - t0
    res.wire_bytes = sum(link.bytes_sent for link in links)
    for m in mgrs:
        m.shutdown()
    return res


def table(results: Sequence[RouteResult]) -> tuple[list[str], list[list[str]]]:
    """The results as a table: header and rows."""
    header = ["policy", "N", "hit rate", "prefill tokens saved", "max/mean requests", "max/mean tokens",
              "router exact", "s"]
    rows = [[r.policy, str(r.instances), f"{r.hit_rate:.2%}", f"{r.reused_tokens:,}", f"{r.request_imbalance:.2f}",
             f"{r.token_imbalance:.2f}", "yes" if r.mispredicted == 0 else f"{r.mispredicted} off",
             f"{r.wall_s:.1f}"] for r in results]
    return header, rows


def plot(results: Sequence[RouteResult], path: str) -> None:
    """Hit rate and load imbalance per policy (PNG, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.policy}\nN={r.instances}" for r in results]
    x = range(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(results) + 4), 4.5))
    ax1.bar(x, [100 * r.hit_rate for r in results], color="tab:blue")
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set_ylabel("hit rate (% of prompt tokens reused)")
    ax1.set_title("prefix reuse")
    w = 0.4
    ax2.bar([i - w / 2 for i in x], [r.request_imbalance for r in results], w, label="requests")
    ax2.bar([i + w / 2 for i in x], [r.token_imbalance for r in results], w, label="prompt tokens")
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylabel("max / mean per instance")
    ax2.set_title("load balance", pad=24)
    # between the title and the plot, never over a bar (the imbalance bars reach any height)
    ax2.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["POLICIES", "RouteResult", "default_gpu_blocks", "plot", "route_trace", "table"]
