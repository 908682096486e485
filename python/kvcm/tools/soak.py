"""The fleet soak (issue 18): many requests through publisher + subscriber + router + file store.

``python -m kvcm.tools.soak [--requests 100000] [--backend cpp] [--json out.json]``

N instances (default 2), each a manager whose coldest tier is a **file store** shared by all
of them (one directory, each instance's :class:`~kvcm.dataplane.store.FileStore` enforcing the
byte quota on its own writes), a :class:`~kvcm.dataplane.DataPlane` executing its copy ops,
and an :class:`~kvcm.fleet.publisher.EventPublisher` on 127.0.0.1 sockets (ephemeral ports).  One
:class:`~kvcm.fleet.subscriber.FleetSubscriber` feeds one :class:`~kvcm.fleet.router_index.RouterIndex`
from all of them.  Requests run round-robin over the instances, one at a time, as an engine
drives a manager (``kvcm.tools.fleet_replay``): a batched lookup in the store, create, resume + resize,
chunked prefill (commits ending on block boundaries, so the ssm life cycle snapshots),
a few decode blocks, close, then ``publish(take_events())`` and a non-blocking ``poll``.

Workload: the shipped Mooncake trace (``kvcm/data``), cycled; each trace hash id is one
block of B tokens, the first ``prompt_blocks`` of them (the trace's prefix sharing, at a
size where a request costs milliseconds), the last one cut to leave a partial block; decode
tokens are unique per request (``expand_outputs`` of
the request number), so new blocks arrive for ever and eviction, store writes and the
store's quota trim never stop.  Everything is deterministic (no wall clock in what is
compared or asserted).

Measured (:class:`Sample`, at ``checkpoints`` evenly spaced points, each after the
publishers are flushed and the router has caught up): resident set size
(``/proc/self/statm``), OS threads (``/proc/self/task``), open fds (``/proc/self/fd``),
the store's bytes on disk (apparent size of every file in its directory) and the router's
blocks (keys held, all instances).  :func:`flat_violations` checks the samples after the
warm-up against the bounds stated there.

Exact: every ``check_every`` requests, once the router has caught up, its answer for the
*next* prompt equals the reference of DECISIONS.md "The router's answer and its
exactness contract" on every instance — with ``enable_partial_reuse=False`` (the default
here) that is ``probe_reuse(prompt)`` itself; with partial reuse on, the probe of the
prompt's leading full blocks attached in the instance's tree, counted in whole blocks.  A
mismatch raises :class:`SoakMismatch` at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManager, KVCacheManagerConfig, SsmLayer
from kvcm.engine_loop import EngineLoop, config_from_layout
from kvcm.tools.trace import TraceRequest, expand_outputs, load_trace

OBJECT_HEADER = 88  # kvcm.dataplane.store.HEADER.size (kept here so the module imports no torch)


@dataclass(frozen=True)
class SoakProfile:
    """What one soak runs.  Sizes are in blocks (pages per life cycle) per instance."""

    requests: int = 3000
    instances: int = 2
    tokens_per_block: int = 16
    bytes_per_token: int = 8  # per attention layer
    ssm_state_bytes: int = 256
    window_blocks: int = 4  # the windowed attention life cycle's window, in blocks
    gpu_blocks: int = 96
    host_blocks: int = 96
    store_quota_bytes: int = 2 << 20
    fsync: bool = False  # the file store's fsync of each object and batch (durability, not soaked)
    prompt_blocks: int = 8  # a prompt is at most this many trace hash ids (blocks)
    prefill_chunk_blocks: int = 4
    decode_blocks: int = 1  # plus a partial block of decode_tail tokens
    decode_tail: int = 3
    partial_reuse: bool = False
    buffer_steps: int = 256  # each publisher's replay buffer (batches)
    check_every: int = 25  # exactness check before every this many requests
    checkpoints: int = 8  # samples after the warm-up (plus one at its end)
    warmup: float = 0.25  # fraction of the requests before the first sample
    namespace: str = "kvcm-soak"

    def config(self, store_dir: str) -> KVCacheManagerConfig:
        """The config of one soak instance (attention, sliding window, ssm; gpu, host and a shared
        tier in ``store_dir``)."""
        B = self.tokens_per_block
        layers = [AttentionLayer(0, self.bytes_per_token),
                  AttentionLayer(1, self.bytes_per_token, window=self.window_blocks * B, sink_tokens=B // 2),
                  SsmLayer(2, self.ssm_state_bytes)]
        return config_from_layout(B, layers, gpu_blocks=self.gpu_blocks, host_blocks=self.host_blocks,
                                  shared=store_dir, shared_quota_bytes=self.store_quota_bytes,
                                  shared_namespace=self.namespace, enable_partial_reuse=self.partial_reuse)


@dataclass
class Sample:
    """One checkpoint of the soak: requests so far and what must stay flat (memory, threads,
    fds, store bytes and objects, router blocks)."""

    requests: int
    rss_bytes: int
    threads: int
    fds: int
    store_bytes: int
    store_objects: int
    router_blocks: int
    elapsed_s: float  # reporting only


@dataclass
class SoakResult:
    """The outcome of a soak: its samples, exactness checks, reuse and counters."""

    profile: dict
    backend: str
    samples: list[Sample] = field(default_factory=list)  # the first one: the end of the warm-up
    start: Sample | None = None  # before the first request (reporting only: nothing is warm yet)
    exact_checks: int = 0  # (instance, prompt) comparisons that matched
    reused_tokens: int = 0
    prompt_tokens: int = 0
    shared_hit_blocks: int = 0
    rollbacks: int = 0
    subscriber: dict = field(default_factory=dict)
    publishers: list[dict] = field(default_factory=list)
    planes: dict = field(default_factory=dict)
    wall_s: float = 0.0  # reporting only

    def to_json(self) -> dict:
        """The result as a JSON-ready dict."""
        return asdict(self)


class SoakMismatch(AssertionError):
    """The router's answer differs from the instance's reference."""


def soak_prompt(req: TraceRequest, B: int, max_blocks: int) -> list[int]:
    """One block of ``B`` tokens per trace hash id (the first ``max_blocks`` of them); the
    last block keeps ``1 + input_length % B`` tokens (partial unless that is B)."""
    out: list[int] = []
    for h in req.hash_ids[:max_blocks]:
        out.extend(range(h * B, h * B + B))
    if out:
        del out[len(out) - B + 1 + req.input_length % B:]
    return out


def scratch_dir() -> str | None:
    """Where a soak's store goes by default: ``/dev/shm`` (tmpfs) when writable, so the
    store's files cost no disk I/O on a busy machine (the code paths are the same), else the
    temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def proc_sample() -> tuple[int, int, int]:
    """(resident bytes, OS threads, open fds) of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def dir_bytes(path: str) -> tuple[int, int]:
    """(apparent bytes, files) of a directory's files (files vanishing meanwhile skipped)."""
    total = n = 0
    with os.scandir(path) as it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            total += st.st_size
            n += 1
    return total, n


