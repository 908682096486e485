"""Below the whole-block floor: a request's trailing partial block (``partial_tail``).

vLLM 0.32 takes a connector hit that ends inside a block: the scheduler adds the
connector's answer to the block-aligned local hit as is (``vllm/v1/core/sched/scheduler.py``,
``num_external_computed_tokens = ext_tokens``), allocates ``cdiv`` blocks for it
(``single_type_kv_cache_manager.allocate_external_computed_blocks``) and computes the
request from ``num_computed_tokens``, mid-block, as a chunked prefill does (the forward
writes the new tokens' KV into the block before attention reads it).  A load copies whole
block rows: the partial block's slots past the hit hold whatever kvcm's page holds, and the
forward overwrites them before any token reads them (DECISIONS.md "Below the whole-block
floor").

With ``partial_tail`` on (one full-attention or windowed KV cache group set, no hybrid
life cycle and no shared tier), the connector

* runs kvcm with ``enable_partial_reuse``: a probe may end inside a block (SPEC sec. 6), and
  the answer is the exact token count (:func:`answer`); ``_alloc`` loads the partial block
  from the request's copy-on-write page like any other;
* saves a finished request's trailing partial block: the tokens whose KV vLLM wrote
  (:func:`tail_tokens`) past the last whole block are saved from vLLM's block into a kvcm page
  (:func:`plan_tail`, the request's blocks held by ``request_finished`` until the save is
  in), committed (:func:`commit_tail`), and entered as a partial block when the kvcm request
  closes (``stop_committing``).
"""

from __future__ import annotations

from typing import Any

from kvcm.integrations.vllm.metadata import SavePlan


def enabled(partial_tail: bool, layout: Any, shared: str | None) -> bool:
    """Whether kvcm serves and saves partial blocks for this engine."""
    return bool(partial_tail) and not layout.hybrid and shared is None


def answer(match_tokens: int, n_local: int, B: int, on: bool) -> int:
    """The tokens past vLLM's local hit kvcm answers for a match of ``match_tokens``:
    whole blocks only, or (``on``) the match as is, ending inside a block."""
    m = match_tokens if on else match_tokens // B * B
    return max(0, m - n_local)


def tail_tokens(request: Any) -> int:
    """The tokens of a finished request whose KV vLLM has written: every token but the last
    (sampled, never fed back), and no more than it computed (an aborted prefill; in-flight
    tokens of an asynchronous step do not count)."""
    done = request.num_computed_tokens - int(getattr(request, "num_in_flight_tokens", 0) or 0)
    return max(0, min(done, len(request.all_token_ids) - 1))


def plan_tail(sched: Any, m: Any) -> SavePlan | None:
    """Plan the save of ``m``'s trailing partial block (the request just finished), or None
    when there is none worth saving: the mirror saves no more, its whole blocks are not all
    planned, kvcm already covers those tokens, or tier 0 has no page for it."""
    kv = m.kv
    if kv is None or m.stopped or m.retiring or kv.status.name != "ACTIVE":
        return None
    k = tail_tokens(m.request)
    B = sched.B
    f, r = divmod(k, B)
    if r == 0 or m.planned != f or kv.num_committed_tokens >= k:
        return None
    blk = sched._block(m, 0, f)
    if blk is None:
        return None
    prepared = sched.offload.prepare_store(kv, f, f + 1, tokens=k)  # the capacity grown to k tokens
    if prepared is None:
        return None
    sched.version += 1
    if not prepared.slots[0]:  # no page for it (-1)
        return None
    p = SavePlan(sched._id(), m.rid, [blk], [prepared.slots[0][0][1]], lc=0)
    m.tail = k
    return p


def commit_tail(m: Any, offload: Any) -> int:
    """Commit the partial tail once its block's save is confirmed and every whole block
    before it is committed (through the seam, ``offload``: ``kvcm.offload.OffloadManager``);
    returns the tokens committed (0: not yet, or nothing)."""
    B = offload.block_size
    kv = m.kv
    k = getattr(m, "tail", 0)
    if not k or kv is None or kv.status.name != "ACTIVE":
        return 0
    f = k // B
    if m.committed != f or f not in m.confirmed or kv.num_committed_tokens >= k:
        return 0
    n = k - kv.num_committed_tokens
    offload.complete_store(kv, m.request.all_token_ids[kv.num_committed_tokens:k])
    m.confirmed.discard(f)
    m.tail = 0
    return n


def sources(n_local: int, n_external: int, B: int, tiers: list[int], default: int) -> dict[int, int]:
    """The tokens of a load by the tier kvcm had their block in (the last block may be partial)."""
    out: dict[int, int] = {}
    end = n_local + n_external
    for i in range(n_local // B, -(-end // B)):
        t = tiers[i] if i < len(tiers) else default
        out[t] = out.get(t, 0) + min(B, end - i * B)
    return out
