"""What the vLLM connector checks and says when it starts, without vLLM
(kvcm.integrations.vllm.startup, kvcm.integrations.vllm.check): the early check vLLM's config
resolution runs, the start line, the capacity warnings, ``python -m kvcm vllm check-config``,
and -- through kvcm's real data plane and file store -- that two models of one shape on one
store and namespace never see each other's objects.  The same on the real engine:
tests/engines/test_vllm_connector.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import kvcm
import pytest
from children import child_env
from kvcm.dataplane import DataPlane
from kvcm.integrations.vllm import startup
from kvcm.integrations.vllm.identity import ModelSource, model_identity
from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout
from test_vllm_identity import model_dir
from test_vllm_settings import PAGE, layout2

GOOD = {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"host_bytes": 1 << 20}}


def test_transfer_config_needs_recompute_and_valid_keys() -> None:
    assert startup.check_transfer_config(GOOD).host_bytes == 1 << 20
    as_object = SimpleNamespace(**GOOD)  # vLLM's KVTransferConfig is read by attribute
    assert startup.check_transfer_config(as_object).host_bytes == 1 << 20
    with pytest.raises(ValueError, match='"kv_load_failure_policy"\\] must be "recompute" .*got \'fail\''):
        startup.check_transfer_config({**GOOD, "kv_load_failure_policy": "fail"})
    with pytest.raises(ValueError, match="got 'fail'"):  # vLLM's default
        startup.check_transfer_config({k: v for k, v in GOOD.items() if k != "kv_load_failure_policy"})
    with pytest.raises(ValueError, match="\\['host_bytes'\\] must be an int"):
        startup.check_transfer_config({**GOOD, "kv_connector_extra_config": {"host_bytes": "8"}})


def resolve_connector_class(kv_transfer_config: object) -> object:
    """What vLLM's KVConnectorFactory.get_connector_class does with the module path (it has
    ``kv_transfer_config`` as a local, as here)."""
    import importlib

    module = importlib.import_module("kvcm.integrations.vllm")
    return module.KvcmConnector


def test_resolving_the_class_checks_the_config_before_the_model_loads(tmp_path: Path) -> None:
    """vLLM resolves the connector class while it builds its VllmConfig, before the engine
    starts: the package's __getattr__ checks the kv_transfer_config it is resolved for, and a
    bad one fails there, before the connector module (and vLLM) is even imported."""
    bad = SimpleNamespace(**{**GOOD, "kv_connector_extra_config": {"host_byte": 8}})
    with pytest.raises(ValueError, match="unknown key \\['host_byte'\\] \\(did you mean 'host_bytes'\\?\\)"):
        resolve_connector_class(bad)
    bad_path = SimpleNamespace(**{**GOOD, "kv_connector_extra_config": {"disk_path": "/proc/no/kv", "disk_bytes": 1}})
    with pytest.raises(ValueError, match="\\['disk_path'\\] '/proc/no/kv' cannot be created"):
        resolve_connector_class(bad_path)
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        resolve_connector_class(SimpleNamespace(**{**GOOD, "kv_load_failure_policy": "fail"}))
    # another connector's config in the frames is not ours to check
    other = SimpleNamespace(kv_connector="OtherConnector", kv_connector_extra_config={"host_byte": 8})
    startup.check_calling_config(_frame_with(other))


def _frame_with(kv_transfer_config: object):
    return sys._getframe()


def test_the_start_line_says_what_the_connector_does(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "m")
    facts = startup.EngineFacts(max_model_len=512, vllm_blocks=16, device="cpu", enable_prefix_caching=True)
    s = ConnectorSettings.parse({"backend": "cpp", "host_bytes": 24 * PAGE, "disk_path": str(tmp_path / "disk"),
                                 "disk_bytes": 96 * PAGE, "shared": str(tmp_path / "store"),
                                 "shared_bytes": 1 << 30, "shared_namespace": "llama@rev", "shared_timeout_s": 0.5})
    prepared = startup.prepare(s, layout2(), facts, ModelSource(str(d)))
    assert prepared.warnings == [] and prepared.identity is not None
    line = startup.start_line(s, layout2(), facts, prepared, "cpp")
    assert "\n" not in line
    for part in ("kvcm connector: backend cpp", "vLLM block 32 tokens = 64.0 KiB per kvcm page (2 layers)",
                 "vLLM's KV cache 16 blocks, max_model_len 512 = 16 blocks", "host 1.5 MiB = 24 blocks",
                 f"disk 6.0 MiB = 96 blocks at {tmp_path / 'disk'}",
                 f"shared {tmp_path / 'store'} (directory, cap 1.0 GiB, written on commit, timeout 0.5 s)",
                 f"namespace 'llama@rev' + {prepared.identity.tag} (sampled: 1 weight files",
                 "vllm:cpu:FullAttentionSpec:2x64:float32:B32"):
        assert part in line, (part, line)
    unbounded = ConnectorSettings.parse({"shared": str(tmp_path / "store"), "shared_bytes": "unbounded",
                                         "shared_namespace": "x", "model_identity": "off"})
    p2 = startup.prepare(unbounded, layout2(), facts, ModelSource("/no/model/needed"))
    line2 = startup.start_line(unbounded, layout2(), facts, p2, "python")
    assert "NO CAP (shared_bytes 'unbounded')" in line2 and "model_identity off" in line2
    assert "no disk tier" in line2 and "host 1.0 GiB = 16384 blocks" in line2


def test_announce_logs_the_line_and_each_warning() -> None:
    facts = startup.EngineFacts(max_model_len=512, vllm_blocks=16, device="cpu", enable_prefix_caching=True)
    s = ConnectorSettings.parse({"host_bytes": 4 * PAGE})
    prepared = startup.prepare(s, layout2(), facts, ModelSource("/unused: no shared tier"))
    logged = []
    log = SimpleNamespace(info=lambda fmt, *a: logged.append(("INFO", fmt % a)),
                          warning=lambda fmt, *a: logged.append(("WARNING", fmt % a)))
    startup.announce(log, s, layout2(), facts, prepared, "cpp")
    assert [lvl for lvl, _ in logged] == ["INFO", "WARNING"]
    assert "host 256.0 KiB = 4 blocks" in logged[0][1]
    assert "holds 4 blocks of 65,536 bytes; one request of max_model_len 512 tokens needs 16" in logged[1][1]


def test_a_shared_tier_without_an_identity_is_refused_naming_the_key(tmp_path: Path) -> None:
    facts = startup.EngineFacts(512, 16, "cpu", True)
    s = ConnectorSettings.parse({"shared": str(tmp_path / "store")})
    with pytest.raises(ValueError, match="\\['model_identity'\\] 'sampled': load_format 'dummy' loads random weights"):
        startup.prepare(s, layout2(), facts, ModelSource(str(tmp_path), load_format="dummy"))
    with pytest.raises(ValueError, match="\\['model_identity'\\] 'sampled': no weight files"):
        startup.prepare(s, layout2(), facts, ModelSource(str(tmp_path)))
    with pytest.raises(ValueError, match="\\['host_bytes'\\] = 8 holds no block"):
        startup.prepare(ConnectorSettings.parse({"host_bytes": 8}), layout2(), facts, ModelSource(str(tmp_path)))


def store_roundtrip(settings: ConnectorSettings, layout: KvLayout, tag: str | None, prompt: list[int],
                    write: bool) -> int:
    """One instance on the store: how many blocks of ``prompt`` it finds there; then (when
    ``write``) it computes the prompt and its full blocks go to the store."""
    cfg = settings.manager_config(layout, identity_tag=tag)
    mgr = kvcm.KVCacheManager(cfg, backend="python")
    plane = DataPlane(cfg, device="cpu")
    try:
        hits = plane.shared_lookup(mgr.shared_candidates(prompt))
        found = len(hits)  # the (key, lc) pairs the store holds
        if write:
            kv = mgr.create_kv_cache(prompt, shared_hits=hits)
            kv.resume()
            plane.apply(mgr.drain_copy_ops())
            kv.resize(len(prompt))
            kv.commit_input()
            plane.apply(mgr.drain_copy_ops())
            kv.close()
        return found
    finally:
        plane.close()
        mgr.shutdown()


def test_two_models_of_one_shape_on_one_store_and_namespace_share_nothing(tmp_path: Path) -> None:
    """The names the connector gives shared objects (settings + identity), through kvcm's real
    data plane and file store: model b (same shapes, other weights, the same user namespace)
    finds none of model a's blocks; a second instance of model a finds them all."""
    a, b = model_dir(tmp_path, "a", seed=1), model_dir(tmp_path, "b", seed=2)
    ident = {k: model_identity(ModelSource(str(p))).tag for k, p in (("a", a), ("b", b))}
    s = ConnectorSettings.parse({"host_bytes": 64 * PAGE, "shared": str(tmp_path / "store"),
                                 "shared_namespace": "same-name-for-both", "shared_bytes": 1 << 30})
    prompt = list(range(1000, 1000 + 4 * 32))
    assert store_roundtrip(s, layout2(), ident["a"], prompt, write=True) == 0
    assert store_roundtrip(s, layout2(), ident["b"], prompt, write=False) == 0
    assert store_roundtrip(s, layout2(), ident["a"], prompt, write=False) == 4  # every full block
    # what today's names (the namespace and the layout only) did: model b would read model a's KV
    off = ConnectorSettings.parse({"host_bytes": 64 * PAGE, "shared": str(tmp_path / "store2"),
                                   "shared_namespace": "same-name-for-both", "model_identity": "off"})
    assert store_roundtrip(off, layout2(), None, prompt, write=True) == 0
    assert store_roundtrip(off, layout2(), None, prompt, write=False) == 4


