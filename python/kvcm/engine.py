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

The protocol around the model is :class:`kvcm.engine_loop.EngineLoop` (``Engine.loop``):
admission asks the shared store first when there is one (``shared_candidates``, one batched
:meth:`DataPlane.shared_lookup`, ``create_kv_cache(..., shared_hits=...)``; the pages come in
as ``onboard`` ops from tier 3 on ``resume`` and are verified on load), and
:meth:`Engine.sync` is the loop's sync: drain the copy runs, apply them, and report the ops
of a ``CopyError`` (a disk I/O error, a checksum mismatch, a store load that failed; SPEC
sec. 15) to the manager.  Each request the manager rolled back (now SUSPENDED, with fewer
committed tokens) is taken out of the running batch and admitted again later, recomputing
the K/V of its prompt and of the tokens it already generated from its new committed length
(the tokens and logits it already produced were computed from verified bytes and are kept);
a failed ``store`` op loses nothing.

The workloads, their runner and the command line (one engine instance as a process; several
pointed at one shared store reuse each other's prefill) are tools: :mod:`kvcm.tools.workloads`
and ``python -m kvcm.tools.engine_instance``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManagerConfig, ReuseScope, SsmLayer
from kvcm.dataplane import DataPlane
from kvcm.engine_loop import EngineLoop, config_from_layout


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
        shared tier's store (a directory, ``file://``, ``mooncake://``), listed last
        (:func:`kvcm.engine_loop.config_from_layout`)."""
        return config_from_layout(tokens_per_block, self.layer_specs(), gpu_blocks=gpu_slots,
                                  host_blocks=host_slots or 0, disk_blocks=disk_slots or 0, disk_path=disk_path,
                                  shared=shared, shared_quota_bytes=shared_quota_bytes, **kw)

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
class EngineRequest:
    """The reference engine's record of one sequence: its prompt, its output and logits, its
    kvcm cache (``kv``); the engine's side of a request, not a kvcm request (``KVCache``)."""

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
        self._by_id: dict[Any, EngineRequest] = {}  # open request by its cache id
        self.loop = EngineLoop(manager, self.plane, on_rollback=self._rolled_back)

    def sync(self) -> None:
        """Execute the manager's pending copy ops (before any page index is used):
        :meth:`EngineLoop.sync`.  Ops that did not complete are reported to the manager; the
        requests it rolls back are flagged (``rolled_back``) and recomputed by the scheduler."""
        failures = self.loop.counters["copy_failures"]
        self.loop.sync()
        self.counters["copy_failures"] += self.loop.counters["copy_failures"] - failures

    def _rolled_back(self, cache_id: Any) -> None:
        self.counters["rollbacks"] += 1
        r = self._by_id.get(cache_id)
        if r is not None:  # (a cache of this manager that is not the engine's)
            r.rolled_back = True
            r.rollbacks += 1

    def close(self) -> None:
        self.plane.close()

    # ------------------------------------------------------------------ scheduling

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineRequest]:
        waiting: deque[EngineRequest] = deque(requests)
        running: list[EngineRequest] = []
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

    def _requeue_rolled_back(self, running: list[EngineRequest], waiting: deque[EngineRequest]) -> None:
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

    def _admit(self, r: EngineRequest) -> bool:
        kv = r.kv
        if kv is None:
            # match all but the last prompt token: its logits must be computed to sample
            kv = r.kv = self._create(r)
            self._by_id[kv.id] = r
            r.reused_tokens = kv.num_reused_tokens
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(r.prompt)
            self.counters["reused_tokens"] += r.reused_tokens
        # the admission's retry is the engine loop's (ManagerLoop.retry), with this engine's
        # attempt: a request is admitted once it is prefilled; no bound on the tries (each
        # roll-back shortens the match, and the prefill recomputes from there)
        return self.loop.retry(lambda: self._try_admit(r), attempts=None)

    def _try_admit(self, r: EngineRequest) -> bool | None:
        """One admission attempt (:meth:`EngineLoop.retry`'s hook): resume, the copies, the
        resize to the tokens it holds, the prefill of what is not committed.  True: admitted
        and prefilled; False: no room now (SUSPENDED); None: rolled back meanwhile (again)."""
        kv = r.kv
        r.rolled_back = False
        r.started = r.started and kv.num_committed_tokens == self._kv_target(r)
        if not kv.resume():
            self.counters["resume_failures"] += 1
            return False
        self.sync()
        if r.rolled_back:
            return None
        if r.started:
            return True
        if not kv.resize(self._kv_target(r)):
            kv.suspend()
            self.sync()
            self.counters["resume_failures"] += 1
            return False
        self.sync()
        if r.rolled_back:
            return None
        if kv.num_committed_tokens == 0 and self.ssm_lc is not None:  # no snapshot: start from zeros
            slot = kv.page_indices(self.ssm_lc)[0]
            for layer_id in self.ssm_layers:
                self.plane.state(layer_id)[slot].zero_()
        if not self._prefill(r):
            return None
        r.started = True
        return True

    def _create(self, r: EngineRequest) -> Any:
        """:meth:`EngineLoop.create`: with a shared tier, the blocks past the local match are
        looked up in the store first (one batched query) and the present ones handed over."""
        kv = self.loop.create(r.prompt[:-1], r.scope)
        r.shared_hits = self.loop.last_shared_hits
        self.counters["shared_hits"] += r.shared_hits
        return kv

    @staticmethod
    def _kv_target(r: EngineRequest) -> int:
        """Tokens whose K/V a started request holds: the prompt and every generated token
        but the last (the next decode step's input)."""
        return len(r.prompt) + max(len(r.output) - 1, 0)

    def _preempt(self, r: EngineRequest, waiting: deque[EngineRequest]) -> None:
        if not r.rolled_back:  # a rolled-back request is SUSPENDED already
            r.kv.suspend()
            self.sync()
        r.preemptions += 1
        self.counters["preemptions"] += 1
        waiting.appendleft(r)

    def _finish(self, r: EngineRequest) -> None:
        r.kv.close()  # commits the partial tail + its ssm snapshot: a copy op
        self._by_id.pop(r.kv.id, None)
        self.sync()

    # ------------------------------------------------------------------ model steps

    def _forward(self, r: EngineRequest, tokens: Sequence[int], start: int):
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

    def _prefill(self, r: EngineRequest) -> bool:
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

    def _decode(self, r: EngineRequest) -> None:
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
    kv = engine.loop.admit(prompt[:-1], capacity=len(prompt) - 1)
    if kv is None:
        raise RuntimeError("the gpu quota cannot hold the prompt")
    if kv.num_committed_tokens == 0 and engine.ssm_lc is not None:  # no snapshot: start from zeros
        slot = kv.page_indices(engine.ssm_lc)[0]
        for layer_id in engine.ssm_layers:
            engine.plane.state(layer_id)[slot].zero_()
    r = EngineRequest(prompt, 0)
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
# The exactness check (the tests, the workloads of kvcm.tools.workloads, the demo)
# ---------------------------------------------------------------------------------------


def compare_with_reference(model: TinyHybridModel, requests: Sequence[EngineRequest]) -> tuple[bool, float]:
    """(every request's tokens equal the no-cache run's, max |logit diff| over them);
    see :meth:`TinyHybridModel.reference_logits`."""
    equal, worst = True, 0.0
    for r in requests:
        ref = model.reference_logits(r.prompt, r.output)
        if ref.argmax(-1).tolist() != r.output:
            equal = False
        worst = max(worst, float((_torch().stack(r.logits) - ref).abs().max()))
    return equal, worst


__all__ = [
    "Beam",
    "Engine",
    "EngineRequest",
    "ModelConfig",
    "QuotaTooSmallError",
    "TinyHybridModel",
    "beam_search",
    "compare_with_reference",
    "default_device",
    "reference_beam_search",
    "torch_threads",
]
