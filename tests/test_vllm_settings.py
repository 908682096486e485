"""The vLLM connector's configuration, without vLLM: ``kv_connector_extra_config`` parsing and
how vLLM's KV cache layout becomes a kvcm config (kvcm.integrations.vllm.settings imports
nothing of vLLM; the connector itself runs in the vllm leg, tests/test_vllm_connector.py)."""

from __future__ import annotations

from types import SimpleNamespace

import kvcm
import pytest
from kvcm.api import SHARED
from kvcm.integrations.vllm.settings import DEFAULT_HOST_BYTES, ConnectorSettings, KvLayout


class FullAttentionSpec(SimpleNamespace):  # the name is what KvLayout checks
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


def kv_cache_config(*groups: tuple[type, int]) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(n)],
                        kv_cache_spec=cls(block_size=32, num_kv_heads=2, head_size=64, dtype="torch.float32",
                                          page_size_bytes=32 * 2 * 64 * 2 * 4))
        for cls, n in groups])


def test_defaults_host_tier_only() -> None:
    s = ConnectorSettings.parse(None)
    assert s.load_mode == "auto" and s.max_inflight_bytes == 256 << 20 and s.copy_fault_hook is None
    assert ConnectorSettings.parse({"host_bytes": 1 << 20}).max_inflight_bytes == 1 << 19
    assert s.host_bytes == DEFAULT_HOST_BYTES and s.disk_path is None and s.shared is None
    cfg = s.manager_config(KvLayout.from_kv_cache_config(kv_cache_config((FullAttentionSpec, 2)), "cpu"))
    assert [t.kind for t in cfg.tiers] == ["gpu"] and cfg.tokens_per_block == 32
    assert [layer.bytes_per_token for layer in cfg.layers] == [2 * 64 * 2 * 4] * 2
    assert cfg.enable_partial_reuse is False
    kvcm.KVCacheManager(cfg).shutdown()


def test_tiers_and_namespace_carry_the_layout(tmp_path) -> None:
    layout = KvLayout.from_kv_cache_config(kv_cache_config((FullAttentionSpec, 3)), "cpu")
    s = ConnectorSettings.parse({"host_bytes": 1 << 20, "disk_path": str(tmp_path / "d"), "disk_bytes": 1 << 22,
                                 "shared": str(tmp_path / "s"), "shared_namespace": "m@1"})
    cfg = s.manager_config(layout)
    assert [t.kind for t in cfg.tiers] == ["gpu", "disk", "shared"]
    assert cfg.shared_namespace == "m@1|vllm:cpu:FullAttentionSpec:2x64:float32:B32|tp1"
    assert s.manager_config(layout, rank=1, world=2).shared_namespace.endswith("|tp2")  # ranks: their planes' names
    assert s.manager_config(layout, rank=1, world=2).tiers[1].path == str(tmp_path / "d" / "rank1")
    mgr = kvcm.KVCacheManager(cfg)
    assert any(lc == 0 for _, lc in mgr.shared_candidates(list(range(100)))) and SHARED == 3
    mgr.shutdown()


@pytest.mark.parametrize(("extra", "error", "match"), [
    ({"host_byte": 1}, ValueError, "unknown keys \\['host_byte'\\]"),
    ({"host_bytes": 0}, ValueError, "host_bytes"),
    ({"host_bytes": -1}, ValueError, "host_bytes"),
    ({"host_bytes": True}, ValueError, "host_bytes"),
    ({"disk_path": "/tmp/x"}, ValueError, "go together"),
    ({"disk_bytes": 10}, ValueError, "go together"),
    ({"shared": "/tmp/s"}, ValueError, "shared_namespace"),
    ({"shared": "/tmp/s", "shared_namespace": 3}, TypeError, "shared_namespace"),
    ({"shared_write": "never"}, ValueError, "shared_write"),
    ({"shared_timeout_s": -1}, ValueError, "shared_timeout_s"),
    ({"backend": "rust"}, ValueError, "backend"),
    ({"shared_store_class": "nocolon"}, ValueError, "module:Class"),
    ({"stats_file": ""}, ValueError, "stats_file"),
    ({"load_mode": "lazy"}, ValueError, "load_mode"),
    ({"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes"),
    ({"max_inflight_bytes": -5}, ValueError, "max_inflight_bytes"),
    ({"copy_fault_hook": "nocolon"}, ValueError, "module:function"),
])
def test_bad_extra_config_is_a_clear_error(extra: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ConnectorSettings.parse(extra)


class MambaSpec(SimpleNamespace):
    pass


def hybrid_config(*groups: tuple[type, int, int | None]) -> SimpleNamespace:
    """vLLM's hybrid KV cache manager's groups: (spec class, layers, sliding window)."""
    out, first = [], 0
    for cls, n, window in groups:
        spec = cls(block_size=32, num_kv_heads=2, head_size=64, dtype="torch.float32",
                   page_size_bytes=32 * 2 * 64 * 2 * 4, sliding_window=window)
        out.append(SimpleNamespace(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(first, first + n)],
                                   kv_cache_spec=spec))
        first += n
    return SimpleNamespace(kv_cache_groups=out)


def test_hybrid_groups_map_onto_kvcm_life_cycles_of_their_kind() -> None:
    # Gemma-3 under vLLM's hybrid manager: three sliding groups and one full group of one layer each
    cfg_in = hybrid_config((SlidingWindowSpec, 1, 64), (SlidingWindowSpec, 1, 64), (SlidingWindowSpec, 1, 64),
                           (FullAttentionSpec, 1, None))
    layout = KvLayout.from_kv_cache_config(cfg_in, "cpu")
    assert layout.hybrid and layout.num_groups == 4 and layout.groups == (0, 1, 2, 3)
    assert layout.lc_groups == ((0, 1, 2), (3,))  # one kvcm life cycle per kind: window 64, then full
    cfg = ConnectorSettings.parse(None).manager_config(layout)
    assert [(layer.window, layer.sink_tokens) for layer in cfg.layers] == [(64, 0)] * 3 + [(None, 0)]
    assert cfg.pool_ratio == {0: 1.0, 1: 1.0}  # every life cycle the same share of each tier's bytes
    mgr = kvcm.KVCacheManager(cfg)
    assert len(mgr.life_cycles) == 2
    mgr.shutdown()
    assert "SlidingWindowSpec:2x64:float32:W64:L1+" in layout.describe
    # all sliding (Mistral): one group, windowed
    mistral = KvLayout.from_kv_cache_config(hybrid_config((SlidingWindowSpec, 2, 64)), "cpu")
    assert mistral.hybrid and mistral.lc_groups == ((0,),) and mistral.windows == (64, 64)
    # one full group: the layout of before (not hybrid; block-level load errors as before)
    full = KvLayout.from_kv_cache_config(kv_cache_config((FullAttentionSpec, 2)), "cpu")
    assert not full.hybrid and full.lc_groups == ((0,),) and full.groups == ()
    assert ConnectorSettings.parse(None).manager_config(full).pool_ratio is None


def test_unsupported_groups_are_refused_naming_the_kind() -> None:
    with pytest.raises(ValueError, match=r"not MambaSpec \(group 0: 2 layers\)"):
        KvLayout.from_kv_cache_config(hybrid_config((MambaSpec, 2, None), (FullAttentionSpec, 2, None)), "cpu")