def test_the_connectors_scheduler_and_ranks_name_objects_by_the_model(tmp_path: Path) -> None:
    """The connector's scheduler and both tensor-parallel ranks (driven through vLLM's protocol
    without an engine, tests/vllm_sim.py) given the manager config the facade builds: an
    instance of another model (same shapes, store and shared_namespace) finds none of the
    first one's blocks and writes its own; an instance of the first model finds them (every
    rank's shard named alike by the scheduler's lookups and the ranks' planes)."""
    from vllm_sim import SIM_PAGE, Chats, close, rig

    def extra(name: str) -> dict:
        return {"backend": kvcm.backend, "host_bytes": 24 * SIM_PAGE, "shared": str(tmp_path / "store"),
                "shared_namespace": "one-name", "shared_bytes": 1 << 30, "stats_file": str(tmp_path / f"{name}.json")}

    sims = []
    try:
        first = rig(extra("a"), world=2, num_blocks=20, identity="model:aaaa")
        sims.append(first)
        Chats(n=3).run(first, 1)
        assert all(w.plane.shared_stats["stores"] > 0 for w in first.workers)
        assert [w.config.shared_namespace for w in first.workers] == [
            f"one-name|model:aaaa|sim|tp2/r{r}" for r in (0, 1)]
        for name, identity, shared_hits in (("b", "model:bbbb", False), ("a2", "model:aaaa", True)):
            sim = rig(extra(name), world=2, num_blocks=20, identity=identity)
            sims.append(sim)
            Chats(n=3).run(sim, 1)  # the first instance's prompts
            c = sim.sched.counters
            assert c["lookups"] > 0 and not sim.violations and c["load_error_blocks"] == 0
            assert (c["hit_blocks_shared"] > 0) == shared_hits, (identity, dict(c))
            assert all(w.plane.shared_stats["stores"] > 0 for w in sim.workers)  # b: its own KV, its own names
            sim.sched.write_stats()  # stats_file: the namespace the scheduler names objects in
            assert json.loads((tmp_path / f"{name}.json").read_text())["namespace"] == f"one-name|{identity}|sim|tp2"
    finally:
        for sim in sims:
            close(sim)


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcm", "vllm", "check-config", *args], capture_output=True,
                          text=True, env=child_env(), timeout=120, check=False)


