"""SPEC sec. 6 step 3, the one home of the match's fixed point.

The manager's tree (``python_backend/tree.py`` ``RadixTree.prune_match``, C++ twin
``RadixTree::fixed_point`` in ``cpp/core/tree.cpp``) and the event-built router index
(``router.py``, over whole blocks) both shorten a match length ``m`` by the same rules;
they call :func:`fixed_point` so the rules are written once.  Pure: ints in, an int out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvcm.config import LifeCycle, stale_range


class MatchRule(NamedTuple):
    """What step 3 needs to know of one life cycle."""

    ssm: bool  # the match must end exactly at one of its snapshots
    window: int | None = None  # attention: None for full attention (no block is stale)
    sinks: int = 0  # attention: sink tokens, never stale (sec. 7)


def rules_of(life_cycles: Sequence[LifeCycle]) -> tuple[MatchRule, ...]:
    """The rules of a model's life cycles, by life cycle id."""
    return tuple(MatchRule(lc.kind == "ssm", lc.window, lc.sinks) for lc in life_cycles)


def fixed_point(m: int, B: int, rules: Sequence[MatchRule], coverage: Sequence[Sequence[int]],
                use_ssm: bool) -> int:
    """Shorten the match length ``m`` until no rule shortens it further (SPEC sec. 6 step 3).

    ``coverage[j][lc]``: how many tokens of block ``j`` of the matched path life cycle
    ``lc``'s page covers (0: no page; an ssm page's is its snapshot position in the
    block).  Life cycle by life cycle, in id order, repeated until a whole round changes
    nothing:

    * ssm (only with ``use_ssm``; without it the result is ``m_before_ssm``, step 4):
      ``m`` becomes the last snapshot at or below it, ``j * B + c`` of the last block ``j``
      with ``0 < c`` and ``j * B + c <= m``, else 0;
    * attention: the first block ``j`` below ``m`` that is not stale at history ``m``
      (sec. 7) and whose page covers fewer than its matched tokens ``min(B, m - j * B)``
      cuts ``m`` to ``j * B + c``.

    Each rule only lowers ``m``, so the loop ends.  A ``j`` past ``coverage`` raises
    IndexError (a caller's path shorter than ``ceil(m / B)`` blocks is a bug)."""
    while True:
        m0 = m
        for lc, rule in enumerate(rules):
            nblocks = -(-m // B)
            if rule.ssm:
                if not use_ssm:
                    continue
                cut = 0
                for j in range(nblocks - 1, -1, -1):
                    c = coverage[j][lc]
                    if 0 < c and j * B + c <= m:
                        cut = j * B + c
                        break
                m = cut
                continue
            lo, hi = stale_range(rule.window, rule.sinks, m, B)
            for j in range(nblocks):
                if lo <= j < hi:
                    continue
                c = coverage[j][lc]
                if c < min(B, m - j * B):
                    m = j * B + c
                    break
        if m == m0:
            return m
