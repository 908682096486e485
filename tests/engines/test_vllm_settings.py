"""The vLLM connector's configuration, without vLLM: ``kv_connector_extra_config`` parsing and
how vLLM's KV cache layout becomes a kvcm config (kvcm.integrations.vllm.settings imports
nothing of vLLM; the connector itself runs in the vllm leg, tests/engines/test_vllm_connector.py)."""

from __future__ import annotations

from types import SimpleNamespace

import kvcm
import pytest
from kvcm.api import SHARED
from kvcm.integrations.vllm.settings import (
    DEFAULT_HOST_BYTES,
    DEFAULT_SHARED_BYTES,
    KEYS,
    TEST_KEYS,
    ConnectorSettings,
    KvLayout,
    SpecClasses,
    parse_size,
)


class FullAttentionSpec(SimpleNamespace):  # stand-ins for vLLM's classes (their names go into the namespace)
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


SPECS = SpecClasses(FullAttentionSpec, SlidingWindowSpec)


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
    cfg = s.manager_config(KvLayout.from_kv_cache_config(kv_cache_config((FullAttentionSpec, 2)), "cpu", SPECS))
    assert [t.kind for t in cfg.tiers] == ["gpu"] and cfg.tokens_per_block == 32
    assert [layer.bytes_per_token for layer in cfg.layers] == [2 * 64 * 2 * 4] * 2
    assert cfg.enable_partial_reuse is False
    kvcm.KVCacheManager(cfg).shutdown()


def test_tiers_and_namespace_carry_the_model_and_the_layout(tmp_path) -> None:
    layout = KvLayout.from_kv_cache_config(kv_cache_config((FullAttentionSpec, 3)), "cpu", SPECS)
    s = ConnectorSettings.parse({"host_bytes": 1 << 20, "disk_path": str(tmp_path / "d"), "disk_bytes": 1 << 22,
                                 "shared": str(tmp_path / "s"), "shared_namespace": "m@1"})
    cfg = s.manager_config(layout, identity_tag="model:ab12")
    assert [t.kind for t in cfg.tiers] == ["gpu", "disk", "shared"]
    assert cfg.shared_namespace == "m@1|model:ab12|vllm:cpu:FullAttentionSpec:2x64:float32:B32|tp1"
    assert cfg.tiers[2].quota_bytes == DEFAULT_SHARED_BYTES  # bounded by default
    with pytest.raises(ValueError, match="identity is needed"):
        s.manager_config(layout)
    # every rank's manager has the scheduler's namespace (each rank's plane adds its number: shard_config)
    assert s.manager_config(layout, rank=1, world=2, identity_tag="model:ab12").shared_namespace.endswith(
        "|model:ab12|vllm:cpu:FullAttentionSpec:2x64:float32:B32|tp2")
    off = ConnectorSettings.parse({"shared": str(tmp_path / "s"), "shared_namespace": "m@1", "model_identity": "off"})
    # opted out: the namespace and the layout only (the names stores written before identities had)
    assert off.manager_config(layout).shared_namespace == "m@1|vllm:cpu:FullAttentionSpec:2x64:float32:B32|tp1"
    anonymous = ConnectorSettings.parse({"shared": str(tmp_path / "s")})  # no namespace: the model names itself
    assert anonymous.manager_config(layout, identity_tag="model:ab12").shared_namespace.startswith("|model:ab12|")
    assert s.manager_config(layout, rank=1, world=2, identity_tag="model:ab12").tiers[1].path == str(tmp_path / "d" / "rank1")
    mgr = kvcm.KVCacheManager(cfg)
    assert any(lc == 0 for _, lc in mgr.shared_candidates(list(range(100)))) and SHARED == 3
    mgr.shutdown()


