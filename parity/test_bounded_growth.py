"""SPEC sec. 15 (memory bounded by configuration, cost that does not grow with the wrong
thing): the parity side of issue 8 items 8-11.  Each scenario runs on both backends."""

from __future__ import annotations

import warnings

import pytest

from kvcm import ConfigError, ReuseScope
from kvcm.api import PendingCopyOpsWarning
from parity.helpers import attn_cfg, fill, ops, toks


def _pending(mgr) -> int:
    return mgr.stats()["pending_copy_ops"]


# ---------------------------------------------------------------- item 9: undrained copy ops


def test_undrained_copy_ops_pile_up_silently(make_manager):
    """Pending copy ops are a stat, and reaching the configured figure warns once (after
    the call that reached it, which takes full effect)."""
    mgr = make_manager(attn_cfg(gpu=2, host=16, pending_copy_ops_warning=3))
    assert _pending(mgr) == 0
    seen = []
    for i in range(6):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fill(mgr, toks(8, base=100 * (i + 1)))  # 2 blocks: each new request offloads 2
        seen.append([(x.category, str(x.message)) for x in w if issubclass(x.category, PendingCopyOpsWarning)])
        assert _pending(mgr) == 2 * i
        assert mgr.take_iteration_stats()["pending_copy_ops"] == 2 * i  # a current figure
    # the 3rd op arrived during the 3rd fill (ops 3 and 4): exactly one warning, there
    assert [len(s) for s in seen] == [0, 0, 1, 0, 0, 0]
    assert "3 copy ops are pending" in seen[2][0][1]
    assert len(ops(mgr)) == 10
    assert _pending(mgr) == 0
    mgr.check_invariants()


def test_pending_copy_ops_warning_zero_never_warns(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=16, pending_copy_ops_warning=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingCopyOpsWarning)
        for i in range(4):
            fill(mgr, toks(8, base=100 * (i + 1)))
    assert _pending(mgr) == 6


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, True, None])
def test_pending_copy_ops_warning_is_validated(make_manager, bad):
    with pytest.raises(ConfigError, match="pending_copy_ops_warning"):
        make_manager(attn_cfg(pending_copy_ops_warning=bad))
