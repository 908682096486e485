"""The cpp manager: shared config validation, the same argument errors and results as the python
backend, zero-copy page indices and token inputs (list, array, numpy)."""

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
def test_every_manager_method_matches_python(name, args):
    from kvcm.oplog.ops import normalize

    out = []
    for backend in ("python", "cpp"):
        m = kvcm.KVCacheManager(CFG, backend=backend)
        warm = m.create_kv_cache([1, 2, 3, 4, 5, 6])
        assert warm.resume() and warm.resize(8)
        warm.commit([1, 2, 3, 4, 5, 6])
        warm.close()
        result = getattr(m, name)(*args)
        out.append((normalize(result) if name != "create_kv_cache" else normalize(result.committed_tokens),
                    normalize(m.snapshot())))
    assert out[0] == out[1]


def test_page_indices_into_writes_the_callers_buffer():
    import array

    np = pytest.importorskip("numpy")
    m = kvcm.KVCacheManager(CFG, backend="cpp")
    kv = m.create_kv_cache([1, 2, 3, 4, 5])
    assert kv.resume() and kv.resize(9)
    want = kv.page_indices(0)
    buf = np.full(8, 77, dtype=np.int32)
    assert kv.page_indices_into(0, buf) == len(want)
    assert buf[: len(want)].tolist() == want and buf[len(want):].tolist() == [77] * (8 - len(want))
    arr = array.array("i", [5] * 3)
    assert kv.page_indices_into(0, arr) == 3 and arr.tolist() == want
    short = np.full(2, 9, dtype=np.int32)
    with pytest.raises(ValueError):
        kv.page_indices_into(0, short)
    assert short.tolist() == [9, 9]  # nothing written
    with pytest.raises(ValueError):
        kv.page_indices_into(0, np.zeros(8, dtype=np.int64))


def test_token_inputs_array_numpy_list_agree():
    import array

    np = pytest.importorskip("numpy")
    prompt = list(range(100, 111))
    m = kvcm.KVCacheManager(CFG, backend="cpp")
    kv = m.create_kv_cache(prompt)
    assert kv.resume() and kv.resize(len(prompt))
    kv.commit(np.array(prompt, dtype=np.int64))
    kv.close()
    for form in (prompt, array.array("i", prompt), np.array(prompt, dtype=np.int32)):
        assert m.probe_reuse(form) == len(prompt)
    with pytest.raises(ValueError):
        m.probe_reuse(np.array([-1], dtype=np.int32))


def test_closed_cache_keeps_its_properties_like_python():
    from kvcm.oplog.ops import cache_props

    digest = bytes(range(32))
    prompt = [7, digest, 9, 10, 11, digest]
    props = []
    for backend in ("python", "cpp"):
        m = kvcm.KVCacheManager(CFG, backend=backend)
        kv = m.create_kv_cache(prompt, priority=70, id="a")
        assert kv.resume() and kv.resize(8)
        kv.commit(prompt)
        kv.close()
        kv.close()  # idempotent
        props.append((cache_props(kv), kv.committed_tokens))
        with pytest.raises(kvcm.ClosedError):
            kv.resume()
    assert props[0] == props[1]
    assert props[1][1] == prompt
