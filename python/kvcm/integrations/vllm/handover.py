"""Disaggregated prefill and decode: vLLM's ``kv_role`` and the hand-over of a prompt's K/V
from a prefill instance (producer) to a decode instance (consumer) through kvcm's shared
tier (SPEC sec. 19; DECISIONS.md "Disaggregated prefill and decode").

Roles (vLLM's ``kv_transfer_config.kv_role``):

* ``kv_producer``: writes every full block of each prompt it computes to the shared tier
  (kvcm's write-through on commit; its worker reports each step's saves in that step, so the
  writes start at the next step, :attr:`Role.flushes_saves`; the scheduler keeps the engine
  stepping until they are done, :meth:`KvcmScheduler.busy`), and answers a request that asked for a
  remote decode (``kv_transfer_params["do_remote_decode"]``) with hand-over params naming
  what it wrote or is writing.
* ``kv_consumer``: takes those params on a request (vLLM passes them as
  ``request.kv_transfer_params``), waits for the announced objects up to a deadline
  (``handover_wait_s``: vLLM is told "ask again later", ``(None, False)``), then loads what
  is there asynchronously and computes the rest.  By default it writes nothing to the shared
  tier (``save_decode_cache``: vLLM's option of the same name keeps the decode's K/V).
* ``kv_both``: both.

Every role keeps its own host and disk tiers and its prefix hits.

The hand-over params (``kv_transfer_params["kvcm"]``) carry what the consumer needs to
know what to wait for, nothing more: the format version, a digest of the producer's shared
namespace (the model's identity, vLLM's layout, the tensor-parallel size), how many leading
tokens of the prompt it wrote (whole blocks) and a digest of those tokens.  The consumer
derives the object names from its own copy of the prompt.  Params are untrusted input: a
malformed one, another model's namespace or another prompt's tokens is rejected — nothing is
loaded for that request (vLLM computes it), ``handover_rejected`` is counted.  A request the
producer never ran names objects that never appear: the consumer waits until its deadline,
then computes.

Waiting costs one batched existence query per engine step for all waiting hand-overs
together (at most one per ``POLL_S``), whatever their number: each ``lookup`` of a waiting
request reads the last query's answer.

Imports nothing of vLLM (requests are duck-typed: ``request_id``, ``prompt_token_ids``,
``all_token_ids``, ``kv_transfer_params``), so tests drive it without an engine.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm.": vLLM configures its own loggers only
ROLES = ("kv_producer", "kv_consumer", "kv_both")
PARAMS_KEY = "kvcm"
VERSION = 1
POLL_S = 0.02  # at most one existence query per this many seconds, for all waiting hand-overs together
DIGEST_HEX = 32  # hex characters of each digest (128 bits)
MAX_PARAMS_KEYS = 8  # a params object with more keys than this is malformed (bounded work per request)


def namespace_digest(namespace: str) -> str:
    """The digest of a shared namespace (identity, layout, TP size) as the params carry it."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:DIGEST_HEX]


def tokens_digest(tokens: Sequence[int]) -> str:
    """The digest of the token ids a hand-over covers."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=DIGEST_HEX // 2).hexdigest()


@dataclass(frozen=True)
class Role:
    """A connector's part in a disaggregated deployment (module doc)."""

    name: str = "kv_both"
    save_decode_cache: bool = False

    def __post_init__(self) -> None:
        if self.name not in ROLES:
            raise ValueError(f"kv_transfer_config['kv_role'] must be one of {', '.join(ROLES)}, got {self.name!r}")

    @classmethod
    def of(cls, ktc: Any, save_decode_cache: bool = False) -> Role:
        """The role of vLLM's ``kv_transfer_config`` (its ``kv_role``; None: ``kv_both``)."""
        name = ktc.get("kv_role") if isinstance(ktc, dict) else getattr(ktc, "kv_role", None)
        return cls(name or "kv_both", save_decode_cache)

    @property
    def produces(self) -> bool:
        return self.name in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.name in ("kv_consumer", "kv_both")

    @property
    def flushes_saves(self) -> bool:
        """Whether a step's saves are reported in that step (a prefill instance: its
        finished prompts' store writes start one engine step sooner; the worker waits for
        the step's memory copies, bounded)."""
        return self.name == "kv_producer"

    @property
    def writes_shared(self) -> bool:
        """Whether this instance writes to the shared tier: a pure consumer only with
        ``save_decode_cache``."""
        return self.name != "kv_consumer" or self.save_decode_cache


