"""SPEC sec. 15, issue 8 items 7-11: what a long-running manager keeps stays bounded by its
live state, and a call's cost does not grow with the wrong thing.

Memory is measured without timing noise: tracemalloc for the python backend, the core's own
table sizes (``_core.internal_sizes()``: slab slots, interned digests, roots) for cpp, which
are high-water marks of what the core holds.  Scaling is measured by counting tree work where
the python backend lets a test count it, and by a best-of-N timing ratio with a wide margin
(linear vs quadratic differ by the size ratio itself) where it does not.

``KVCM_SOAK=1`` runs the long soak (tens of thousands of requests) instead of the short one.
"""

from __future__ import annotations

import gc
import hashlib
import os
import random
import time
import tracemalloc

import kvcm
from kvcm import AttentionLayer, KVCacheManagerConfig, ReuseScope, SsmLayer, Tier

from parity.helpers import python_work

LONG = os.environ.get("KVCM_SOAK") == "1"
B = 4


def digest(i: int) -> bytes:
    return hashlib.sha256(b"kvcm-soak-%d" % i).digest()


def soak_config(max_events: int = 64, **kw) -> KVCacheManagerConfig:
    # attention (full + windowed) + ssm, gpu + host + disk: every page path of sec. 8 runs
    layers = [AttentionLayer(0, 1), AttentionLayer(1, 1, window=8, sink_tokens=2), SsmLayer(2, 4)]
    slot = 2 * B + 4  # one slot per life cycle: 4 + 4 + 4 bytes
    return KVCacheManagerConfig(
        tokens_per_block=B, layers=layers,
        tiers=[Tier("gpu", 64 * slot), Tier("host", 64 * slot), Tier("disk", 128 * slot, path="/tmp/kvcm-soak-disk")],
        max_events=max_events, **kw)


class Footprint:
    """What the manager holds: python → traced bytes; cpp → the core's table sizes."""

    def __init__(self, mgr, backend: str) -> None:
        self.mgr, self.backend = mgr, backend
        if backend == "python":
            tracemalloc.start()

    def sample(self) -> dict[str, int]:
        gc.collect()
        if self.backend == "python":
            return {"traced_bytes": tracemalloc.get_traced_memory()[0]}
        out = dict(self.mgr._core.internal_sizes())
        if os.path.exists("/proc/self/statm"):  # resident set size, a coarse second opinion
            with open("/proc/self/statm") as f:
                out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return out

    def stop(self) -> None:
        if self.backend == "python":
            tracemalloc.stop()


def assert_flat(before: dict[str, int], after: dict[str, int], backend: str, n_requests: int) -> None:
    """Growth between two samples taken once the cache is full.  The leaks of issue 8 grow
    by one entry (~100-800 bytes) per request; the bounds allow far less than that (python:
    the traced heap wanders by some 40 KB with the cache's contents, hence 100 B/request)."""
    if backend == "python":
        grown = after["traced_bytes"] - before["traced_bytes"]
        assert grown < 100 * n_requests, f"python backend grew by {grown} bytes over {n_requests} requests"
        return
    for name in ("tree_node_slots", "trie_node_slots", "roots", "digests", "digest_slots", "page_slots"):
        slack = before[name] // 10 + 16  # high-water marks may still creep a little
        assert after[name] <= before[name] + slack, (
            f"cpp core: {name} grew from {before[name]} to {after[name]} over {n_requests} requests")


def soak_step(mgr, rng: random.Random, i: int) -> None:
    """One request of the mixed workload: unique digests, unique and shared scopes, probes
    with never-seen scopes, chunked prefill, decode, suspend/resume, a wide fan-out."""
    scope = ReuseScope(salt=i) if i % 2 else (ReuseScope() if i % 6 else ReuseScope(lora_id=7))
    # one system block, then continuations that all start with the same token: a wide fan-out
    # under one block (the C++ tree indexes it in a trie, built and dropped as blocks churn)
    system = [7, 7, 7, 7, 9]
    prompt = system + [digest(i)] + [rng.randrange(50) for _ in range(rng.randrange(2, 12))]
    if rng.random() < 0.3:
        assert mgr.probe_reuse(prompt, ReuseScope(salt=10**12 + i)) == 0
    kv = mgr.create_kv_cache(prompt, scope=scope)
    if kv.resume() and kv.resize(len(prompt) + 2):
        rest = prompt[kv.num_committed_tokens:]
        cut = rng.randrange(len(rest) + 1)
        kv.commit(rest[:cut])
        kv.commit(rest[cut:])
        kv.commit([digest(10**9 + i)])  # a decode step with a digest token of its own
        if rng.random() < 0.2:
            kv.suspend()
            kv.resume()
    kv.close()