def reference_reuse(mgr: KVCacheManager, prompt: list[int], keys: Sequence[bytes], B: int) -> int:
    """The router's exactness reference (DECISIONS.md): ``probe_reuse(prompt)`` with partial
    reuse off; else the probe of the leading full blocks attached in the tree, floored."""
    if not mgr.config.enable_partial_reuse:
        return mgr.probe_reuse(prompt)
    attached = {bytes.fromhex(n["key"]) for n in mgr.snapshot()["tree"]
                if n["attached"] and not n["root"] and len(n["tokens"]) == B}
    n = 0
    for k in keys:
        if k not in attached:
            break
        n += 1
    return mgr.probe_reuse(prompt[: n * B]) // B * B


class _Instance:
    def __init__(self, name: int, profile: SoakProfile, config: KVCacheManagerConfig, store_dir: str,
                 backend: str | None, ctx: Any) -> None:
        import torch

        from kvcm.dataplane import DataPlane
        from kvcm.dataplane.store import FileStore
        from kvcm.fleet.publisher import EventPublisher

        self.name = name
        self.mgr = KVCacheManager(config, backend=backend)
        self.store = FileStore(store_dir, profile.store_quota_bytes, fsync=profile.fsync)
        self.plane = DataPlane(config, store=self.store, dtype=torch.uint8)
        self.pub = EventPublisher(self.mgr, buffer_steps=profile.buffer_steps, context=ctx)
        self.loop = EngineLoop(self.mgr, self.plane)  # admission and copies (kvcm.engine_loop)

    def close(self) -> None:
        self.pub.close()
        self.plane.close()
        self.store.close()
        self.mgr.shutdown()


