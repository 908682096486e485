"""What the vLLM connector checks and says when it starts, without vLLM
(kvcm.integrations.vllm.startup, kvcm.cli.vllm): the early check vLLM's config
resolution runs, the start line, the capacity warnings, ``python -m kvcm vllm check-config``,
and -- through kvcm's real data plane and file store -- that two models of one shape on one
store and namespace never see each other's objects.  The same on the real engine:
tests/engines/test_vllm_connector.py."""

from __future__ import annotations

import json
import os
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
from test_vllm_identity import CONFIG, model_dir
from test_vllm_settings import PAGE, layout2

# a config.json vLLM lays out as layout2(): 2 layers x 2 KV heads x 64, fp32
LLAMA = {**CONFIG, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "float32",
         "max_position_embeddings": 512}
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
    with pytest.raises(ValueError, match="\\['host_bytes'\\] must be a size"):
        startup.check_transfer_config({**GOOD, "kv_connector_extra_config": {"host_bytes": "8 gigs"}})


def test_resolving_the_class_reads_no_frame_and_checks_nothing(tmp_path: Path) -> None:
    """vLLM resolves the connector class (``getattr(module, "KvcmConnector")``) while it
    builds its config; kvcm reads nothing of vLLM's there (no stack frames: issue 36): the
    configuration is checked where vLLM hands it over, the connector's constructor
    (:func:`startup.check_transfer_config`), and by ``python -m kvcm vllm check-config``
    before a start."""
    import importlib

    pkg = importlib.import_module("kvcm.integrations.vllm")
    assert "_getframe" not in Path(pkg.__file__).read_text() and "_getframe" not in Path(startup.__file__).read_text()
    assert not hasattr(startup, "check_calling_config")
    bad = SimpleNamespace(**{**GOOD, "kv_connector_extra_config": {"host_byte": 8}})
    with pytest.raises(ValueError, match="unknown key \\['host_byte'\\] \\(did you mean 'host_bytes'\\?\\)"):
        startup.check_transfer_config(bad)
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        startup.check_transfer_config(SimpleNamespace(**{**GOOD, "kv_load_failure_policy": "fail"}))


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
            data = json.loads((tmp_path / f"{name}.json").read_text())
            assert data["namespace"] == f"one-name|{identity}|sim|tp2"
            # the manager's tier 0 is of kind gpu, host memory to the user (the kind kept; no slot tier but it here)
            assert [(t["kind"], t["role"]) for t in data["manager"]["tiers"]] == [("gpu", "host")]
    finally:
        for sim in sims:
            close(sim)


def test_the_tier_roles_keep_the_events_medium() -> None:
    """One table names each kvcm tier for the user and gives its KV events' medium; tier 0 is
    host memory (vLLM's medium CPU), the wire's values unchanged."""
    from kvcm.integrations.vllm.scheduler import MEDIA, TIER_ROLES

    assert MEDIA == ("CPU", "CPU", "STORAGE", "SHARED")
    assert [r.name for r in TIER_ROLES.values()] == ["host", "host", "disk", "shared"]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcm", "vllm", "check-config", *args], capture_output=True,
                          text=True, env=child_env(), timeout=120, check=False)


