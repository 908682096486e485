"""A tiny reference inference engine that drives kvcm with real K/V data (SPEC sec. 14).

It exists to prove that reuse is *exact*: generating through the manager — reusing cached
prefixes, copying partial blocks and ssm snapshots on write, offloading to host/disk and
onboarding back, suspending and resuming requests — gives the same tokens, and logits within
float32 round-off, as a plain run of the same model with no cache at all
(:meth:`TinyHybridModel.reference_generate`).

The model (:class:`TinyHybridModel`, float32, random weights from a fixed seed)::

    layer 0  full attention                  life cycle 0  (shared with layer 3)
    layer 1  sliding window 48, 4 sinks      life cycle 1
    layer 2  ssm: gated linear recurrence    life cycle 2
    layer 3  full attention                  life cycle 0

Attention layers store K/V per token (RoPE already applied to K) in the data plane's pages
and read them back through ``page_indices``.  The windowed layer attends to exactly the
sinks and the last ``window`` positions (query at ``p`` sees keys ``< sinks`` and
``> p - window``), i.e. never to a block the manager calls stale (sec. 7).  The ssm layer
keeps its live state ``h[d_model, d_state]`` in the request's ssm slot;
``h_p = a_p * h_{p-1} + u_p b_p^T`` so the state after position ``p`` fully determines the
future.  A reused prefix's state comes from a snapshot, copied into the live slot by the
manager's ``cow`` op; a request with nothing reused starts from zeros.

The engine loop (:meth:`Engine.generate`): create (matching all but the last prompt token,
whose logits must be computed to sample) → resume → apply ops → prefill only the unreused
suffix, committing in chunks that end on block boundaries (so every block gets an
ssm snapshot) → decode (resize +1, apply, write, commit 1) → close; requests are admitted
FCFS up to ``max_batch`` and, when the gpu quota runs out while growing, the most recently
admitted running request is suspended (its pages become HELD and may be offloaded) and
resumed later (suspending frees gpu slots only through a colder tier: with a gpu-only config
a request that cannot grow raises RuntimeError).  Copy ops are applied right after every manager call that can emit them, so
they always run before the step that uses the new page indices.

Failed copies (SPEC sec. 15): when ``DataPlane.apply_runs`` (the manager's ``drain_copy_runs``) raises ``CopyError`` (a disk I/O
error, a checksum mismatch, ...), :meth:`Engine.sync` reports its ops with
``forget_copies``; each request the manager rolled back (now SUSPENDED, with fewer committed
tokens) is taken out of the running batch and admitted again later, recomputing the K/V of
its prompt and of the tokens it already generated from its new committed length (the
tokens and logits it already produced were computed from verified bytes and are kept).

The shared tier (DECISIONS.md "The shared tier"): with a ``Tier("shared", ...)`` the engine
asks the manager for ``shared_candidates`` of each new request, the data plane for the ones
its store holds (one batched query: :meth:`DataPlane.shared_lookup`), and passes them as
``create_kv_cache(..., shared_hits=...)``; the pages come in as ``onboard`` ops from tier 3
on ``resume`` and are verified on load.  A load that fails is a ``CopyError`` like a disk
fault (the request rolls back and recomputes); a failed ``store`` op loses nothing.  Run as
``python -m kvcm.engine`` (see :func:`main`), several processes pointed at one store reuse
each other's prefill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import AttentionLayer, CopyError, KVCacheManagerConfig, ReuseScope, SsmLayer, Tier
from kvcm.dataplane import DataPlane
from kvcm.tools.cmdline import backend_arg, int_in, oplog_unusable, torch_missing, writable_file


class QuotaTooSmallError(RuntimeError):
    """The gpu tier cannot hold even one request of the workload (a usage error)."""


def _torch():
    import torch

    return torch


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """Run with ``n`` torch intra-op threads (restored after).  The model's tensors are
    tiny: on a busy 2-core machine, spinning OpenMP workers made each op ~30x slower
    (multi-turn workload: 11.2 s with 2 threads, 0.35 s with 1), so the tests and the demo
    use one."""
    torch = _torch()
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_device() -> str:
    """``KVCM_ENGINE_DEVICE`` (e.g. ``cuda``), else ``cpu``."""
    return os.environ.get("KVCM_ENGINE_DEVICE", "cpu")


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 32
    heads: int = 2
    head_dim: int = 16
    window: int = 48
    sinks: int = 4
    d_state: int = 8
    seed: int = 20261129


LAYER_KINDS = ("full", "window", "ssm", "full")


class TinyHybridModel:
    """Deterministic 4-layer hybrid model; see the module docstring."""

    def __init__(self, cfg: ModelConfig | None = None, device: Any = None) -> None:
        torch = _torch()
        self.cfg = cfg = cfg or ModelConfig()
        self.device = torch.device(device if device is not None else default_device())
        g = torch.Generator().manual_seed(cfg.seed)
        d, hd, n = cfg.d_model, cfg.heads * cfg.head_dim, cfg.d_state

        def w(*shape: int, scale: float | None = None):
            t = torch.randn(*shape, generator=g, dtype=torch.float32)
            return (t * (shape[0] ** -0.5 if scale is None else scale)).to(self.device)

        self.embed = w(cfg.vocab, d, scale=1.0)
        self.layers: list[tuple[str, dict]] = []
        for kind in LAYER_KINDS:
            if kind == "ssm":
                p = {"u": w(d, d), "a": w(d, d), "b": w(d, n), "c": w(d, n), "o": w(d, d)}
            else:
                p = {"q": w(d, hd), "k": w(d, hd), "v": w(d, hd), "o": w(hd, d)}
            self.layers.append((kind, p))
        self.unembed = w(d, cfg.vocab, scale=2.0 * d**-0.5)
        half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        self.inv_freq = (1.0 / (10000.0**half)).to(self.device)

    # ------------------------------------------------------------------ kvcm config

    def layer_specs(self) -> list[AttentionLayer | SsmLayer]:
        c = self.cfg
        kv_bytes = 2 * c.heads * c.head_dim * 4  # K and V, float32
        out: list[AttentionLayer | SsmLayer] = []
        for i, kind in enumerate(LAYER_KINDS):
            if kind == "full":
                out.append(AttentionLayer(i, kv_bytes))
            elif kind == "window":
                out.append(AttentionLayer(i, kv_bytes, window=c.window, sink_tokens=c.sinks))
            else:
                out.append(SsmLayer(i, c.d_model * c.d_state * 4))
        return out

    def plane_shapes(self) -> dict[int, tuple[int, ...]]:
        c = self.cfg
        return {
            i: (c.d_model, c.d_state) if kind == "ssm" else (2, c.heads, c.head_dim)
            for i, kind in enumerate(LAYER_KINDS)
        }

    def manager_config(self, tokens_per_block: int, gpu_slots: int, host_slots: int | None = None,
                       disk_slots: int | None = None, disk_path: str | None = None, shared: str | None = None,
                       shared_quota_bytes: int = 0, **kw: Any) -> KVCacheManagerConfig:
        """A config whose tiers hold the given number of slots per life cycle; ``shared``: a
        shared tier's store (a directory, ``file://``, ``mooncake://``), listed last."""
        B = tokens_per_block
        layers = self.layer_specs()
        per_slot = sum(l.bytes_per_token * B if isinstance(l, AttentionLayer) else l.state_bytes for l in layers)
        tiers = [Tier("gpu", gpu_slots * per_slot)]
        if host_slots:
            tiers.append(Tier("host", host_slots * per_slot))
        if disk_slots:
            tiers.append(Tier("disk", disk_slots * per_slot, path=disk_path))
        if shared:
            tiers.append(Tier("shared", shared_quota_bytes, path=shared))
        return KVCacheManagerConfig(tokens_per_block=B, layers=layers, tiers=tiers, **kw)

    # ------------------------------------------------------------------ building blocks

    @staticmethod
    def _norm(x):
        return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()

    def _rope(self, x, pos):
        torch = _torch()
        ang = pos[:, None].to(torch.float32) * self.inv_freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

    def _qkv(self, p: dict, h, pos):
        c = self.cfg
        shape = (h.shape[0], c.heads, c.head_dim)
        q = self._rope((h @ p["q"]).view(shape), pos)
        k = self._rope((h @ p["k"]).view(shape), pos)
        return q, k, (h @ p["v"]).view(shape)

    def _attend(self, p: dict, kind: str, q, k, v, qpos, kpos):
        """Causal attention of queries at ``qpos`` over keys at ``kpos``; the windowed
        layer sees exactly the sinks and the last ``window`` positions."""
        torch = _torch()
        c = self.cfg
        scores = torch.einsum("thd,nhd->htn", q, k) / math.sqrt(c.head_dim)
        allowed = kpos[None, :] <= qpos[:, None]
        if kind == "window":
            allowed &= (kpos[None, :] < c.sinks) | (kpos[None, :] > qpos[:, None] - c.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("htn,nhd->thd", scores.softmax(-1), v)
        return out.reshape(q.shape[0], -1) @ p["o"]

    @staticmethod
    def _ssm(p: dict, h, state):
        """Run the recurrence over ``h`` from ``state``; returns (outputs, final state)."""
        torch = _torch()
        u, a = h @ p["u"], torch.sigmoid(h @ p["a"] + 2.0)
        b, c = h @ p["b"], h @ p["c"]
        ys = []
        for t in range(h.shape[0]):
            state = a[t, :, None] * state + u[t, :, None] * b[t, None, :]
            ys.append(state @ c[t])
        return torch.stack(ys) @ p["o"], state

    # ------------------------------------------------------------------ no-cache forward

    def forward_dense(self, tokens: Sequence[int]):
        """Logits ``[len(tokens), vocab]`` computed from scratch (no cache)."""
        torch = _torch()
        c = self.cfg
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        pos = torch.arange(len(ids), device=self.device)
        x = self.embed[ids]
        for kind, p in self.layers:
            h = self._norm(x)
            if kind == "ssm":
                y, _ = self._ssm(p, h, torch.zeros(c.d_model, c.d_state, device=self.device))
            else:
                q, k, v = self._qkv(p, h, pos)
                y = self._attend(p, kind, q, k, v, pos, pos)
            x = x + y
        return self._norm(x) @ self.unembed

    def reference_generate(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], Any]:
        """Greedy generation with no cache: every step recomputes the whole sequence.
        Returns (tokens, logits ``[max_new_tokens, vocab]`` on cpu)."""
        torch = _torch()
        seq, out, logits = list(prompt), [], []
        for _ in range(max_new_tokens):
            last = self.forward_dense(seq)[-1].cpu()
            out.append(int(last.argmax()))
            logits.append(last)
            seq.append(out[-1])
        return out, torch.stack(logits)

    def reference_logits(self, prompt: Sequence[int], output: Sequence[int]):
        """No-cache logits ``[len(output), vocab]`` (cpu) that predicted each of ``output``
        after ``prompt``: one dense forward over ``prompt + output[:-1]``.  Greedy decoding
        is a function of the sequence so far, so ``output`` equals
        :meth:`reference_generate` ``(prompt, len(output))`` exactly when each row's argmax
        is the corresponding token — the same check, one forward instead of ``len(output)``."""
        seq = list(prompt) + list(output[:-1])
        return self.forward_dense(seq)[len(prompt) - 1:].cpu()

    # ------------------------------------------------------------------ paged forward

    def forward_paged(self, tokens: Sequence[int], start: int, plane: DataPlane, pages: dict[int, Any],
                      ssm_slot: int):
        """Logits for ``tokens`` at positions ``start..``: writes their K/V into the pages
        (``pages[lc]``: the request's gpu page index per block, a long tensor) and advances
        the live ssm state in ``ssm_slot``; reads earlier K/V through the page indices."""
        torch = _torch()
        B = plane.B
        end = start + len(tokens)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        pos = torch.arange(start, end, device=self.device)
        x = self.embed[ids]
        for layer_id, (kind, p) in enumerate(self.layers):
            h = self._norm(x)
            if kind == "ssm":
                live = plane.state(layer_id)[ssm_slot]
                y, new_state = self._ssm(p, h, live)
                live.copy_(new_state)
            else:
                q, k, v = self._qkv(p, h, pos)
                kv = plane.kv(layer_id)
                idx = pages[plane.lc_of(layer_id)]
                slots = idx[pos // B]
                if bool((slots < 0).any()):
                    raise RuntimeError(f"layer {layer_id}: no page to write positions {start}..{end - 1}")
                kv[slots, pos % B] = torch.stack((k, v), 1)
                kpos = self._key_positions(kind, start, end)
                kslots = idx[kpos // B]
                if bool((kslots < 0).any()):
                    raise RuntimeError(f"layer {layer_id}: a needed block is stale or absent")
                kvs = kv[kslots, kpos % B]
                y = self._attend(p, kind, q, kvs[:, 0], kvs[:, 1], pos, kpos)
            x = x + y
        return self._norm(x) @ self.unembed

    def _key_positions(self, kind: str, start: int, end: int):
        """Positions queries ``start..end-1`` attend to: all, or sinks + window."""
        torch = _torch()
        lo = start - self.cfg.window + 1
        if kind != "window" or lo <= self.cfg.sinks:
            return torch.arange(0, end, device=self.device)
        return torch.cat((torch.arange(0, self.cfg.sinks, device=self.device),
                          torch.arange(lo, end, device=self.device)))


# ---------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    scope: ReuseScope | None = None
    output: list[int] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)  # one [vocab] cpu tensor per output token
    reused_tokens: int = 0
    shared_hits: int = 0  # (key, lc) pairs the shared store held when the request was created
    preemptions: int = 0
    kv: Any = None
    started: bool = False  # prefilled: its K/V covers prompt + output[:-1]
    rolled_back: bool = False  # the manager rolled it back (failed copies); not handled yet
    rollbacks: int = 0

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class Engine:
    """Greedy batched generation through a kvcm manager and a :class:`DataPlane`."""

    def __init__(self, model: TinyHybridModel, manager: Any, plane: DataPlane | None = None, *,
                 max_batch: int = 4, chunk_blocks: int = 1) -> None:
        self.model = model
        self.mgr = manager
        self.plane = plane or DataPlane(manager.config, device=model.device, shapes=model.plane_shapes())
        self.B = manager.config.tokens_per_block
        self.max_batch = max_batch
        self.chunk = chunk_blocks * self.B  # prefill chunks end on multiples of this
        lcs = self.plane.life_cycles
        self.attn_lcs = [lc.id for lc in lcs if lc.kind == "attn"]
        self.ssm_lc = next((lc.id for lc in lcs if lc.kind == "ssm"), None)
        self.ssm_layers = [i for i, (kind, _) in enumerate(model.layers) if kind == "ssm"]
        self.counters = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "prefill_tokens": 0,
                         "decode_steps": 0, "preemptions": 0, "resume_failures": 0,
                         "max_stale_blocks": 0,  # most -1 (stale) entries seen in one windowed page table
                         "copy_failures": 0, "rollbacks": 0, "recomputed_tokens": 0,
                         "shared_hits": 0}  # (key, lc) pairs found in the shared store
        self._by_id: dict[Any, Request] = {}  # open request by its cache id

    def sync(self) -> None:
        """Execute the manager's pending copy ops (before any page index is used).  Ops that
        did not complete are reported to the manager; the requests it rolls back are
        flagged (``rolled_back``) and recomputed by the scheduler."""
        try:
            self.plane.apply_runs(self.mgr.drain_copy_runs())
        except CopyError as e:
            self.counters["copy_failures"] += 1
            for cache_id in self.mgr.forget_copies(e.ops):
                self.counters["rollbacks"] += 1
                r = self._by_id.get(cache_id)
                if r is not None:  # (a cache of this manager that is not the engine's)
                    r.rolled_back = True
                    r.rollbacks += 1

    def close(self) -> None:
        self.plane.close()

    # ------------------------------------------------------------------ scheduling

    def generate(self, requests: Sequence[Request]) -> list[Request]:
        waiting: deque[Request] = deque(requests)
        running: list[Request] = []
        while waiting or running:
            self._requeue_rolled_back(running, waiting)
            while waiting and len(running) < self.max_batch and self._admit(waiting[0]):
                r = waiting.popleft()
                if r.done:
                    self._finish(r)
                else:
                    running.append(r)
            if not running:
                raise QuotaTooSmallError("the gpu quota cannot hold even one request")
            for r in running.copy():  # grow by one token, preempting the newest on failure
                while r in running and not r.rolled_back and not r.kv.resize(r.kv.capacity + 1):
                    if len(running) == 1 or len(self.plane.tier_kinds) == 1:
                        raise RuntimeError("gpu quota exhausted and nothing can be preempted")
                    self._preempt(running.pop(), waiting)
                self.sync()
            self._requeue_rolled_back(running, waiting)
            for r in running.copy():
                if r.rolled_back:  # by an earlier request's step: handled next round
                    continue
                self._decode(r)
                if r.done and not r.rolled_back:
                    running.remove(r)
                    self._finish(r)
        return list(requests)

    def _requeue_rolled_back(self, running: list[Request], waiting: deque[Request]) -> None:
        """Requests the manager rolled back are SUSPENDED with fewer committed tokens: they
        wait to be admitted again and recompute from there."""
        for r in running.copy():
            if r.rolled_back:
                running.remove(r)
                waiting.appendleft(r)
        for r in waiting:
            if r.rolled_back:
                r.rolled_back = False
                r.started = False

    def _admit(self, r: Request) -> bool:
        kv = r.kv
        if kv is None:
            # match all but the last prompt token: its logits must be computed to sample
            kv = r.kv = self._create(r)
            self._by_id[kv.id] = r
            r.reused_tokens = kv.num_reused_tokens
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(r.prompt)
            self.counters["reused_tokens"] += r.reused_tokens
        while True:  # again after each roll-back of this request during its admission
            r.rolled_back = False
            r.started = r.started and kv.num_committed_tokens == self._kv_target(r)
            if not kv.resume():
                self.counters["resume_failures"] += 1
                return False
            self.sync()
            if r.rolled_back:
                continue
            if r.started:
                return True
            if not kv.resize(self._kv_target(r)):
                kv.suspend()
                self.sync()
                self.counters["resume_failures"] += 1
                return False
            self.sync()
            if r.rolled_back:
                continue
            if kv.num_committed_tokens == 0 and self.ssm_lc is not None:  # no snapshot: start from zeros
                slot = kv.page_indices(self.ssm_lc)[0]
                for layer_id in self.ssm_layers:
                    self.plane.state(layer_id)[slot].zero_()
            if not self._prefill(r):
                continue
            r.started = True
            return True

    def _create(self, r: Request) -> Any:
        """``create_kv_cache``; with a shared tier, the blocks past the local match are
        looked up in the store first (one batched query) and the present ones handed over."""
        tokens = r.prompt[:-1]
        if self.plane.shared is None:
            return self.mgr.create_kv_cache(tokens, r.scope)
        hits = self.plane.shared_lookup(self.mgr.shared_candidates(tokens, r.scope))
        r.shared_hits = len(hits)
        self.counters["shared_hits"] += len(hits)
        return self.mgr.create_kv_cache(tokens, r.scope, shared_hits=hits)

    @staticmethod
    def _kv_target(r: Request) -> int:
        """Tokens whose K/V a started request holds: the prompt and every generated token
        but the last (the next decode step's input)."""
        return len(r.prompt) + max(len(r.output) - 1, 0)

    def _preempt(self, r: Request, waiting: deque[Request]) -> None:
        if not r.rolled_back:  # a rolled-back request is SUSPENDED already
            r.kv.suspend()
            self.sync()
        r.preemptions += 1
        self.counters["preemptions"] += 1
        waiting.appendleft(r)

    def _finish(self, r: Request) -> None:
        r.kv.close()  # commits the partial tail + its ssm snapshot: a copy op
        self._by_id.pop(r.kv.id, None)
        self.sync()

    # ------------------------------------------------------------------ model steps

    def _forward(self, r: Request, tokens: Sequence[int], start: int):
        torch = _torch()
        kv = r.kv
        pages = {}
        for lc in self.attn_lcs:
            idx = kv.page_indices(lc)
            if self.plane.life_cycles[lc].window is not None:
                stale = sum(1 for i in idx[:kv.num_committed_tokens // self.B] if i < 0)
                self.counters["max_stale_blocks"] = max(self.counters["max_stale_blocks"], stale)
            pages[lc] = torch.tensor(idx, dtype=torch.long, device=self.model.device)
        slot = kv.page_indices(self.ssm_lc)[0] if self.ssm_lc is not None else -1
        return self.model.forward_paged(tokens, start, self.plane, pages, slot)

    def _prefill(self, r: Request) -> bool:
        """Compute the K/V of ``prompt + output[:-1]`` from the committed length on (the
        whole unreused prompt, or what a roll-back dropped), then sample the first output
        token if there is none yet.  False: the request was rolled back meanwhile."""
        kv = r.kv
        seq = r.prompt + r.output
        n = self._kv_target(r)
        c = kv.num_committed_tokens
        self.counters["prefill_tokens" if not r.rollbacks else "recomputed_tokens"] += n - c
        logits = None
        while c < n:
            e = min(n, (c // self.chunk + 1) * self.chunk)
            logits = self._forward(r, seq[c:e], c)
            kv.commit(seq[c:e])  # ends on a block boundary: an ssm snapshot (copy op)
            self.sync()
            if r.rolled_back:
                return False
            c = e
        if not r.output:
            last = logits[-1].cpu()
            r.output.append(int(last.argmax()))
            r.logits.append(last)
        return True

    def _decode(self, r: Request) -> None:
        kv = r.kv
        tok = r.output[-1]
        logits = self._forward(r, [tok], kv.num_committed_tokens)
        kv.commit([tok])
        last = logits[-1].cpu()  # computed from verified bytes: kept even if the sync fails
        r.output.append(int(last.argmax()))
        r.logits.append(last)
        self.counters["decode_steps"] += 1
        self.sync()


# ---------------------------------------------------------------------------------------
# Beam search: forks and closes (issue 22, SPEC sec. 18)
# ---------------------------------------------------------------------------------------


@dataclass
class Beam:
    """One hypothesis: ``seq`` = prompt + generated tokens; the K/V (and the ssm state) of
    ``seq[:-1]`` are in its cache, the last token is the next step's input."""

    seq: list[int]
    score: float  # sum of the log-probabilities of the generated tokens
    kv: Any = None  # its KVCache (None in the no-cache reference)


def _select(beams: Sequence[Beam], logps: Sequence[Any], width: int) -> list[tuple[int, int, float]]:
    """The ``width`` best ``(parent, token, score)`` extensions of ``beams`` by score; ties
    by parent index, then token (deterministic, the same in both runs)."""
    cands = []
    for i, (b, lp) in enumerate(zip(beams, logps)):
        top = lp.topk(width)
        cands.extend((b.score + float(v), i, int(t)) for v, t in zip(top.values, top.indices))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(i, t, sc) for sc, i, t in cands[:width]]


def reference_beam_search(model: TinyHybridModel, prompt: Sequence[int], width: int, steps: int) -> list[Beam]:
    """Beam search with no cache: every step recomputes each beam's whole sequence."""
    beams = [Beam(list(prompt), 0.0)]
    for _ in range(steps):
        logps = [model.forward_dense(b.seq)[-1].cpu().log_softmax(-1) for b in beams]
        beams = [Beam(beams[i].seq + [t], sc) for i, t, sc in _select(beams, logps, width)]
    return beams


def beam_search(model: TinyHybridModel, manager: Any, prompt: Sequence[int], width: int, steps: int, *,
                plane: DataPlane | None = None, suspend_between_steps: bool = False) -> list[Beam]:
    """Beam search through kvcm: the prompt is prefilled once; each step every beam writes
    its last token (``resize`` by one: a partial page it shares with a sibling is copied
    first, a ``cow`` op), the best ``width`` extensions are kept, a parent continues as
    its first kept child and is ``fork``-ed for the others, and a parent with no kept
    child is closed (pruned).  ``suspend_between_steps``: every beam is suspended after
    its step and resumed for the next (its shared pages may be offloaded meanwhile).
    Returns the beams (their caches closed) in the order of :func:`reference_beam_search`."""
    engine = Engine(model, manager, plane)
    B = engine.B
    prompt = list(prompt)
    kv = manager.create_kv_cache(prompt[:-1])
    if not kv.resume() or not kv.resize(len(prompt) - 1):
        raise RuntimeError("the gpu quota cannot hold the prompt")
    engine.sync()
    if kv.num_committed_tokens == 0 and engine.ssm_lc is not None:  # no snapshot: start from zeros
        slot = kv.page_indices(engine.ssm_lc)[0]
        for layer_id in engine.ssm_layers:
            engine.plane.state(layer_id)[slot].zero_()
    r = Request(prompt, 0)
    r.kv = kv
    c = kv.num_committed_tokens
    while c < len(prompt) - 1:  # prefill in chunks ending on block boundaries (ssm snapshots)
        e = min(len(prompt) - 1, (c // B + 1) * B)
        engine._forward(r, prompt[c:e], c)
        kv.commit(prompt[c:e])
        engine.sync()
        c = e
    beams = [Beam(prompt, 0.0, kv)]
    for _ in range(steps):
        logps = []
        for b in beams:
            if b.kv.status.name == "SUSPENDED" and not b.kv.resume():
                raise RuntimeError("the gpu quota cannot hold one beam")
            if not b.kv.resize(len(b.seq)):
                raise RuntimeError("the gpu quota cannot grow one beam")
            engine.sync()  # the copy-on-write of a shared partial page runs before the write
            r.kv = b.kv
            logits = engine._forward(r, b.seq[-1:], len(b.seq) - 1)
            b.kv.commit(b.seq[-1:])
            engine.sync()
            logps.append(logits[-1].cpu().log_softmax(-1))
            if suspend_between_steps:
                b.kv.suspend()
                engine.sync()
        chosen = _select(beams, logps, width)
        kept: set[int] = set()
        nxt = []
        for i, t, sc in chosen:
            parent = beams[i]
            if i in kept:  # a second child: a branch of the parent's cache
                if parent.kv.status.name == "SUSPENDED" and not parent.kv.resume():
                    raise RuntimeError("the gpu quota cannot hold one beam")
                child = parent.kv.fork()
                engine.sync()  # an ssm fork's live state is a copy op
                if suspend_between_steps:
                    child.suspend()
                    engine.sync()
            else:
                kept.add(i)
                child = parent.kv
            nxt.append(Beam(parent.seq + [t], sc, child))
        for i, b in enumerate(beams):
            if suspend_between_steps and b.kv.status.name == "ACTIVE":
                b.kv.suspend()
                engine.sync()
            if i not in kept:
                b.kv.close()  # pruned
                engine.sync()
        beams = nxt
    for b in beams:
        b.kv.close()
        engine.sync()
    engine.close()
    return beams


# ---------------------------------------------------------------------------------------
# Workloads and the exactness check (shared by the tests and the demo)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """``waves`` of turns: conversation ``i``'s turn ``t`` prompt is the system prompt,
    then each earlier turn's user tokens and the model's answer, then its own user tokens.
    All conversations' turn ``t`` run as one batch."""

    name: str
    system: tuple[int, ...]
    conversations: tuple[tuple[tuple[int, ...], ...], ...]  # [conv][turn] user tokens
    max_new_tokens: int


def make_workload(name: str, *, seed: int = 0, vocab: int = 64, system_len: int = 37, conversations: int = 4,
                  turns: int = 3, user_len: tuple[int, int] = (5, 30), max_new_tokens: int = 8) -> Workload:
    rng = random.Random(f"{name}/{seed}")

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(n))

    convs = tuple(tuple(toks(rng.randint(*user_len)) for _ in range(turns)) for _ in range(conversations))
    return Workload(name, toks(system_len), convs, max_new_tokens)


BUILTIN_WORKLOADS = {
    # many requests, one system prompt, one turn each
    "shared-system-prompt": {"system_len": 53, "conversations": 8, "turns": 1, "user_len": (3, 40),
                             "max_new_tokens": 6},
    # each turn extends the previous: reuse ends inside a block (partial-block reuse, cow)
    "multi-turn": {"system_len": 21, "conversations": 3, "turns": 4, "user_len": (4, 24), "max_new_tokens": 9},
}


def builtin_workload(name: str, vocab: int = 64) -> Workload:
    return make_workload(name, vocab=vocab, **BUILTIN_WORKLOADS[name])


@dataclass
class Outcome:
    requests: list[Request]
    engine_counters: dict
    copies: dict  # executed copy ops by reason (data plane)
    stats: dict  # manager stats()
    routes: dict  # executed copy ops by route ("gpu->host", ...)
    shared: dict = field(default_factory=dict)  # the data plane's shared_stats (with a shared tier)
    tokens_equal: bool = False
    max_logit_diff: float = float("nan")


def run_workload(model: TinyHybridModel, manager: Any, workload: Workload | Sequence[Workload], *,
                 max_batch: int = 4, check: bool = True) -> Outcome:
    """Run ``workload`` (or several, one after the other) wave by wave through a fresh
    engine on ``manager``; with ``check``, compare every request with the no-cache reference."""
    engine = Engine(model, manager, max_batch=max_batch)
    try:
        done: list[Request] = []
        for w in [workload] if isinstance(workload, Workload) else workload:
            done += _run_waves(engine, w)
        manager.check_invariants()
        out = Outcome(done, dict(engine.counters), dict(engine.plane.copies), manager.stats(),
                      dict(engine.plane.routes), dict(engine.plane.shared_stats) if engine.plane.shared else {})
    finally:
        engine.close()
    if check:
        out.tokens_equal, out.max_logit_diff = compare_with_reference(model, done)
    return out


def _run_waves(engine: Engine, workload: Workload) -> list[Request]:
    history = [list(workload.system) for _ in workload.conversations]
    done: list[Request] = []
    nturns = max(len(c) for c in workload.conversations)
    for t in range(nturns):
        wave = []
        for i, conv in enumerate(workload.conversations):
            if t < len(conv):
                wave.append((i, Request(history[i] + list(conv[t]), workload.max_new_tokens)))
        engine.generate([r for _, r in wave])
        for i, r in wave:
            history[i] = r.prompt + r.output
        done.extend(r for _, r in wave)
    return done


def compare_with_reference(model: TinyHybridModel, requests: Sequence[Request]) -> tuple[bool, float]:
    """(every request's tokens equal the no-cache run's, max |logit diff| over them);
    see :meth:`TinyHybridModel.reference_logits`."""
    equal, worst = True, 0.0
    for r in requests:
        ref = model.reference_logits(r.prompt, r.output)
        if ref.argmax(-1).tolist() != r.output:
            equal = False
        worst = max(worst, float((_torch().stack(r.logits) - ref).abs().max()))
    return equal, worst


# ---------------------------------------------------------------------------------------
# One engine instance as a process: python -m kvcm.engine
# ---------------------------------------------------------------------------------------


def _workloads(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in BUILTIN_WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workload {bad[0] if bad else text!r}; "
                                         f"choices: {', '.join(sorted(BUILTIN_WORKLOADS))}")
    return names


def instance_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvcm.engine",
        description="Run the reference engine on a built-in workload through kvcm (one engine instance); "
                    "instances given the same --shared-tier reuse each other's prefill.")
    p.add_argument("--workload", default=["shared-system-prompt"], type=_workloads,
                   help=f"one or more (comma-separated, run in order) of {', '.join(sorted(BUILTIN_WORKLOADS))}")
    p.add_argument("--backend", type=backend_arg, default=None, help="kvcm backend (default: KVCM_BACKEND)")
    p.add_argument("--shared-tier", default=None,
                   help="the shared store: a directory, file:///dir or mooncake://host:port?metadata=url")
    p.add_argument("--shared-quota-bytes", type=int_in(0), default=0,
                   help="file store: byte cap; Mooncake: bytes this client mounts (0: none)")
    p.add_argument("--shared-write", default="commit", choices=("commit", "evict"))
    p.add_argument("--namespace", default="kvcm-tiny-hybrid", help="the layout fingerprint's model/namespace")
    p.add_argument("--block", type=int_in(1, 4096), default=16, help="tokens per block")
    p.add_argument("--gpu-slots", type=int_in(1), default=1000, help="gpu slots per life cycle (default 1000)")
    p.add_argument("--host-slots", type=int_in(0), default=0, help="host slots per life cycle (default 0: none)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the no-cache run")
    p.add_argument("--json", default=None, help="write the outcome here (requests' tokens and logits included)")
    return p


def run_instance(args: argparse.Namespace) -> dict:
    """One engine instance (see :func:`instance_parser`); returns the outcome as JSON-able."""
    from kvcm import KVCacheManager

    model = TinyHybridModel()
    config = model.manager_config(args.block, args.gpu_slots, host_slots=args.host_slots or None,
                                  shared=args.shared_tier, shared_quota_bytes=args.shared_quota_bytes,
                                  shared_write=args.shared_write, shared_namespace=args.namespace)
    kw = {"backend": args.backend} if args.backend else {}
    mgr = KVCacheManager(config, **kw)
    with torch_threads(1):
        out = run_workload(model, mgr, [builtin_workload(w, model.cfg.vocab) for w in args.workload],
                           check=not args.no_check)
    mgr.shutdown()
    return {
        "backend": mgr.backend_name,
        "tokens_equal": out.tokens_equal, "max_logit_diff": out.max_logit_diff,
        "counters": out.engine_counters, "copies": out.copies, "routes": out.routes, "shared": out.shared,
        "stats": out.stats,
        "requests": [{"prompt": r.prompt, "output": r.output, "reused_tokens": r.reused_tokens,
                      "shared_hits": r.shared_hits, "rollbacks": r.rollbacks,
                      "logits": [row.tolist() for row in r.logits]} for r in out.requests],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 the outputs equal the no-cache run (or ``--no-check``); 1 they
    differ; 2 bad usage or bad input (an option out of range, an unusable shared tier or
    ``--json`` path, a quota too small for a request): one line, never a traceback."""
    import sys

    from kvcm.api import ConfigError

    prog = "python -m kvcm.engine"
    args = instance_parser().parse_args(argv)
    why = torch_missing(prog) or oplog_unusable(prog)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    if args.json:
        why = writable_file(prog, "--json", args.json)
        if why is not None:
            print(why, file=sys.stderr)
            return 2
    try:
        res = run_instance(args)
    except (ConfigError, ValueError, OSError, ImportError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except QuotaTooSmallError as e:
        print(f"{prog}: {e} (--gpu-slots {args.gpu_slots})", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    c = res["counters"]
    print(f"requests {c['requests']}  prompt tokens {c['prompt_tokens']}  reused {c['reused_tokens']}  "
          f"prefilled {c['prefill_tokens']}  shared hits {c['shared_hits']}  "
          f"onboarded from shared {res['routes'].get('shared->gpu', 0)}  stored {res['copies'].get('store', 0)}  "
          f"rollbacks {c['rollbacks']}")
    if not args.no_check:
        print(f"exact vs no-cache run: tokens {'equal' if res['tokens_equal'] else 'DIFFER'}, "
              f"max |logit diff| {res['max_logit_diff']:.2e}")
        return 0 if res["tokens_equal"] else 1
    return 0


__all__ = [
    "BUILTIN_WORKLOADS",
    "Beam",
    "Engine",
    "ModelConfig",
    "Outcome",
    "QuotaTooSmallError",
    "Request",
    "TinyHybridModel",
    "Workload",
    "beam_search",
    "builtin_workload",
    "compare_with_reference",
    "default_device",
    "instance_parser",
    "main",
    "make_workload",
    "reference_beam_search",
    "run_instance",
    "run_workload",
    "torch_threads",
]


if __name__ == "__main__":
    raise SystemExit(main())