def run_soak(mgr, backend: str, n_warm: int, n_measure: int, drain_every: int = 40) -> tuple[dict, dict]:
    rng = random.Random(8)
    meter = Footprint(mgr, backend)
    try:
        samples = []
        total = n_warm + 2 * n_measure
        for i in range(total):
            soak_step(mgr, rng, i)
            if i % drain_every == drain_every - 1:  # undrained for a while, then drained
                mgr.drain_copy_ops()
            if i % 25 == 0:
                mgr.take_events()
            if i + 1 in (n_warm + n_measure, total):
                mgr.drain_copy_ops()
                mgr.take_events()
                mgr.check_invariants()
                samples.append(meter.sample())
        return samples[0], samples[1]
    finally:
        meter.stop()


def test_soak_memory_stays_flat_once_the_cache_is_full(backend: str) -> None:
    mgr = kvcm.KVCacheManager(soak_config(), backend=backend)
    if LONG:
        n_warm, n_measure = 2000, 20000
    else:
        n_warm, n_measure = (2000, 6000) if backend == "cpp" else (400, 800)
    before, after = run_soak(mgr, backend, n_warm, n_measure)
    print(f"soak ({backend}): after {n_warm + n_measure} requests {before}, after {n_warm + 2 * n_measure} {after}")
    assert_flat(before, after, backend, n_measure)
    assert mgr.stats()["pending_copy_ops"] == 0
    if LONG and "rss_bytes" in after:  # a coarse guard against leaks the table sizes cannot see
        assert after["rss_bytes"] - before["rss_bytes"] < 16 << 20, (before, after)


# ---------------------------------------------------------------- item 7: digest tokens


def test_cpp_interns_every_distinct_digest_token_forever(backend: str) -> None:
    """Each request brings digest tokens never seen before; once they leave the tree,
    the requests and the event buffer, nothing of them may stay."""
    mgr = kvcm.KVCacheManager(soak_config(max_events=16), backend=backend)
    meter = Footprint(mgr, backend)
    try:
        samples = []
        for i in range(1500):
            prompt = [1, 2, 3, digest(i), digest(-i - 1), 5, 6, 7, digest(i + 10**6)]
            kv = mgr.create_kv_cache(prompt)
            if kv.resume() and kv.resize(len(prompt)):
                kv.commit(prompt[kv.num_committed_tokens:])
            kv.close()
            mgr.drain_copy_ops()
            if i in (499, 1499):
                samples.append(meter.sample())
        assert_flat(samples[0], samples[1], backend, 1000)
        if backend == "cpp":
            sizes = samples[1]
            # live digests: at most 3 per cached block (gpu + host + disk pools) + buffered events
            assert sizes["digests"] <= 3 * (64 + 64 + 128) + 3 * 16, sizes
            mgr.clear_reusable()
            mgr.take_events()
            assert mgr._core.internal_sizes()["digests"] == 0
    finally:
        meter.stop()


# ---------------------------------------------------------------- item 8: scopes


def test_every_distinct_scope_leaves_a_root_forever(backend: str) -> None:
    mgr = kvcm.KVCacheManager(soak_config(), backend=backend)
    meter = Footprint(mgr, backend)
    try:
        samples = []
        for i in range(1200):
            scope = ReuseScope(salt=i)
            assert mgr.probe_reuse([1, 2, 3, 4, 5], ReuseScope(lora_id=i)) == 0  # probes allocate nothing
            kv = mgr.create_kv_cache([1, 2, 3, 4, 5], scope=scope)
            if kv.resume() and kv.resize(6):
                kv.commit([1, 2, 3, 4, 5, 6])
            kv.close()
            if i % 3 == 0:
                mgr.clear_reusable()
            mgr.drain_copy_ops()
            mgr.take_events()
            if i in (399, 1199):
                samples.append(meter.sample())
        assert_flat(samples[0], samples[1], backend, 800)
        mgr.clear_reusable()
        assert mgr.snapshot()["tree"] == []
    finally:
        meter.stop()


# ---------------------------------------------------------------- item 10: pure-ssm commit


def ssm_config(n_blocks: int) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(tokens_per_block=B, layers=[SsmLayer(0, 4)], tiers=[Tier("gpu", 4 * 8)],
                                max_events=0)


def _ssm_commit(backend: str, n_blocks: int, count_attach: bool = False) -> tuple[float, int]:
    mgr = kvcm.KVCacheManager(ssm_config(n_blocks), backend=backend)
    kv = mgr.create_kv_cache(None)
    assert kv.resume() and kv.resize(n_blocks * B)
    calls = [0]
    if count_attach:
        tree = mgr.pool.tree  # the python backend's tree lives in its BlockPool (issue 21)
        attach = tree.attach

        def counted(parent, node):
            calls[0] += 1
            return attach(parent, node)
        tree.attach = counted
    tokens = list(range(n_blocks * B))
    # the thread's CPU time: on a loaded machine a longer call's wall time also counts the
    # time slices other processes ran in (issue 18 item 12 was that artefact)
    t0 = time.thread_time()
    kv.commit(tokens)
    dt = time.thread_time() - t0
    mgr.check_invariants()
    kv.close()
    return dt, calls[0]