def test_check_config_command(tmp_path: Path) -> None:
    ok = run_check(json.dumps(GOOD))
    assert ok.returncode == 0, ok.stderr
    # the backend it resolves to, not where it comes from; what it could not check, said
    import kvcm

    assert ok.stdout.strip() == (f"ok: backend {kvcm.backend}; host 1.0 MiB; sizes against vLLM's block NOT checked "
                                 "(give --model DIR and --block-size N)") and ok.stderr == "", ok
    assert "ok: backend python;" in subprocess.run(
        [sys.executable, "-m", "kvcm", "vllm", "check-config", json.dumps(GOOD)], capture_output=True, text=True,
        env=child_env(KVCM_BACKEND="python"), timeout=120, check=False).stdout
    extra = {"host_bytes": "1GiB", "disk_path": str(tmp_path / "d"), "disk_bytes": 1 << 30,
             "shared": str(tmp_path / "s"), "shared_bytes": "8GiB"}
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(extra))
    ok2 = run_check(f"@{path}")
    assert ok2.returncode == 0 and "shared " in ok2.stdout and "cap 8.0 GiB" in ok2.stdout, ok2
    assert 'needs "kv_connector": "KvcmConnector"' in ok2.stderr  # a bare extra config: a reminder
    assert not (tmp_path / "d").exists() and not (tmp_path / "s").exists()  # checked, not created
    for argv, want in [
        ((json.dumps({"host_bytes": "8 gigs"}),), "['host_bytes'] must be a size: bytes as an int >= 0 or a string"),
        ((json.dumps({"host_byte": 8}),), "did you mean 'host_bytes'?"),
        ((json.dumps({**GOOD, "kv_load_failure_policy": "fail"}),), '"kv_load_failure_policy"] must be "recompute"'),
        ((json.dumps({**GOOD, "kv_connector": "LMCacheConnectorV1"}),), '"kv_connector"] must be "KvcmConnector"'),
        ((json.dumps({**GOOD, "kv_connector": "KvcmConnecter"}),), "(a typo of 'KvcmConnector'?)"),
        ((json.dumps({**GOOD, "kv_connector_module_path": "kvcm.integration.vllm"}),),
         "must be \"kvcm.integrations.vllm\", got 'kvcm.integration.vllm' (a typo of 'kvcm.integrations.vllm'?)"),
        ((json.dumps({"disk_path": "/proc/x/kv", "disk_bytes": 1}),), "['disk_path'] '/proc/x/kv' cannot be created"),
        # the capacity rules the engine applies: a 16 KiB host tier holds no 64 KiB block of this model
        ((json.dumps({"host_bytes": "16KiB"}), "--model", str(model_dir(tmp_path, "m", config=LLAMA)), "--block-size", "32"),
         "['host_bytes'] = 16,384 holds no block: one block of vLLM's KV cache is 32,768 bytes (32 tokens x 2 layers)"),
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


def test_check_config_applies_the_engines_capacity_rules(tmp_path: Path) -> None:
    """With the model's directory and the block size, the sizes are checked as the connector
    checks them when vLLM starts it; a model whose layout it cannot read is said, not passed."""
    from kvcm.cli.vllm import model_layout

    m = model_dir(tmp_path, "m", config=LLAMA)
    got = model_layout(str(m), 32, dtype="float32")
    assert not isinstance(got, str) and got[0].page_bytes == PAGE == layout2().page_bytes, got
    auto = model_layout(str(m), 32)  # vLLM's dtype auto runs float32 weights in bfloat16
    assert not isinstance(auto, str) and auto[0].page_bytes == PAGE // 2 and ":bfloat16:" in auto[0].describe
    ok = run_check(json.dumps({"host_bytes": "1MiB"}), "--model", str(m), "--block-size", "32", "--max-model-len", "512",
                   "--dtype", "float32")
    assert ok.returncode == 0 and "vLLM block 32 tokens = 64.0 KiB per kvcm page (2 layers, float32), host 16 blocks" \
        in ok.stdout, ok
    warn = run_check(json.dumps({"host_bytes": "256KiB"}), "--model", str(m), "--block-size", "32",
                     "--max-model-len", "512", "--dtype", "float32")
    assert warn.returncode == 0 and "holds 4 blocks of 65,536 bytes; one request of max_model_len 512" in warn.stderr
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "config.json").write_text(json.dumps({"sliding_window": 64, "num_hidden_layers": 2}))
    sw = run_check(json.dumps({"host_bytes": "16KiB"}), "--model", str(tmp_path / "sw"), "--block-size", "32")
    assert sw.returncode == 0 and "sizes against vLLM's block NOT checked: " in sw.stdout and "sliding-window" in sw.stdout
    hub = run_check(json.dumps({"host_bytes": "16KiB"}), "--model", "meta-llama/Llama-3-8B", "--block-size", "32")
    assert "NOT checked: no meta-llama/Llama-3-8B/config.json (a hub name is not read" in hub.stdout, hub


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcm", "vllm", *args], capture_output=True, text=True,
                          env=child_env(**(env or {})), timeout=120, check=False)