def without_stores(runs: list[Any]) -> tuple[list[Any], int]:
    """A drain's copy runs less its writes to the shared tier (a consumer that does not
    write: ``store`` ops fill no page, so dropping them changes nothing kvcm tracks) and how
    many ops were dropped."""
    kept = [r for r in runs if r.reason != "store"]
    return kept, sum(len(r) for r in runs) - sum(len(r) for r in kept)


@dataclass
class _Wait:
    missing: set[tuple[bytes, int]]
    deadline: float
    tokens: int


class Handover:
    """The scheduler side of the hand-over for one connector (module doc): ``lookup`` in
    place of ``KvcmScheduler.get_num_new_matched_tokens``, ``finished`` in place of
    ``request_finished`` (it returns vLLM's pair: hold the blocks, the params)."""

    def __init__(self, sched: Any, role: Role, wait_s: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.sched = sched
        self.role = role
        self.wait_s = wait_s
        self.clock = clock
        self.sleep = sleep
        self.poll_s = poll_s
        self.paced_step = -1
        self.paces = 0  # steps slowed while hand-overs waited (an engine with nothing to run)
        self.B = sched.B
        self.namespace = sched.config.shared_namespace
        self.ns_digest = namespace_digest(self.namespace) if self.namespace else ""
        self.waiting: dict[str, _Wait] = {}
        # requests whose hand-over was decided, True when its params were rejected (asked again,
        # e.g. after a failed load: no second wait, and a rejected one still loads nothing)
        self.waited: dict[str, bool] = {}
        self.polled_step = -1
        self.polled_at = float("-inf")
        self.queries = 0  # existence queries made for waiting hand-overs (tests: bounded by steps, not requests)

    def _count(self, key: str, n: int = 1) -> None:
        self.sched._count(key, n)

    # ------------------------------------------------------------------ the consumer

    def check(self, request: Any) -> tuple[int, str | None]:
        """The tokens a request's hand-over params announce (0: none) and, for params that
        must be rejected, why (None: acceptable)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or PARAMS_KEY not in params:
            return 0, None
        if not self.role.consumes:
            return 0, "this instance is not a consumer (kv_role kv_producer)"
        p = params[PARAMS_KEY]
        if not isinstance(p, dict) or len(p) > MAX_PARAMS_KEYS:
            return 0, "malformed"
        if p.get("v") != VERSION:
            return 0, f"version {p.get('v')!r}, not {VERSION}"
        ns, n, digest = p.get("ns"), p.get("tokens"), p.get("digest")
        if not isinstance(ns, str) or not isinstance(digest, str) or isinstance(n, bool) or not isinstance(n, int):
            return 0, "malformed"
        if not self.namespace or ns != self.ns_digest:
            return 0, "another model or layout (namespace)"
        prompt = list(getattr(request, "prompt_token_ids", None) or request.all_token_ids)
        if n <= 0 or n % self.B or n > len(prompt):
            return 0, f"token count {n} is not whole blocks of this prompt"
        if tokens_digest(prompt[:n]) != digest:
            return 0, "another prompt (token digest)"
        return n, None

    def lookup(self, request: Any, n_local: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: a request with valid hand-over params waits
        (``(None, False)``) until the objects it needs exist or its deadline passes, then the
        scheduler's probe answers (a load of what is there; the rest is computed)."""
        rid = request.request_id
        w = self.waiting.get(rid)
        if w is None and rid in self.waited:
            return (0, False) if self.waited[rid] else self.sched.get_num_new_matched_tokens(request, n_local)
        if w is None:
            n, why = self.check(request)
            if why is not None:
                self._count("handover_rejected")
                self.waited[rid] = True
                return 0, False  # nothing loaded for it: vLLM computes it
            if n == 0:
                return self.sched.get_num_new_matched_tokens(request, n_local)
            # what this instance will load: the prompt's full blocks before its last token
            need = min(n, (len(request.all_token_ids) - 1) // self.B * self.B)
            if need <= n_local or not self.sched.offload.lookups or self.sched.skip(request):
                self._count("handover_accepted")
                return self.sched.get_num_new_matched_tokens(request, n_local)
            cands = self.sched.offload.candidates(list(request.all_token_ids[:need]), self.sched.scope(request))
            self._count("handover_accepted")
            self._count("handover_tokens_announced", need)
            w = _Wait(set(cands), self.clock() + self.wait_s, need)
            self.waiting[rid] = w
            self._poll(force=True)
        else:
            self._poll()
        if w.missing and self.clock() < w.deadline:
            self._pace(w.deadline)
            return None, False
        del self.waiting[rid]
        self.waited[rid] = False
        if w.missing:
            missing = len({k for k, _ in w.missing})
            self._count("handover_deadlines")
            self._count("handover_blocks_missing", missing)
            logger.warning("kvcm hand-over: request %s: %d of the %d announced blocks not in the store after %.1f s "
                           "(handover_wait_s): they are computed", rid, missing, w.tokens // self.B, self.wait_s)
        return self.sched.get_num_new_matched_tokens(request, n_local)

    def _pace(self, deadline: float) -> None:
        """An engine whose last step ran no forward and whose requests wait for hand-overs
        would spin (vLLM steps an engine with waiting requests as fast as it can): the first
        waiting lookup of such a step sleeps until the next poll is due (at most ``poll_s``,
        never past the deadline), so the waiting costs the host ~1/poll_s steps a second
        (measured: a spinning consumer starved a producer on the same two cores for the whole
        wait).  A step that runs a forward is never slowed."""
        if self.sched.last_forward or self.sched.step == self.paced_step:
            return
        self.paced_step = self.sched.step
        pause = min(self.poll_s - (self.clock() - self.polled_at), deadline - self.clock())
        if pause > 0:
            self.sleep(pause)
            self.paces += 1

    def _poll(self, force: bool = False) -> None:
        """One existence query for every waiting hand-over's missing objects, at most once
        per engine step and ``poll_s`` (``force``: a hand-over just arrived)."""
        now = self.clock()
        step = self.sched.step
        if not force and (step == self.polled_step or now - self.polled_at < self.poll_s):
            return
        missing = {c for w in self.waiting.values() for c in w.missing}
        if not missing:
            return
        self.polled_step, self.polled_at = step, now
        self.queries += 1
        found = self.sched.offload.stored(sorted(missing))  # every rank's shard must be there
        for w in self.waiting.values():
            w.missing -= found

    # ------------------------------------------------------------------ the producer

    def finished(self, request: Any, block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: hold the request's blocks while kvcm's saves read
        them (the scheduler's answer) and, on a producer asked for a remote decode, the
        hand-over params: the blocks saved or being saved, whose store writes the
        scheduler drives to completion without further requests."""
        rid = request.request_id
        self.waited.pop(rid, None)
        if self.waiting.pop(rid, None) is not None:
            self._count("handover_aborted")
        params = None
        kvp = getattr(request, "kv_transfer_params", None)
        if self.role.produces and isinstance(kvp, dict) and kvp.get("do_remote_decode") and self.namespace:
            m = self.sched.trackers.get(rid)
            prompt = list(getattr(request, "prompt_token_ids", None) or request.all_token_ids)
            blocks = 0
            if m is not None and m.kv is not None:
                blocks = m.committed if m.stopped else m.planned
            n = min(blocks * self.B, len(prompt) // self.B * self.B)
            params = {"do_remote_prefill": True, "do_remote_decode": False}
            if n > 0:
                params[PARAMS_KEY] = {"v": VERSION, "ns": self.ns_digest, "tokens": n,
                                      "digest": tokens_digest(prompt[:n])}
                self._count("handover_announced")
                self._count("handover_tokens_written", n)
        return self.sched.request_finished(request, block_ids), params

    def pending(self) -> int:
        return len(self.waiting) + len(self.waited)