def test_pure_ssm_commit_of_many_blocks_is_quadratic(backend: str) -> None:
    """One commit of n pageless pure-ssm blocks (only the last gets a snapshot) does O(n)
    tree work, not O(n^2): each block is attached once, not re-attached per later block."""
    if backend == "python":
        for n in (64, 512):
            _dt, attaches = _ssm_commit(backend, n, count_attach=True)
            assert attaches <= n + 1, f"{attaches} attaches for a commit of {n} blocks"
        return
    small, large = 512, 4096  # 8x the blocks: linear ~8x, quadratic ~64x
    t_small = min(_ssm_commit(backend, small)[0] for _ in range(5))
    t_large = min(_ssm_commit(backend, large)[0] for _ in range(3))
    assert t_large < 24 * max(t_small, 20e-6), f"{small} blocks: {t_small:.5f}s, {large} blocks: {t_large:.5f}s"


def _ssm_commit_calls(n_blocks: int, tail: int, via_input: bool) -> int:
    """Python-level calls (functions and builtins, counted by a profile hook) of one pure-ssm
    commit of ``n_blocks`` full blocks plus ``tail`` tokens, and of the close that inserts
    the tail, on the python backend."""
    import sys

    mgr = kvcm.KVCacheManager(ssm_config(n_blocks), backend="python")
    tokens = [7 * i + 1 for i in range(n_blocks * B + tail)]
    kv = mgr.create_kv_cache(tokens if via_input else None)
    assert kv.resume() and kv.resize(len(tokens))
    calls = [0]

    def hook(_frame, event, _arg) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1
    sys.setprofile(hook)
    try:
        if via_input:
            kv.commit_input()
        else:
            kv.commit(tokens)
        kv.close()
    finally:
        sys.setprofile(None)
    mgr.check_invariants()
    return calls[0]


def test_pure_ssm_commit_calls_per_block_do_not_grow_with_the_commit() -> None:
    """Issue 18 item 12: a block of a long pure-ssm commit costs no more work than a block of
    a short one.  Counted, not timed: every python-level call of the commit (and of the
    close that snapshots a partial tail), 16x the blocks -> at most 16x the calls (the
    quadratic re-attachment of item 10 gave ~245x here).  The cpp backend's instruction
    count per block was checked with callgrind (flat from 1k to 16k blocks); its ratio is
    test_pure_ssm_commit_of_many_blocks_is_quadratic's (thread CPU time).  Always the
    python backend: only it has calls to count."""
    for via_input in (False, True):
        for tail in (0, B - 1):
            small, large = (_ssm_commit_calls(n, tail, via_input) for n in (32, 512))
            assert large <= 16 * small, f"{small} calls for 32 blocks, {large} for 512 (tail {tail}, input {via_input})"


# ---------------------------------------------------------------- item 11: fan-out under one block


def _fanout(backend: str, n: int) -> tuple[int, int]:
    """``n`` continuations of one system block that all start with token 9 (half as full
    blocks, half as partial tails), then the work (``python_work``: lines of kvcm's python
    code executed; the cpp backend's is not visible, 0) of a probe that shares only that
    token with each of them, and of a request whose partial tail [9] is covered by all."""
    cfg = KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 1)], tiers=[Tier("gpu", (n + 16) * B)],
                               max_events=0)
    mgr = kvcm.KVCacheManager(cfg, backend=backend)
    system = [1, 2, 3, 4]
    for i in range(n):
        kv = mgr.create_kv_cache(None)
        assert kv.resume() and kv.resize(8)
        kv.commit(system + [9, 1000 + i] + ([7, 7] if i % 2 else []))
        kv.close()
    query = system + [9, 5, 5, 5]

    def probe() -> None:
        assert mgr.probe_reuse(query) == 5

    def request() -> None:
        kv = mgr.create_kv_cache(None)
        assert kv.resume() and kv.resize(5)
        kv.commit(system + [9])
        kv.close()  # the tail [9] finds its covering sibling among all n

    work = python_work(probe), python_work(request)
    mgr.check_invariants()
    return work


def test_many_continuations_sharing_their_first_token_scan_every_sibling(backend: str) -> None:
    """Partial matching and the covering-sibling search cost the same with 128 or
    thousands of siblings sharing the first token (before: linear in the fan-out).
    Counted on the python backend (32x the siblings, the same work up to 2x); the cpp
    backend runs the same scenario for its outcomes (its search mirrors python's)."""
    large = 16384 if backend == "cpp" else 4096
    p_small, r_small = _fanout(backend, 128)
    p_large, r_large = _fanout(backend, large)
    if backend == "python":
        assert p_large <= 2 * p_small, f"probe: {p_small} lines at 128 siblings, {p_large} at {large}"
        assert r_large <= 2 * r_small, f"request: {r_small} lines at 128 siblings, {r_large} at {large}"
