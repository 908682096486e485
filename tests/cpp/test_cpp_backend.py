"""The stage-1 cpp manager: shared config validation, same argument errors as the python
backend, and NotImplementedError (never a fake value) for what is not ported yet."""

from __future__ import annotations

import pytest

pytest.importorskip("kvcm._kvcm_cpp")

import kvcm
from kvcm import AttentionLayer, ConfigError, KVCacheManagerConfig, ReuseScope, Tier
from kvcm.cpp_backend import CppKVCacheManager

CFG = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 8)], tiers=[Tier("gpu", 4 * 8 * 16)])


def _raises(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - the type and message are what we compare
        return type(e), str(e)
    return None


def test_construct_and_properties():
    m = kvcm.KVCacheManager(CFG, backend="cpp")
    assert isinstance(m, CppKVCacheManager) and m.backend_name == "cpp"
    assert m.config is CFG
    py = kvcm.KVCacheManager(CFG, backend="python")
    assert m.life_cycles == py.life_cycles


@pytest.mark.parametrize(
    "cfg",
    [
        KVCacheManagerConfig(tokens_per_block=0, layers=[AttentionLayer(0, 8)], tiers=[Tier("gpu", 1024)]),
        KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 8)], tiers=[Tier("host", 1024)]),
        KVCacheManagerConfig(
            tokens_per_block=4, layers=[AttentionLayer(0, 8, sink_tokens=2)], tiers=[Tier("gpu", 1024)]
        ),
        KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 8)], tiers=[Tier("gpu", 1)]),
    ],
)
def test_config_errors_identical(cfg):
    py = _raises(kvcm.KVCacheManager, cfg, backend="python")
    cpp = _raises(kvcm.KVCacheManager, cfg, backend="cpp")
    assert py is not None and py[0] is ConfigError
    assert py == cpp


BAD_CALLS = [
    ("create_kv_cache", ([1, True],), {}),
    ("create_kv_cache", ([2**31],), {}),
    ("create_kv_cache", ("abc",), {}),
    ("create_kv_cache", ([1],), {"scope": "s"}),
    ("create_kv_cache", ([1],), {"priority": 101}),
    ("create_kv_cache", ([1],), {"priority": "high"}),
    ("create_kv_cache", ([1],), {"id": 1.5}),
    ("create_kv_cache", ([1],), {"id": True}),
    ("probe_reuse", ([b"x"],), {}),
    ("probe_reuse", ([1], 5), {}),
    ("probe_reuse_detail", ([-1],), {}),
]


@pytest.mark.parametrize("name,args,kw", BAD_CALLS)
def test_bad_arguments_raise_like_python(name, args, kw):
    py = _raises(getattr(kvcm.KVCacheManager(CFG, backend="python"), name), *args, **kw)
    cpp = _raises(getattr(kvcm.KVCacheManager(CFG, backend="cpp"), name), *args, **kw)
    assert py is not None and py[0] in (TypeError, ValueError)
    assert py == cpp


@pytest.mark.parametrize(
    "name,args",
    [
        ("create_kv_cache", ([1, 2, 3], ReuseScope(lora_id=1), 10, "req")),
        ("probe_reuse", ([1, 2, 3],)),
        ("probe_reuse_detail", ([1, 2, 3],)),
        ("drain_copy_ops", ()),
        ("clear_reusable", ()),
        ("shutdown", ()),
        ("stats", ()),
        ("take_iteration_stats", ()),
        ("take_events", ()),
        ("snapshot", ()),
        ("check_invariants", ()),
    ],
)
def test_unported_methods_raise_not_implemented(name, args):
    m = kvcm.KVCacheManager(CFG, backend="cpp")
    with pytest.raises(NotImplementedError, match=rf"cpp backend: {name} is not implemented yet \(issue #3\)"):
        getattr(m, name)(*args)