@pytest.mark.parametrize(("extra", "match"), [
    ({"host_byte": 1}, "unknown key \\['host_byte'\\] \\(did you mean 'host_bytes'\\?\\)"),
    ({"host_bytes": 0}, "\\['host_bytes'\\] must be > 0"),
    ({"host_bytes": -1}, "\\['host_bytes'\\] must be a size: bytes as an int >= 0 or a string like \"8GiB\""),
    ({"host_bytes": "8 gigs"}, "\\['host_bytes'\\] must be a size: .* got '8 gigs'"),
    ({"disk_path": "/tmp/x", "disk_bytes": "1.5B"}, "\\['disk_bytes'\\] must be a size"),
    ({"host_bytes": True}, "\\['host_bytes'\\]"),
    ({"disk_path": "/tmp/x"}, "\\['disk_bytes'\\] must be > 0 with disk_path"),
    ({"disk_bytes": 10}, "\\['disk_path'\\] is needed with disk_bytes 10"),
    ({"shared": "/tmp/s", "model_identity": "off"}, "\\['shared_namespace'\\] is required with model_identity 'off'"),
    ({"shared": "/tmp/s", "shared_namespace": 3}, "\\['shared_namespace'\\] must be a string"),
    ({"shared_namespace": "x" * 129}, "\\['shared_namespace'\\] must be at most 128 bytes"),
    ({"model_identity": "weights"}, "\\['model_identity'\\] must be one of 'sampled', 'full', 'off'"),
    ({"shared": "/tmp/s", "shared_bytes": 0}, "\\['shared_bytes'\\] 0 would leave the store without a cap"),
    ({"shared": "/tmp/s", "shared_bytes": "lots"}, "\\['shared_bytes'\\] must be a size: .* or 'unbounded', got 'lots'"),
    ({"shared": "mooncake://h:1", "shared_bytes": "unbounded"}, "\\['shared_bytes'\\] 'unbounded' applies to a directory"),
    ({"shared_write": "never"}, "\\['shared_write'\\]"),
    ({"shared_timeout_s": -1}, "\\['shared_timeout_s'\\]"),
    ({"shared_timeout_s": float("inf")}, "\\['shared_timeout_s'\\]"),
    ({"backend": "rust"}, "\\['backend'\\] must be 'cpp' or 'python'"),
    ({"shared_store_class": "nocolon"}, "module:Class"),
    ({"stats_file": ""}, "\\['stats_file'\\]"),
    ({"load_mode": "lazy"}, "\\['load_mode'\\] must be one of 'auto', 'sync', 'async'"),
    ({"max_inflight_bytes": 0}, "\\['max_inflight_bytes'\\] must be > 0"),
    ({"max_inflight_bytes": -5}, "\\['max_inflight_bytes'\\] must be a size"),
    ({"config_file": ""}, "\\['config_file'\\] must be a path"),
    ({"config_file": "/nonexistent/kvcm.yaml"}, "\\['config_file'\\] '/nonexistent/kvcm.yaml': cannot read it"),
    ({"copy_fault_hook": "nocolon"}, "\\['copy_fault_hook'\\] must be 'module:function'"),
    ({1: 2}, "keys must be strings"),
])
def test_bad_extra_config_is_a_one_line_error_naming_the_key(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        ConnectorSettings.parse(extra)
    assert "\n" not in str(e.value)


def test_shared_bytes_bounded_by_default_unbounded_only_when_said(tmp_path) -> None:
    store = str(tmp_path / "s")
    assert ConnectorSettings.parse({"shared": store}).shared_bytes == DEFAULT_SHARED_BYTES == 64 << 30
    assert ConnectorSettings.parse({"shared": store, "shared_bytes": 1 << 30}).shared_bytes == 1 << 30
    assert ConnectorSettings.parse({"shared": store, "shared_bytes": "unbounded"}).shared_bytes == 0
    mc = ConnectorSettings.parse({"shared": "mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata"})
    assert mc.shared_bytes == 0 and mc.store_kind == "mooncake"  # a segment mounted: none unless asked for
    assert ConnectorSettings.parse({"shared": store, "shared_store_class": "m:C"}).store_kind == "custom"
    assert ConnectorSettings.parse(None).store_kind is None


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
    layout = KvLayout.from_kv_cache_config(cfg_in, "cpu", SPECS)
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
    mistral = KvLayout.from_kv_cache_config(hybrid_config((SlidingWindowSpec, 2, 64)), "cpu", SPECS)
    assert mistral.hybrid and mistral.lc_groups == ((0,),) and mistral.windows == (64, 64)
    # one full group: the layout of before (not hybrid; block-level load errors as before)
    full = KvLayout.from_kv_cache_config(kv_cache_config((FullAttentionSpec, 2)), "cpu", SPECS)
    assert not full.hybrid and full.lc_groups == ((0,),) and full.groups == ()
    assert ConnectorSettings.parse(None).manager_config(full).pool_ratio is None


def test_unsupported_groups_are_refused_naming_the_kind() -> None:
    with pytest.raises(ValueError, match=r"not MambaSpec \(group 0: 2 layers\)"):
        KvLayout.from_kv_cache_config(hybrid_config((MambaSpec, 2, None), (FullAttentionSpec, 2, None)), "cpu", SPECS)


def test_spec_kinds_are_matched_by_class_not_by_name() -> None:
    """A class named like vLLM's is not vLLM's (matched with isinstance), and a subclass of a
    supported one (MLA, sinks) is a kind of its own: refused, naming it."""
    impostor = type("FullAttentionSpec", (SimpleNamespace,), {})
    with pytest.raises(ValueError, match=r"not FullAttentionSpec \(group 0"):
        KvLayout.from_kv_cache_config(hybrid_config((impostor, 2, None)), "cpu", SPECS)
    mla = type("MLAAttentionSpec", (FullAttentionSpec,), {})
    with pytest.raises(ValueError, match=r"not MLAAttentionSpec \(group 0"):
        KvLayout.from_kv_cache_config(hybrid_config((mla, 2, None)), "cpu", SPECS)


def layout2() -> KvLayout:
    return KvLayout.from_kv_cache_config(kv_cache_config((FullAttentionSpec, 2)), "cpu", SPECS)


PAGE = 2 * 32 * 2 * 64 * 2 * 4  # 2 layers x 32 tokens x 2 kv heads x 64 x (K, V) x fp32 = 65,536


def test_capacity_against_vllms_block_names_the_key_and_the_numbers(tmp_path) -> None:
    assert layout2().page_bytes == PAGE
    with pytest.raises(ValueError, match=r"\['host_bytes'\] = 8 holds no block: one block of vLLM's KV cache is "
                                         r"65,536 bytes \(32 tokens x 2 layers\); give at least 1,048,576"):
        ConnectorSettings.parse({"host_bytes": 8}).check_capacity(layout2(), max_model_len=512, vllm_blocks=16)
    with pytest.raises(ValueError, match=r"\['disk_bytes'\] = 4,096 holds no block"):
        ConnectorSettings.parse({"disk_path": str(tmp_path), "disk_bytes": 4096}).check_capacity(layout2(), 512, 16)
    with pytest.raises(ValueError, match=r"\['shared_bytes'\] = 100 holds no object"):
        ConnectorSettings.parse({"shared": str(tmp_path), "shared_bytes": 100}).check_capacity(layout2(), 512, 16)
    small = ConnectorSettings.parse({"host_bytes": 4 * PAGE}).check_capacity(layout2(), max_model_len=512, vllm_blocks=16)
    assert small == [("kv_connector_extra_config['host_bytes'] = 262,144 holds 4 blocks of 65,536 bytes; one request of "
                     "max_model_len 512 tokens needs 16 (1,048,576 bytes): kvcm stops saving a request at 128 tokens "
                     "and cannot load more than that")]
    below_vllm = ConnectorSettings.parse({"host_bytes": 20 * PAGE}).check_capacity(layout2(), 512, vllm_blocks=64)
    assert len(below_vllm) == 1 and "vLLM's KV cache has 64" in below_vllm[0] and "4,194,304" in below_vllm[0]
    assert ConnectorSettings.parse({"host_bytes": 64 * PAGE}).check_capacity(layout2(), 512, vllm_blocks=64) == []


def test_environment_checked_without_creating_anything(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"\['disk_path'\] '.*file/kv': '.*file' is not a directory"):
        ConnectorSettings.parse({"disk_path": str(blocker / "kv"), "disk_bytes": 1 << 20}).check_environment()
    with pytest.raises(ValueError, match=r"\['shared'\] '.*file/s': '.*file' is not a directory"):
        ConnectorSettings.parse({"shared": str(blocker / "s")}).check_environment()
    with pytest.raises(ValueError, match=r"\['shared'\] not a Mooncake location"):
        ConnectorSettings.parse({"shared": "mooncake://nohost"}).check_environment()
    with pytest.raises(ValueError, match=r"\['shared'\] 'file:///x\?speed=1': unknown parameters \['speed'\]"):
        ConnectorSettings.parse({"shared": "file:///x?speed=1"}).check_environment()
    with pytest.raises(ValueError, match=r"\['shared'\] 's3://b'"):
        ConnectorSettings.parse({"shared": "s3://b"}).check_environment()
    with pytest.raises(ValueError, match=r"\['shared_store_class'\] 'kvcm:NoSuchStore': 'kvcm' has no 'NoSuchStore'"):
        ConnectorSettings.parse({"shared": "/x", "shared_store_class": "kvcm:NoSuchStore"}).check_environment()
    with pytest.raises(ValueError, match=r"\['shared_store_class'\] 'no_such_mod_x:C': cannot import"):
        ConnectorSettings.parse({"shared": "/x", "shared_store_class": "no_such_mod_x:C"}).check_environment()
    with pytest.raises(ValueError, match=r"\['events_endpoint'\] must be a ZeroMQ endpoint"):
        ConnectorSettings.parse({"events_endpoint": "127.0.0.1:5557"}).check_environment()
    with pytest.raises(ValueError, match=r"\['stats_file'\]"):
        ConnectorSettings.parse({"stats_file": str(blocker / "s.json")}).check_environment()
    deep = tmp_path / "a" / "b" / "c"
    warnings = ConnectorSettings.parse({"disk_path": str(deep), "disk_bytes": 1 << 62, "shared": str(deep / "s"),
                                        "shared_bytes": 1 << 62}).check_environment(world=2)
    assert len(warnings) == 2 and "(2 ranks) is more than the free space" in warnings[0], warnings
    assert "the file system fills before the store reaches its cap" in warnings[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created, no probe left


def test_a_missing_cpp_extension_is_named_before_the_engine_starts(monkeypatch) -> None:
    import kvcm._select

    def broken():
        raise ImportError("no _kvcm_cpp here")

    monkeypatch.setattr(kvcm._select, "cpp_extension", broken)
    with pytest.raises(ValueError, match=r"\['backend'\] 'cpp': the compiled extension does not import"):
        ConnectorSettings.parse({"backend": "cpp"}).check_environment()
    ConnectorSettings.parse({"backend": "python"}).check_environment()


# ------------------------------------------------------------------ issue 37: what a vLLM user expects


@pytest.mark.parametrize(("text", "n"), [
    ("8GiB", 8 << 30), ("500MB", 500_000_000), ("1.5 TiB", 3 << 39), ("64 kib", 64 << 10), ("4096", 4096),
    (4096, 4096), ("0.5KiB", 512), ("3 b", 3),
    # one letter as vLLM reads --kv-cache-memory-bytes: upper case binary, lower case decimal
    ("2G", 2 << 30), ("2g", 2_000_000_000), ("80m", 80_000_000), ("80M", 80 << 20),
])
def test_sizes_are_bytes_or_human(text, n) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["8 gigs", "GiB", "-1GiB", "1.5B", "", True, -1, 1.5, None, "1e9"])
def test_a_bad_size_is_refused(bad) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_every_size_key_takes_human_sizes(tmp_path) -> None:
    s = ConnectorSettings.parse({"host_bytes": "8GiB", "disk_path": str(tmp_path / "d"), "disk_bytes": "100GiB",
                                 "shared": str(tmp_path / "s"), "shared_bytes": "1TiB", "max_inflight_bytes": "64MiB"})
    assert (s.host_bytes, s.disk_bytes, s.shared_bytes, s.max_inflight_bytes) == (8 << 30, 100 << 30, 1 << 40, 64 << 20)
    assert ConnectorSettings.parse({"host_bytes": "1MiB"}).max_inflight_bytes == 1 << 19  # the default follows


def test_a_config_file_has_the_same_keys_and_checks(tmp_path, monkeypatch) -> None:
    """YAML or JSON, named by ``config_file`` or KVCM_CONFIG; keys inline override the file's;
    a bad key in the file is the same one-line error, naming the file."""
    yml = tmp_path / "kvcm.yaml"
    yml.write_text(f"host_bytes: 8GiB\ndisk_path: {tmp_path / 'd'}\ndisk_bytes: 100GiB\nload_mode: async\n")
    s = ConnectorSettings.parse({"config_file": str(yml), "load_mode": "sync"})
    assert (s.host_bytes, s.disk_bytes, s.load_mode, s.config_file) == (8 << 30, 100 << 30, "sync", str(yml))
    js = tmp_path / "kvcm.json"
    js.write_text('{"host_bytes": "2GiB"}')
    monkeypatch.setenv("KVCM_CONFIG", str(js))
    assert ConnectorSettings.parse(None).host_bytes == 2 << 30
    assert ConnectorSettings.parse({"config_file": str(yml)}).host_bytes == 8 << 30  # the key over the variable
    assert ConnectorSettings.parse({"host_bytes": 1 << 20}).host_bytes == 1 << 20
    for text, match in [
        ("host_bytes: 8 gigs\n", "\\['host_bytes'\\] must be a size.*\\(from .*bad.yaml\\)"),
        ("host_byte: 8GiB\n", "bad.yaml'.*unknown key \\['host_byte'\\] \\(did you mean 'host_bytes'\\?\\)"),
        ("- 1\n", "must hold one mapping"),
        ("a: [\n", "not YAML"),
        ("config_file: other.yaml\n", "cannot name another"),
    ]:
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ValueError, match=match) as e:
            ConnectorSettings.parse({"config_file": str(tmp_path / "bad.yaml")})
        assert "\n" not in str(e.value)
    monkeypatch.setenv("KVCM_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="KVCM_CONFIG \\(environment\\) '.*missing.json': cannot read it"):
        ConnectorSettings.parse({})


def test_test_hooks_work_but_are_never_offered() -> None:
    assert ConnectorSettings.parse({"copy_fault_hook": "m:f"}).copy_fault_hook == "m:f"
    assert set(TEST_KEYS).isdisjoint(KEYS)
    with pytest.raises(ValueError) as e:
        ConnectorSettings.parse({"copy_fault_hok": "m:f"})
    assert "copy_fault_hook" not in str(e.value) and "known: config_file, backend" in str(e.value)


def test_every_user_key_is_in_the_readme_and_no_test_hook_is() -> None:
    from readme_examples import README

    text = README.read_text(encoding="utf-8")
    vllm = text[text.index("## Use it inside vLLM"):text.index("## Use it inside transformers")]
    missing = [k for k in KEYS if f"`{k}`" not in vllm]
    assert missing == [], missing
    assert all(k not in text for k in TEST_KEYS)