def test_check_config_command(tmp_path: Path) -> None:
    ok = run_check(json.dumps(GOOD))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "ok: backend (KVCM_BACKEND); host 1.0 MiB" and ok.stderr == ""
    extra = {"host_bytes": 1 << 30, "disk_path": str(tmp_path / "d"), "disk_bytes": 1 << 30,
             "shared": str(tmp_path / "s"), "shared_bytes": 8 << 30}
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(extra))
    ok2 = run_check(f"@{path}")
    assert ok2.returncode == 0 and "shared " in ok2.stdout and "cap 8.0 GiB" in ok2.stdout, ok2
    assert 'needs "kv_load_failure_policy": "recompute"' in ok2.stderr  # a bare extra config: a reminder
    assert not (tmp_path / "d").exists() and not (tmp_path / "s").exists()  # checked, not created
    for argv, want in [
        ((json.dumps({"host_bytes": "8GiB"}),), "['host_bytes'] must be an int >= 0 (bytes), got '8GiB'"),
        ((json.dumps({"host_byte": 8}),), "did you mean 'host_bytes'?"),
        ((json.dumps({**GOOD, "kv_load_failure_policy": "fail"}),), '"kv_load_failure_policy"] must be "recompute"'),
        ((json.dumps({**GOOD, "kv_connector": "LMCacheConnectorV1"}),), '"kv_connector"] must be "KvcmConnector"'),
        ((json.dumps({"disk_path": "/proc/x/kv", "disk_bytes": 1}),), "['disk_path'] '/proc/x/kv' cannot be created"),
        (("{bad",), "not JSON"),
        (("[1]",), "expected a JSON object"),
        ((f"@{tmp_path / 'missing.json'}",), "cannot read"),
    ]:
        p = run_check(*argv)
        assert p.returncode == 2, (argv, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr and want in lines[0], (want, p.stderr)
        assert lines[0].startswith("python -m kvcm vllm check-config: ")
    assert subprocess.run([sys.executable, "-m", "kvcm", "vllm"], capture_output=True, env=child_env(),
                          timeout=120, check=False).returncode == 2