def test_config_writes_the_kv_transfer_config_in_one_line(tmp_path: Path) -> None:
    p = run_cli("config", "--host", "8GiB", "--disk", f"{tmp_path / 'disk'}:1GiB", "--shared", str(tmp_path / "s"),
                "--shared-size", "2GiB", "--set", "load_mode=async", "--set", "shared_timeout_s=2.5")
    assert p.returncode == 0 and p.stderr == "" and len(p.stdout.splitlines()) == 1, p
    data = json.loads(p.stdout)
    assert {k: v for k, v in data.items() if k != "kv_connector_extra_config"} == {k: v for k, v in GOOD.items()
                                                                                   if k != "kv_connector_extra_config"}
    assert data["kv_connector_extra_config"] == {"host_bytes": "8GiB", "disk_path": str(tmp_path / "disk"),
                                                 "disk_bytes": "1GiB", "shared": str(tmp_path / "s"),
                                                 "shared_bytes": "2GiB", "load_mode": "async", "shared_timeout_s": 2.5}
    s = startup.check_transfer_config(data)  # what the connector reads from it
    assert (s.host_bytes, s.disk_bytes, s.shared_bytes, s.load_mode) == (8 << 30, 1 << 30, 2 << 30, "async")
    assert json.loads(run_cli("config").stdout)["kv_connector_extra_config"] == {}  # every default
    for args, want in [(("--host", "8 gigs"), "['host_bytes'] must be a size"),
                       (("--set", "host_byte=8"), "did you mean 'host_bytes'?"),
                       (("--set", "copy_fault_hook=x"), "'module:function'"),
                       (("--set", "nokey"), "--set takes KEY=VALUE")]:
        bad = run_cli("config", *args)
        assert bad.returncode == 2 and bad.stdout == "" and want in bad.stderr and len(bad.stderr.splitlines()) == 1, bad
    assert run_cli("config", "--disk", "/no-size").returncode == 2
    assert not (tmp_path / "disk").exists()  # checked, not created


def test_a_configuration_error_is_one_error_line_in_vllms_log(caplog) -> None:
    """The connector's constructor logs a refused configuration at ERROR on vLLM's logger
    before raising (``startup.report_error``): one line, naming the key."""
    bad = SimpleNamespace(kv_connector="KvcmConnector", kv_connector_extra_config={"host_bytes": "8 gigs"},
                          kv_load_failure_policy="recompute")
    with caplog.at_level("ERROR", logger="vllm.kvcm"), pytest.raises(ValueError, match="must be a size"):
        try:
            startup.check_transfer_config(bad)
        except ValueError as e:  # what KvcmConnector.__init__ does with it
            startup.report_error(e)
            raise
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].name == "vllm.kvcm", caplog.records
    msg = errors[0].getMessage()
    assert msg.startswith("kvcm: kv_connector_extra_config['host_bytes'] must be a size") and "\n" not in msg


