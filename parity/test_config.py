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


# ---------------------------------------------------------------------------------------
# Issue 8: every integer field bounded so derived quantities fit int64; floats checked
# without overflow; Tier.path checked (DECISIONS "Configuration bounds").
# ---------------------------------------------------------------------------------------

_HUGE = [2**63, 2**64, 2**100]


class _Sub(int):
    def __index__(self):
        return 4


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"layers": [AttentionLayer(0, 2**62)]}, "layers.bytes_per_token"),  # B * 2**62 >= 2**63
        ({"layers": [AttentionLayer(0, 2**61), AttentionLayer(1, 2**61)]}, "layers.bytes_per_token"),
        ({"layers": [SsmLayer(0, 2**62), SsmLayer(1, 2**62)]}, "layers.state_bytes"),
        ({"tokens_per_block": _Sub(4)}, "tokens_per_block"),
        ({"tokens_per_block": True}, "tokens_per_block"),
        ({"layers": [AttentionLayer(0, 1, window=_Sub(8))]}, "layers.window"),
        ({"pool_ratio": {0: 10**400}}, "pool_ratio"),
        ({"pool_ratio": {0: float("nan")}}, "pool_ratio"),
        ({"pool_ratio": {0: float("inf")}}, "pool_ratio"),
        ({"pool_ratio": {0: 2.0**70}}, "pool_ratio"),
        ({"pool_ratio": {True: 1.0}}, "pool_ratio"),
        ({"pool_ratio": [1.0]}, "pool_ratio"),
        ({"max_util_for_resume": 10**400}, "max_util_for_resume"),
        ({"max_util_for_resume": float("nan")}, "max_util_for_resume"),
        ({"max_util_for_resume": float("inf")}, "max_util_for_resume"),
        ({"max_util_for_resume": True}, "max_util_for_resume"),
        ({"enable_partial_reuse": 1}, "enable_partial_reuse"),
        ({"tiers": [Tier("gpu", 2**40)]}, "tiers.quota_bytes"),  # 2**38 slots: page indices are int32
        ({"tiers": [Tier(5, 64)]}, "tiers.kind"),
        ({"layers": 5}, "layers"),
        ({"layers": AttentionLayer(0, 1)}, "layers"),
        ({"tiers": Tier("gpu", 64)}, "tiers"),
        ({"tiers": None}, "tiers"),
    ]
    + [({"layers": [AttentionLayer(0, v)]}, "layers.bytes_per_token") for v in _HUGE]
    + [({"layers": [AttentionLayer(0, 1, window=v)]}, "layers.window") for v in _HUGE]
    + [({"layers": [AttentionLayer(0, 1, window=8, sink_tokens=v)]}, "layers.sink_tokens") for v in _HUGE]
    + [({"layers": [SsmLayer(0, v)]}, "layers.state_bytes") for v in _HUGE]
    + [({"layers": [AttentionLayer(v, 1)]}, "layers.layer_id") for v in _HUGE]
    + [({"tiers": [Tier("gpu", v)]}, "tiers.quota_bytes") for v in _HUGE]
    + [({"reuse_match_backoff": v}, "reuse_match_backoff") for v in _HUGE]
    + [({"max_events": v}, "max_events") for v in _HUGE],
)
def test_config_values_past_int64_or_float_are_config_errors(make_manager, kw, field):
    err = _config_error(make_manager, _cfg(**kw))
    assert err.field == field
    assert str(err).startswith(field + ": ")


def test_config_at_the_int64_edges_works(make_manager):
    # the largest accepted window and sinks: no overflow in the stale-range arithmetic
    cfg = _cfg(layers=[AttentionLayer(0, 1, window=2**63 - 1, sink_tokens=2**63 - 1)],
               reuse_match_backoff=2**63 - 1, max_events=2**63 - 1, pool_ratio={0: 2.0**64})
    mgr = make_manager(cfg)
    kv = mgr.create_kv_cache(toks(3))
    assert kv.resume() and kv.resize(8, history_length=8)
    kv.commit(toks(6))
    assert kv.page_indices(0) == [0, 1]
    assert kv.resize(2**63 - 1) is False  # more blocks than the pool could ever hold
    kv.close()
    assert mgr.probe_reuse(toks(6)) == 0  # the backoff swallows every match
    mgr.check_invariants()


@pytest.mark.parametrize(
    "path,why",
    [
        (5, "must be a str or os.PathLike, got int"),
        (b"/tmp/kvcm-disk", "must be a str or os.PathLike, got bytes"),
        ("/tmp/kvcm\0disk", "contains a NUL character"),
        ("", "a disk tier needs a path"),
        (None, "a disk tier needs a path"),
    ],
)
def test_config_error_bad_disk_path(make_manager, path, why):
    err = _config_error(make_manager, _cfg(tiers=[Tier("gpu", 64), Tier("disk", 64, path=path)]))
    assert err.field == "tiers.path"
    assert str(err) == f"tiers.path: {why}"


def test_config_error_disk_path_is_a_regular_file(make_manager, tmp_path):
    f = tmp_path / "a-file"
    f.write_bytes(b"x")
    err = _config_error(make_manager, _cfg(tiers=[Tier("gpu", 64), Tier("disk", 64, path=str(f))]))
    assert err.field == "tiers.path"
    assert "exists and is not a directory" in str(err)


def test_config_error_path_on_a_non_disk_tier(make_manager, tmp_path):
    for tiers in ([Tier("gpu", 64, path=str(tmp_path))], [Tier("gpu", 64), Tier("host", 64, path=str(tmp_path))]):
        err = _config_error(make_manager, _cfg(tiers=tiers))
        assert err.field == "tiers.path"
        assert "only a disk or shared tier takes a path" in str(err)


def test_disk_path_may_be_pathlike_or_missing_and_is_not_created(make_manager, tmp_path):
    make_manager(_cfg(tiers=[Tier("gpu", 64), Tier("disk", 64, path=tmp_path)]))  # a pathlib.Path
    missing = tmp_path / "not" / "yet"
    make_manager(_cfg(tiers=[Tier("gpu", 64), Tier("disk", 64, path=str(missing))]))
    assert not missing.exists()  # the data plane creates it when it is built, the validator never