def _request(inst: _Instance, prompt: list[int], outputs: list[int], profile: SoakProfile, res: SoakResult) -> None:
    loop, B = inst.loop, profile.tokens_per_block
    res.prompt_tokens += len(prompt)
    # lookup, create, resume + resize, copies; a failed load rolls the request back and the
    # loop resumes it again (it recomputes the rest); no room: closed, skipped
    kv = loop.admit(prompt, capacity=len(prompt) + len(outputs))
    if kv is None:
        return
    res.reused_tokens += kv.num_committed_tokens
    chunk = profile.prefill_chunk_blocks * B
    n = kv.num_committed_tokens
    while n < len(prompt):  # chunked prefill: chunks end on block boundaries (ssm snapshots)
        end = min(len(prompt), (n // chunk + 1) * chunk)
        kv.commit(prompt[n:end])
        loop.sync()
        n = end
    for i in range(0, len(outputs), B):  # decode a block at a time
        kv.commit(outputs[i:i + B])
        loop.sync()
    kv.close()
    loop.sync()


def run_soak(profile: SoakProfile, *, backend: str | None = None, trace: Sequence[TraceRequest] | None = None,
             store_dir: str | None = None, progress: Callable[[Sample], None] | None = None) -> SoakResult:
    """Run ``profile``; raises :class:`SoakMismatch` on the first inexact router answer."""
    import zmq

    from kvcm.fleet.router_index import RouterIndex, RouterModel
    from kvcm.fleet.subscriber import FleetSubscriber

    if profile.requests < 1 or profile.instances < 1 or profile.checkpoints < 1 or profile.check_every < 1:
        raise ValueError(f"a soak needs requests, instances, checkpoints and check_every >= 1: {profile}")
    trace = list(trace if trace is not None else load_trace())
    B = profile.tokens_per_block
    own_dir = store_dir is None
    store_dir = store_dir or tempfile.mkdtemp(prefix="kvcm-soak-store-", dir=scratch_dir())
    os.makedirs(store_dir, mode=0o700, exist_ok=True)
    config = profile.config(store_dir)
    ctx = zmq.Context()
    insts: list[_Instance] = []
    sub = None
    res = SoakResult(asdict(profile), "")
    warm = max(1, int(profile.requests * profile.warmup))
    span = profile.requests - warm
    at = {warm + span * k // profile.checkpoints for k in range(profile.checkpoints + 1)}  # the last: the end
    t0 = time.perf_counter()
    try:
        insts = [_Instance(i, profile, config, store_dir, backend, ctx) for i in range(profile.instances)]
        res.backend = insts[0].mgr.backend_name
        router = RouterIndex(RouterModel.from_config(config))
        sub = FleetSubscriber(router, {i.name: (i.pub.endpoint, i.pub.replay_endpoint) for i in insts},
                              context=ctx, timeout=10.0)

        def catch_up() -> None:
            for i in insts:
                if not i.pub.flush(10.0):
                    raise TimeoutError(f"publisher {i.name} did not flush")
            sub.sync({i.name: i.pub.next_seq for i in insts}, timeout=10.0)

        def sample(r: int) -> Sample:
            catch_up()
            gc.collect()
            rss, threads, fds = proc_sample()
            nbytes, nfiles = dir_bytes(store_dir)
            s = Sample(r, rss, threads, fds, nbytes, nfiles,
                       sum(len(ix.blocks) for ix in router.instances.values()), time.perf_counter() - t0)
            if progress is not None:
                progress(s)
            return s

        res.start = sample(0)
        for r in range(profile.requests + 1):
            if r in at:
                res.samples.append(sample(r))
            if r == profile.requests:
                break
            req = trace[r % len(trace)]
            prompt = soak_prompt(req, B, profile.prompt_blocks)
            if r % profile.check_every == 0 and r:
                catch_up()
                keys = router.keys(prompt)
                for i in insts:
                    got, want = router.reuse(i.name, prompt), reference_reuse(i.mgr, prompt, keys, B)
                    if got != want:
                        raise SoakMismatch(f"request {r}, instance {i.name}: router {got} != reference {want} "
                                           f"({i.mgr.probe_reuse_detail(prompt)})")
                    res.exact_checks += 1
            inst = insts[r % len(insts)]
            outputs = expand_outputs(r, profile.decode_blocks * B + profile.decode_tail)
            _request(inst, prompt, outputs, profile, res)
            inst.pub.publish(inst.mgr.take_events())
            sub.poll(0)
        for i in insts:
            i.mgr.check_invariants()
            res.rollbacks += i.loop.counters["rollbacks"]
            res.shared_hit_blocks += sum(lc.get("shared_hit_blocks", 0) for lc in i.mgr.stats()["lc"])
        res.subscriber = sub.stats()
        res.publishers = [{"published": i.pub.published, "dropped": i.pub.dropped, "resets": i.pub.resets,
                           "replays_served": i.pub.replays_served, "snapshots_served": i.pub.snapshots_served}
                          for i in insts]
        for i in insts:
            for k, v in i.plane.shared_stats.items():
                res.planes[k] = res.planes.get(k, 0) + v
    finally:
        res.wall_s = time.perf_counter() - t0
        if sub is not None:
            sub.close()
        for i in insts:
            i.close()
        ctx.destroy(linger=0)
        if own_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
    return res


# The bounds a soak's samples after the warm-up must keep (flat_violations).  Each is stated
# against what a leak of the kind it catches would add.
RSS_SLACK_BYTES = 16 << 20  # allocator and cache noise; a leak of 1 KB/request over 10**5 requests is 100 MB
THREAD_SLACK = 2  # a store call's worker thread may still be exiting when sampled (SharedIO._call)
FD_SLACK = 0  # every file the store opens is closed before its call returns
STORE_BATCH_SLACK = 64 << 10  # per writer: one request's store batch past a rescan (~10-30 objects here)
ROUTER_SLACK = 0.10


def flat_violations(res: SoakResult, *, rss_slack: int = RSS_SLACK_BYTES) -> list[str]:
    """What grew past its bound between the first sample (the end of the warm-up) and any
    later one.  RSS, threads and fds: at most their slack above the first sample; the
    store's bytes: the file store's bound for N writers (DECISIONS.md), ``quota * (1 + N /
    10)`` plus a batch each, at every sample; router blocks: at most the instances' local pages
    (a block stays attached only while it has a page or a child with one, and pages are
    bounded by the tiers' quotas), and within ``ROUTER_SLACK`` of the largest count seen
    in the first half after the warm-up."""
    p = res.profile
    s0, rest = res.samples[0], res.samples[1:]
    out: list[str] = []
    cap_blocks = p["instances"] * 3 * (p["gpu_blocks"] + p["host_blocks"])
    store_cap = int(p["store_quota_bytes"] * (1 + p["instances"] / 10)) + p["instances"] * STORE_BATCH_SLACK
    first_half = res.samples[: max(1, len(res.samples) // 2)]
    early_router = max(s.router_blocks for s in first_half)
    for s in rest:
        if s.rss_bytes > s0.rss_bytes + rss_slack:
            out.append(f"rss grew {s0.rss_bytes} -> {s.rss_bytes} bytes by request {s.requests}")
        if s.threads > s0.threads + THREAD_SLACK:
            out.append(f"threads grew {s0.threads} -> {s.threads} by request {s.requests}")
        if s.fds > s0.fds + FD_SLACK:
            out.append(f"fds grew {s0.fds} -> {s.fds} by request {s.requests}")
    for s in res.samples:
        if s.store_bytes > store_cap:
            out.append(f"store holds {s.store_bytes} bytes at request {s.requests} (quota {p['store_quota_bytes']}, "
                       f"{p['instances']} writers: at most {store_cap})")
        if s.router_blocks > cap_blocks:
            out.append(f"router holds {s.router_blocks} blocks at request {s.requests} (local pages {cap_blocks})")
        if s.router_blocks > early_router * (1 + ROUTER_SLACK) + 16:
            out.append(f"router blocks grew {early_router} -> {s.router_blocks} by request {s.requests}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm.tools.soak``: exit status 0 when everything stayed flat, 1 otherwise."""
    ap = argparse.ArgumentParser(prog="python -m kvcm.tools.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--instances", type=int, default=SoakProfile.instances)
    ap.add_argument("--backend", default=None, help="python | cpp (default: KVCM_BACKEND)")
    ap.add_argument("--checkpoints", type=int, default=20)
    ap.add_argument("--check-every", type=int, default=SoakProfile.check_every)
    ap.add_argument("--fsync", action="store_true", help="the file store fsyncs each object")
    ap.add_argument("--partial-reuse", action="store_true")
    ap.add_argument("--store-dir", default=None,
                    help="(default: a temporary directory in /dev/shm if writable, removed after)")
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    profile = SoakProfile(requests=a.requests, instances=a.instances, checkpoints=a.checkpoints,
                          check_every=a.check_every, fsync=a.fsync, partial_reuse=a.partial_reuse)

    def show(s: Sample) -> None:
        print(f"{s.requests:>8} req  {s.elapsed_s:8.1f} s  rss {s.rss_bytes / 2**20:7.1f} MiB  threads {s.threads:3}"
              f"  fds {s.fds:4}  store {s.store_bytes / 2**20:6.2f} MiB ({s.store_objects} files)"
              f"  router blocks {s.router_blocks}", flush=True)

    res = run_soak(profile, backend=a.backend, store_dir=a.store_dir, progress=show)
    bad = flat_violations(res)
    print(f"backend {res.backend}: {profile.requests} requests in {res.wall_s:.1f} s, {res.exact_checks} exact "
          f"checks, reuse {res.reused_tokens / max(1, res.prompt_tokens):.1%}, shared hit blocks "
          f"{res.shared_hit_blocks}, rollbacks {res.rollbacks}")
    print("subscriber:", json.dumps({k: v for k, v in res.subscriber.items() if k != "instances"}))
    print("flat:", "yes" if not bad else "; ".join(bad))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res.to_json(), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
