"""SPEC sec. 2: configuration, validation and pool sizing."""

from __future__ import annotations

import pytest
from kvcm import AttentionLayer, ConfigError, KVCacheManagerConfig, SsmLayer, Tier

from parity.helpers import DISK_PATH, GPU, HOST, B, counts, toks


def _cfg(**kw):
    base = {"tokens_per_block": B, "layers": [AttentionLayer(0, 1)], "tiers": [Tier("gpu", 64)]}
    base.update(kw)
    return KVCacheManagerConfig(**base)


def _config_error(make_manager, cfg) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        make_manager(cfg)
    assert isinstance(ei.value, ValueError)  # ConfigError is also a ValueError
    return ei.value


def test_default_pool_gives_every_life_cycle_the_same_slot_count(make_manager):
    # attn slot = 4 tokens * (1 + 2) bytes = 12; ssm slot = 8 + 12 = 20; sum = 32.
    # gpu quota 100 -> n = 100 // 32 = 3 slots per life cycle; host 64 -> 2.
    cfg = KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[AttentionLayer(0, 1), SsmLayer(1, 8), AttentionLayer(2, 2), SsmLayer(3, 12)],
        tiers=[Tier("gpu", 100), Tier("host", 64)],
    )
    mgr = make_manager(cfg)
    assert [lc.slot_bytes for lc in mgr.life_cycles] == [12, 20]
    assert counts(mgr, GPU, 0)[0] == 3 and counts(mgr, GPU, 1)[0] == 3
    assert counts(mgr, HOST, 0)[0] == 2 and counts(mgr, HOST, 1)[0] == 2
    kv = mgr.create_kv_cache()
    assert kv.resume() is True
    assert kv.resize(3 * B) is True  # exactly the three gpu slots of lc 0
    assert kv.page_indices(0) == [0, 1, 2]
    assert kv.resize(4 * B) is False
    mgr.check_invariants()


def test_pool_ratio_splits_quota_by_weight(make_manager):
    # attn slot 4 bytes, ssm slot 8 bytes, quota 40, weights 1:1
    # -> attn floor(40 * 1/2 / 4) = 5 slots, ssm floor(40 * 1/2 / 8) = 2 slots.
    cfg = KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[AttentionLayer(0, 1), SsmLayer(1, 8)],
        tiers=[Tier("gpu", 40)],
        pool_ratio={0: 1.0, 1: 1.0},
    )
    mgr = make_manager(cfg)
    assert counts(mgr, GPU, 0)[0] == 5
    assert counts(mgr, GPU, 1)[0] == 2
    kv = mgr.create_kv_cache()
    assert kv.resume() is True
    assert kv.page_indices(1) == [0]  # live ssm state
    assert kv.resize(5 * B) is True
    assert kv.page_indices(0) == [0, 1, 2, 3, 4]
    assert kv.resize(6 * B) is False
    mgr.check_invariants()


def test_life_cycles_grouped_in_order_of_first_appearance(make_manager):
    cfg = KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[
            AttentionLayer(7, 2),
            SsmLayer(3, 8),
            AttentionLayer(1, 1, window=8, sink_tokens=4),
            AttentionLayer(0, 3),
            AttentionLayer(5, 1, window=8),  # same window, different sinks -> own lc
            AttentionLayer(9, 2, window=8, sink_tokens=4),
        ],
        tiers=[Tier("gpu", 1 << 16)],
    )
    mgr = make_manager(cfg)
    lcs = mgr.life_cycles
    assert [lc.id for lc in lcs] == [0, 1, 2, 3]
    assert [lc.kind for lc in lcs] == ["attn", "ssm", "attn", "attn"]
    assert [lc.layer_ids for lc in lcs] == [(7, 0), (3,), (1, 9), (5,)]
    assert [(lc.window, lc.sinks) for lc in lcs] == [(None, 0), (None, 0), (8, 4), (8, 0)]
    assert [lc.slot_bytes for lc in lcs] == [B * 5, 8, B * 3, B * 1]
    mgr.check_invariants()


def test_config_error_without_gpu_tier(make_manager):
    assert _config_error(make_manager, _cfg(tiers=[Tier("host", 64)])).field == "tiers"
    assert _config_error(make_manager, _cfg(tiers=[])).field == "tiers"


def test_config_error_quota_too_small_for_one_slot_per_lc(make_manager):
    # attn slot = 4 bytes, ssm slot = 8: 11 bytes cannot hold one of each.
    cfg = _cfg(layers=[AttentionLayer(0, 1), SsmLayer(1, 8)], tiers=[Tier("gpu", 11)])
    assert _config_error(make_manager, cfg).field == "tiers.quota_bytes"
    cfg = _cfg(tiers=[Tier("gpu", 64), Tier("host", 3)])
    assert _config_error(make_manager, cfg).field == "tiers.quota_bytes"


def test_config_error_sinks_without_window(make_manager):
    cfg = _cfg(layers=[AttentionLayer(0, 1, sink_tokens=4)])
    assert _config_error(make_manager, cfg).field == "layers.sink_tokens"


def test_config_error_window_below_one(make_manager):
    cfg = _cfg(layers=[AttentionLayer(0, 1, window=0)])
    assert _config_error(make_manager, cfg).field == "layers.window"


def test_config_error_duplicate_layer_ids(make_manager):
    cfg = _cfg(layers=[AttentionLayer(0, 1), SsmLayer(0, 8)])
    assert _config_error(make_manager, cfg).field == "layers.layer_id"


def test_config_error_tokens_per_block_out_of_range(make_manager):
    assert _config_error(make_manager, _cfg(tokens_per_block=0)).field == "tokens_per_block"
    assert _config_error(make_manager, _cfg(tokens_per_block=4097)).field == "tokens_per_block"


def test_config_error_unknown_tier_kind(make_manager):
    cfg = _cfg(tiers=[Tier("gpu", 64), Tier("ssd", 64)])
    assert _config_error(make_manager, cfg).field == "tiers.kind"


def test_config_error_disk_tier_without_path(make_manager):
    cfg = _cfg(tiers=[Tier("gpu", 64), Tier("disk", 64)])
    assert _config_error(make_manager, cfg).field == "tiers.path"


def test_config_error_other_fields_named(make_manager):
    assert _config_error(make_manager, _cfg(default_priority=101)).field == "default_priority"
    assert _config_error(make_manager, _cfg(max_util_for_resume=0.0)).field == "max_util_for_resume"
    assert _config_error(make_manager, _cfg(reuse_match_backoff=-1)).field == "reuse_match_backoff"
    assert _config_error(make_manager, _cfg(pool_ratio={1: 1.0})).field == "pool_ratio"
    assert _config_error(make_manager, _cfg(tiers=[Tier("gpu", 64), Tier("gpu", 64)])).field == "tiers"


def test_extreme_block_sizes_are_valid(make_manager):
    for bpb in (1, 4096):
        cfg = _cfg(tokens_per_block=bpb, tiers=[Tier("gpu", bpb * 2), Tier("disk", bpb, path=DISK_PATH)])
        mgr = make_manager(cfg)
        assert counts(mgr, GPU, 0)[0] == 2
        kv = mgr.create_kv_cache(toks(3))
        assert kv.resume() is True
        assert kv.resize(bpb + 1) is True
        assert kv.page_indices(0) == [0, 1]
        kv.close()
        mgr.check_invariants()