def test_a_store_written_under_another_layout_is_one_warning(tmp_path: Path) -> None:
    """A directory store that holds this model's KV under another block size / dtype / TP
    size: one warning naming what differs and what to change; the same layout again, another
    model, or another namespace: none.  The record is 0600 in a 0700 directory, and the
    store's quota scan does not count it."""
    from kvcm.dataplane.store import FileStore
    from kvcm.integrations.vllm.layouts import LAYOUTS_DIR

    store = tmp_path / "store"
    d = model_dir(tmp_path, "m")
    facts = startup.EngineFacts(max_model_len=512, vllm_blocks=16, device="cpu", enable_prefix_caching=True)
    s = ConnectorSettings.parse({"shared": str(store), "shared_namespace": "ns"})
    prepared = startup.prepare(s, layout2(), facts, ModelSource(str(d)))
    assert startup.shared_layout_warning(s, layout2(), prepared) is None  # an empty store
    assert startup.shared_layout_warning(s, layout2(), prepared) is None  # its own layout again
    b16 = KvLayout(16, layout2().layer_names, (PAGE // 2,) * 2, layout2().describe.replace(":B32", ":B16"))
    w = startup.shared_layout_warning(s, b16, prepared)
    assert w is not None and "\n" not in w, w
    assert (f"the shared tier at {store} holds this model's KV written under another layout: block size 32 "
            "(this instance: 16)") in w and "start vLLM with --block-size 32" in w, w
    tp2 = startup.shared_layout_warning(s, layout2(), prepared, world=2)  # both earlier layouts differ from it
    assert "tensor parallel size 1 (this instance: 2)" in tp2 and "--tensor-parallel-size 1" in tp2, tp2
    bf16 = KvLayout(32, layout2().layer_names, (PAGE // 2,) * 2, layout2().describe.replace("float32", "bfloat16"))
    assert "dtype float32 (this instance: bfloat16)" in startup.shared_layout_warning(s, bf16, prepared)
    other_ns = ConnectorSettings.parse({"shared": str(store), "shared_namespace": "other"})
    assert startup.shared_layout_warning(other_ns, b16, startup.prepare(other_ns, b16, facts, ModelSource(str(d)))) is None
    p2 = startup.prepare(s, b16, facts, ModelSource(str(model_dir(tmp_path, "m2", seed=5))))
    assert p2.tag != prepared.tag and startup.shared_layout_warning(s, b16, p2) is None  # another model
    folder = store / LAYOUTS_DIR
    assert folder.stat().st_mode & 0o777 == 0o700
    files = list(folder.iterdir())
    assert len(files) == 3 and all(f.stat().st_mode & 0o777 == 0o600 for f in files), files
    fs = FileStore(str(store), quota_bytes=1 << 20)
    try:
        assert fs._objects() == [] and fs.skipped == 0  # the quota neither counts nor trips on the record
    finally:
        fs.close()
    mooncake = ConnectorSettings.parse({"shared": "mooncake://h:1?metadata=http://h:2/metadata", "model_identity": "off",
                                        "shared_namespace": "x"})
    assert startup.shared_layout_warning(mooncake, b16, startup.Prepared(None, [])) is None


def test_readme_config_file_block_runs_as_written(tmp_path: Path) -> None:
    """The README's config-file block (``<!-- shell: vllm-config-file -->``), run by bash with
    only ``/tmp/kvcm`` replaced: check-config reads the YAML, and ``config`` picks it up
    through KVCM_CONFIG (the keys it holds are not repeated inline)."""
    from readme_examples import SHELL

    env = child_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    root = str(tmp_path / "kvcm")
    p = subprocess.run(["bash", "-c", SHELL["vllm-config-file"].replace("/tmp/kvcm", root)], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and p.stderr.startswith('warning: the kv_transfer_config around it also needs'), p
    check, printed = p.stdout.splitlines()
    import kvcm

    assert check.startswith(f"ok: backend {kvcm.backend}; host 8.0 GiB; disk 10.0 GiB at {root}/disk; "
                            f"keys from {root}/kvcm.yaml"), check
    assert json.loads(printed)["kv_connector_extra_config"] == {}  # the file's keys come from KVCM_CONFIG at start
    assert (tmp_path / "kvcm" / "kvcm.yaml").exists() and not (tmp_path / "kvcm" / "disk").exists()


def test_a_mistyped_connector_class_is_named_with_the_fix(caplog) -> None:
    """vLLM resolves ``kv_connector`` with getattr on kvcm's module: a near miss of
    KvcmConnector is one ERROR line and an AttributeError saying which name was meant; other
    missing attributes stay plain AttributeErrors (hasattr probes stay silent)."""
    import kvcm.integrations.vllm as pkg

    with caplog.at_level("ERROR", logger="vllm.kvcm"), pytest.raises(AttributeError, match="did you mean 'KvcmConnector'"):
        pkg.KvcmConector  # noqa: B018
    want = ("kvcm: kv_transfer_config[\"kv_connector\"] 'KvcmConector' is not a class of kvcm.integrations.vllm: "
            "did you mean 'KvcmConnector'?")
    assert [r.getMessage() for r in caplog.records] == [want]
    caplog.clear()
    assert not hasattr(pkg, "SomethingElse") and not hasattr(pkg, "__wrapped__") and caplog.records == []


def test_make_model_saves_what_vllm_runs_privately(tmp_path: Path) -> None:
    """``make-model DIR``: a bfloat16 Llama and its tokenizer, 0600 files in a 0700 directory;
    check-config reads its layout (the walk-through's page: 32 KiB); a second call reuses it."""
    pytest.importorskip("transformers")
    d = tmp_path / "m"
    p = run_cli("make-model", str(d))
    assert p.returncode == 0 and p.stdout.strip() == str(d), p
    assert d.stat().st_mode & 0o777 == 0o700 and {f.stat().st_mode & 0o777 for f in d.iterdir()} == {0o600}
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16" and (d / "tokenizer.json").exists()
    ok = run_check(json.dumps({"host_bytes": "1MiB"}), "--model", str(d), "--block-size", "32", "--max-model-len", "512")
    assert "32.0 KiB per kvcm page (2 layers, bfloat16), host 32 blocks" in ok.stdout, ok
    before = (d / "model.safetensors").stat().st_mtime_ns
    assert run_cli("make-model", str(d)).returncode == 0 and (d / "model.safetensors").stat().st_mtime_ns == before
