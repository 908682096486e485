"""``python -m kvcm bench vllm`` without an engine: its arguments (bad ones exit 2 before
anything runs), the plan they give (the held-out chat workload's working set, the limit's
cache, the core layout every engine gets), the table's figures and ratios from given phase
results, and the whole pipeline with the engine processes replaced by a stand-in that
records the environment it was started with.  The real engines run in the vllm leg
(tests/engines/test_vllm_bench_engines.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from typing import ClassVar

import pytest
from kvcm.bench import vllm as bench
from kvcm.bench import vllm_plan as bench_plan
from kvcm.bench import vllm_report as bench_report
from kvcm.bench.vllm_workload import PrefillFloor


def plan(*argv: str) -> bench_plan.Plan:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return bench_plan.make_plan(p.parse_args(list(argv)))


def usage_error(capsys, monkeypatch, *argv: str) -> str:
    """main(argv) must exit 2 with one line naming the problem, without running anything."""
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran despite bad arguments"))
    with pytest.raises(SystemExit) as e:
        bench.main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_default_chat_plan_is_the_held_out_workload():
    """10 chats x 5 turns, system 384, 96 user tokens + a 16-token reply a turn: 192 blocks
    of 32 with vLLM's cache at 32 blocks (the issue's figures); one request at a time; every
    engine gets VLLM_CPU_NUM_OF_RESERVED_CPU=1."""
    p = plan()
    assert p.sizes["conversations"] == 10 and p.sizes["turns"] == 5 and p.sizes["system_len"] == 384
    assert p.sizes["user_len"] + p.sizes["max_tokens"] == 112 and p.sizes["gpu_blocks"] == 32
    assert p.working_set == 192 and p.requests == 50 and p.batch == 1
    assert p.reserved_cpus == 1 and p.configs == list(bench_plan.DEFAULT_CONFIGS) and p.reference == "vllm"
    assert p.max_model_len == 960  # the longest prompt + reply, whole blocks
    assert p.limit_blocks >= p.working_set + p.extra["max_num_seqs"]
    assert "example" not in p.configs


def test_together_submits_each_turn_at_once_and_long_has_its_own_sizes():
    together = plan("--together")  # 20 chats; vLLM's cache holds the live batch (4 chats at their longest)
    assert together.batch == 20 and together.sizes["gpu_blocks"] == 4 * (together.max_model_len // 32) + 1
    assert together.sizes["gpu_blocks"] < together.working_set
    # kvcm's host tier holds the live requests' pages: a quarter of the working set, at least the live batch
    assert together.sizes["host_blocks"] == max(-(-together.working_set // 4), together.sizes["gpu_blocks"])
    assert plan("--batch", "3").batch == 3
    long = plan("--workload", "long", "--together")
    assert long.batch == long.sizes["documents"] and long.requests == long.sizes["documents"] * long.sizes["questions"]
    s = long.sizes
    assert s["doc_len"] >= 2048 and s["questions"] >= 2  # documents of several thousand tokens
    doc_blocks = s["doc_len"] // 32
    # the documents alone do not fit vLLM's shrunk cache: round-robin questions miss there
    assert s["documents"] * doc_blocks > s["gpu_blocks"] and long.working_set > s["documents"] * doc_blocks
    assert long.max_model_len >= s["doc_len"] + s["question_len"] + s["max_tokens"]


def test_configs_run_in_order_and_the_layout_option():
    p = plan("--configs", "shared2,vllm,shared1,example", "--reserved-cpus", "vllm")
    assert p.configs == ["vllm", "example", "shared1", "shared2"] and p.reserved_cpus is None
    assert plan("--configs", "limit,host").reference == "limit"
    assert plan("--reserved-cpus", "0").reserved_cpus == 0


@pytest.mark.parametrize(("argv", "says"), [
    (("--configs", "vllm,kvcm"), "unknown ['kvcm']"),
    (("--configs", "host,host+disk"), "needs vllm or limit"),
    (("--configs", "vllm,shared2"), "name shared1 too"),
    (("--configs", "vllm,vllm"), "twice"),
    (("--documents", "3"), "--documents is an option of --workload long"),
    (("--workload", "long", "--turns", "3"), "--turns is an option of --workload chat"),
    (("--gpu-blocks", "20"), "give at least 31"),
    (("--batch", "0"), "--batch must be at least 1"),
    (("--batch", "2", "--together"), "not allowed with argument"),
    (("--reserved-cpus", "two"), "a number of cores or 'vllm'"),
    (("--reserved-cpus", "-1"), "0 or more"),
    (("--limit-blocks", "100"), "smaller than the working set (192 blocks)"),
    (("--turns", "0"), "--turns must be at least 1"),
    (("--warmup", "-1"), "--warmup must be 0 or more"),
    (("--workload", "huge"), "invalid choice"),
    (("--load-mode", "eager"), "argument --load-mode: invalid choice"),
])
def test_bad_arguments_exit_2_before_anything_runs(capsys, monkeypatch, argv, says):
    err = usage_error(capsys, monkeypatch, *argv)
    assert says in err, err


def test_engine_specs_share_everything_but_the_cache_and_the_connector(tmp_path):
    p = plan()
    specs = {k: bench_plan.engine_spec(str(tmp_path), "model", k, p) for k in bench_plan.CONFIGS}
    for k, s in specs.items():
        assert s["max_model_len"] == 960 and s["max_tokens"] == 16 and s["workload"]["batch"] == 1
        assert s["kv_cache_memory_bytes"] == s["gpu_blocks"] * bench_plan.PAGE
        assert [ph["name"] for ph in s["phases"]] == ["warmup", "main"] and s["phases"][1]["reset"]
        assert s["gpu_blocks"] == (p.limit_blocks if k == "limit" else 32), k
    assert specs["vllm"]["connector"] is None and specs["limit"]["connector"] is None
    assert specs["example"]["connector"]["kv_connector"] == "ExampleConnector"
    host = specs["host"]["connector"]["kv_connector_extra_config"]
    disk = specs["host+disk"]["connector"]["kv_connector_extra_config"]
    s1, s2 = (specs[k]["connector"]["kv_connector_extra_config"] for k in ("shared1", "shared2"))
    assert "disk_path" not in host and host["host_bytes"] == 64 * bench_plan.PAGE
    assert disk["disk_bytes"] == 2 * 192 * bench_plan.PAGE and "shared" not in disk
    assert s1["shared"] == s2["shared"] and s1["disk_path"] != s2["disk_path"]
    assert len({c["stats_file"] for c in (host, disk, s1, s2)}) == 4
    assert bench_plan.engine_spec(str(tmp_path), "model", "vllm", plan("--warmup", "0"))["phases"] == [{"name": "main"}]


def test_kvcm_engines_configs_are_the_connectors_and_the_load_mode_option(tmp_path):
    """Every kvcm engine's kv_connector_extra_config parses as the connector's settings;
    --load-mode reaches every kvcm engine (none without it: the connector's default)."""
    from kvcm.integrations.vllm.settings import ConnectorSettings

    kvcm_keys = ("host", "host+disk", "shared1", "shared2")
    for argv, mode in (((), "auto"), (("--load-mode", "sync"), "sync"), (("--load-mode", "async"), "async")):
        p = plan(*argv)
        for k in kvcm_keys:
            extra = bench_plan.engine_spec(str(tmp_path), "model", k, p)["connector"]["kv_connector_extra_config"]
            assert ("load_mode" in extra) == bool(argv), (k, extra)
            assert ConnectorSettings.parse(extra).load_mode == mode
    assert "kvcm's load_mode: sync" in bench_report.header(plan("--load-mode", "sync"), bench_plan.MODEL)


def test_page_is_a_block_of_every_layer():
    m = bench_plan.MODEL
    assert bench_plan.PAGE == 32 * m["num_hidden_layers"] * m["num_key_value_heads"] * 64 * 2 * 4


def test_core_layout_reads_vllms_binding_log():
    log = ("INFO 05-01 [ompmultiprocessing.py:180] OpenMP thread binding info: \n"
           "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False\n"
           "\tlocal_world_size=1, reserve_cpu_num=1\n\tlocal_rank=0, core ids=[0]\n\treserved_cpus=[1]\n")
    assert bench.core_layout(log) == "reserve_cpu_num=1, OpenMP threads on cores [0], reserved [1]"
    assert bench.core_layout("no binding here") == "not in vLLM's log"


def test_prefill_floor_reuses_whole_blocks_computed_before():
    f = PrefillFloor(4)
    a = list(range(1, 11))  # 10 tokens: 2 whole blocks
    f.submit(a)
    assert f.tokens == 10
    f.finish(a, [50, 51, 52])  # computed: a + [50, 51] = 12 tokens, 3 blocks
    f.submit(a + [50, 51, 52, 60])  # 14 tokens: blocks 0-2 seen, block 3 not full
    assert f.tokens == 10 + 2
    g = PrefillFloor(4)
    g.submit(list(range(8)))
    g.submit(list(range(8)))  # the same 2 blocks: the last token is computed, so 1 block reused
    assert g.tokens == 8 + 4
    g.submit([99] + list(range(1, 8)))  # another first block: the chain differs, nothing reused
    assert g.tokens == 8 + 4 + 8


def phase(outputs, ttft, decode, prompt=100, cached=0, hits=None, before=None, floor=40, seconds=2.0):
    stats = None if hits is None else {"counters": {f"hit_blocks_{t}": v for t, v in hits.items()}}
    return {"outputs": outputs, "ttft": ttft, "decode": decode, "prompt_tokens": prompt, "cached_tokens": cached,
            "floor_prefill_tokens": floor, "seconds": seconds, "loadavg_before": [1.0, 1.0, 1.0],
            "loadavg_after": [1.5, 1.0, 1.0], "reset": True, "stats": stats,
            "stats_before": None if before is None else {"counters": {f"hit_blocks_{t}": v for t, v in before.items()}}}


def result(ph, layout="reserve_cpu_num=1, OpenMP threads on cores [0], reserved [1]"):
    return {"phase": ph, "layout": layout, "seconds": 60.0, "start_seconds": 40.0}


def test_summary_figures_and_ratios():
    p = plan("--configs", "vllm,limit,host+disk")
    out = [[1, 2], [3, 4]]
    results = {
        "vllm": result(phase(out, [0.010, 0.020, 0.030, 0.040, 0.050], [0.002, 0.004], cached=20, seconds=8.0)),
        "limit": result(phase(out, [0.005] * 5, [0.002], cached=60, seconds=4.0)),
        "host+disk": result(phase([[1, 2], [3, 5]], [0.004, 0.006], [0.003, 0.003], cached=60, seconds=6.0,
                                  hits={"host": 10, "disk": 7, "shared": 0}, before={"host": 4, "disk": 0,
                                                                                       "shared": 0})),
    }
    r = bench_report.summarize(p, results, bench_plan.CONFIGS)
    v, lim, kv = r["rows"]
    assert v["ttft_p50_ms"] == pytest.approx(30) and v["ttft_p90_ms"] == pytest.approx(46)
    assert v["decode_ms_p50"] == pytest.approx(3) and v["prefill_tokens"] == 80 and v["hits"] is None
    assert kv["hits"] == {"host": 6, "disk": 7, "shared": 0}  # the phase's own, not the warm-up's
    assert kv["ttft_p50_ms_x_vllm"] == pytest.approx(5 / 30) and kv["ttft_p50_ms_x_limit"] == pytest.approx(1.0)
    assert kv["wall_s_x_vllm"] == pytest.approx(0.75) and kv["wall_s_x_limit"] == pytest.approx(1.5)
    assert kv["prefill_x_floor"] == pytest.approx(1.0) and v["prefill_x_floor"] == pytest.approx(2.0)
    # vLLM alone is the reference (compared with nothing); limit and kvcm against its outputs
    assert v["exact"] is None and lim["exact"] and kv["exact"] is False and kv["mismatched"] == 1
    assert r["floor_prefill_tokens"] == 40 and r["working_set_blocks"] == 192 and r["reserved_cpus"] == 1
    md = bench_report.markdown(p, r, bench_plan.MODEL)
    assert "| kvcm host+disk | 100 | 40 | 6 / 7 / 0 | 5 | 6 | 3.0 | 6.0 | - | NO (1 requests differ) |" in md
    assert md.count("| reference |") == 1 and "| yes |" in md
    assert "| kvcm host+disk | 0.17x | 1.00x | - | 0.75x | 1.50x | - | 1.00x | 1.00x |" in md
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1 in every engine" in md and "every engine logged: reserve_cpu_num=1" in md
    assert "**outputs differ from vLLM alone's: kvcm host+disk**" in md


def test_connector_time_splits_the_steps_path_from_the_transfer_thread():
    """kvcm's time in the phase from its stats file (after minus before): the scheduler's hooks
    and the worker's synchronous loads are on the step's path, copy runs, async loads and
    saves on the transfer thread; the warm-up's share is not counted."""
    p = plan("--configs", "vllm,host+disk")
    kv = phase([[1]], [0.01], [0.001], hits={"host": 3, "disk": 2, "shared": 0})
    kv["stats_before"] = {"counters": {"loads_sync": 1}, "seconds": {"match": 0.5, "meta": 0.25},
                          "worker": {"saves_us": 1_000_000, "sync_load_us": 250_000}, "waits": {"async_load_s": 1.0}}
    kv["stats"] = {"counters": {"hit_blocks_host": 3, "hit_blocks_disk": 2, "loads_sync": 4, "loads_async": 2,
                                "saves_deferred": 1},
                   "seconds": {"match": 1.5, "meta": 0.75, "alloc": 0.25},
                   "worker": {"saves_us": 3_000_000, "loads_us": 500_000, "runs_us": 250_000, "saved_bytes": 99,
                              "sync_load_us": 750_000, "sync_wait_us": 500_000},
                   "waits": {"async_load_s": 3.5}}
    r = bench_report.summarize(p, {"vllm": result(phase([[1]], [0.01], [0.001])), "host+disk": result(kv)},
                               bench_plan.CONFIGS)
    v, c = r["rows"][0], r["rows"][1]["connector"]
    assert v["connector"] is None
    assert c["scheduler_s"] == {"match": 1.0, "meta": 0.5, "alloc": 0.25}
    assert c["worker_step_s"] == {"sync_wait_us": 0.5, "sync_load_us": 0.5, "preempt_wait_us": 0.0}
    assert c["step_s"] == pytest.approx(2.75) and c["transfer_s"] == pytest.approx(2.75)
    assert c["transfer_parts_s"] == {"saves_us": 2.0, "loads_us": 0.5, "runs_us": 0.25}
    assert c["async_wait_s"] == pytest.approx(2.5)
    assert (c["loads_sync"], c["loads_async"], c["saves_deferred"]) == (3, 2, 1)
    md = bench_report.markdown(p, r, bench_plan.MODEL)
    assert ("kvcm's time, kvcm host+disk: 2.75 s on the step's path (scheduler hooks 1.75, sync loads 0.50 + "
            "waiting for queued writes 0.50, preemptions waiting for saves 0.00); 2.75 s on its transfer thread; "
            "requests waited 2.50 s for async loads (summed); loads 3 sync / 2 async, 1 saves deferred") in md


def test_summary_without_vllm_and_with_mixed_layouts():
    p = plan("--configs", "limit,host", "--reserved-cpus", "vllm")
    results = {"limit": result(phase([[1]], [0.01], [])),
               "host": result(phase([[1]], [0.02], [0.001]), "reserve_cpu_num=2, OpenMP threads on cores [0,1], "
                                                            "reserved []")}
    r = bench_report.summarize(p, results, bench_plan.CONFIGS)
    lim, host = r["rows"]
    assert lim["decode_ms_p50"] is None and host["ttft_p50_ms_x_vllm"] is None and host["exact"]
    assert host["ttft_p50_ms_x_limit"] == pytest.approx(2.0)
    md = bench_report.markdown(p, r, bench_plan.MODEL)
    assert "different core layouts" in md and "vLLM's own choice per engine" in md


def test_percentile():
    assert bench_report.percentile([3.0], 90) == 3.0
    assert bench_report.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        bench_report.percentile([], 50)


class FakeEngine:
    """Stands in for ``subprocess.Popen`` of a workload child: records the environment, logs
    vLLM's binding line for the reserved cores it was given, writes a result (greedy outputs
    that differ for ``wrong``)."""

    envs: ClassVar[dict[str, dict]] = {}
    wrong: ClassVar[set[str]] = set()
    kill: ClassVar[set[str]] = set()  # killed (SIGTERM) at their first start
    starts: ClassVar[list[str]] = []

    def __init__(self, argv, stdout, stderr, env, start_new_session):
        assert start_new_session and stderr == subprocess.STDOUT
        spec_path, out_path = argv[-2:]
        with open(spec_path) as f:
            spec = json.load(f)
        key = os.path.basename(spec_path).split(".")[0]
        FakeEngine.envs[key] = dict(env)
        FakeEngine.starts.append(key)
        self.rc = -15 if key in FakeEngine.kill else 0
        FakeEngine.kill.discard(key)
        extra = (spec["connector"] or {}).get("kv_connector_extra_config", {})
        if "shared" in extra:  # what the engine writes: the rerun must not find the killed one's
            os.makedirs(extra["shared"], exist_ok=True)
            mark = os.path.join(extra["shared"], key)
            assert not os.path.exists(mark), "a rerun found the store its killed run wrote"
            open(mark, "w").close()
        reserved = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "2" if spec["connector"] else "1")
        stdout.write(f"\tlocal_world_size=1, reserve_cpu_num={reserved}\n\tlocal_rank=0, core ids=[0]\n"
                     f"\treserved_cpus=[1]\n")
        out = [[7, 8]] if key in FakeEngine.wrong else [[7, 7]]
        main = {**phase(out, [0.02, 0.03], [0.001], prompt=64, cached=32 if spec["connector"] else 0), "name": "main"}
        with open(out_path, "w") as f:
            json.dump({"start_seconds": 1.0, "phases": [{"name": "warmup"}, main]}, f)

    def wait(self, timeout=None):
        return self.rc


def fake_run(tmp_path, monkeypatch, capsys, *argv):
    # matplotlib's first import lists the system fonts through subprocess (fc-list): done
    # before Popen is replaced below (which replaces it in the subprocess module itself)
    import matplotlib.pyplot  # noqa: F401
    from kvcm.bench import vllm_workload as workload

    FakeEngine.envs, FakeEngine.starts = {}, []
    monkeypatch.setattr(workload, "make_model", lambda path, **kw: path)
    monkeypatch.setattr(bench.subprocess, "Popen", FakeEngine)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "5")  # the caller's own setting never leaks in
    js = tmp_path / "out.json"
    rc = bench.main(["--dir", str(tmp_path / "work"), "--json", str(js), "--plot", str(tmp_path / "p.png"),
                     "--settle-s", "0", *argv])
    return rc, json.loads(js.read_text()), capsys.readouterr().out


OLD_DEFAULTS = ("--configs", "vllm,limit,host,host+disk,shared1,shared2")


def test_every_engine_gets_the_same_reserved_cores(tmp_path, monkeypatch, capsys):
    FakeEngine.wrong = set()
    rc, report, out = fake_run(tmp_path, monkeypatch, capsys, *OLD_DEFAULTS)
    assert rc == 0
    assert set(FakeEngine.envs) == {"vllm", "limit", "host", "host-disk", "shared1", "shared2"}
    assert {e["VLLM_CPU_NUM_OF_RESERVED_CPU"] for e in FakeEngine.envs.values()} == {"1"}
    assert report["layouts"] == ["reserve_cpu_num=1, OpenMP threads on cores [0], reserved [1]"]
    assert [r["config"] for r in report["rows"]][:2] == ["vllm", "limit (vllm, cache = working set)"]
    assert "every engine logged: reserve_cpu_num=1" in out and (tmp_path / "p.png").stat().st_size > 0


def test_vllms_own_layout_is_shown_to_differ_and_a_wrong_output_fails(tmp_path, monkeypatch, capsys):
    FakeEngine.wrong = {"host"}
    rc, report, out = fake_run(tmp_path, monkeypatch, capsys, "--configs", "vllm,host", "--reserved-cpus", "vllm",
                               "--plot", "")
    assert rc == 1
    assert all("VLLM_CPU_NUM_OF_RESERVED_CPU" not in e for e in FakeEngine.envs.values())
    assert len(report["layouts"]) == 2 and "different core layouts" in out
    assert [r["exact"] for r in report["rows"]] == [None, False]


def test_an_engine_killed_from_outside_runs_again_once_from_a_clean_start(tmp_path, monkeypatch, capsys):
    FakeEngine.wrong, FakeEngine.kill = set(), {"shared1"}
    rc, report, out = fake_run(tmp_path, monkeypatch, capsys, "--configs", "vllm,shared1,shared2", "--plot", "")
    assert rc == 0 and FakeEngine.starts == ["vllm", "shared1", "shared1", "shared2"]
    assert [r["killed_before"] for r in report["rows"]] == [None, 15, None]
    assert "killed from outside the bench, then run again from a clean start: kvcm +shared (1st) (signal 15)" in out
    FakeEngine.kill = {"vllm"}
    monkeypatch.setattr(FakeEngine, "wait", lambda self, timeout=None: -9)  # killed again: the run ends
    with pytest.raises(bench.EngineKilled, match="killed by signal 9"):
        fake_run(tmp_path, monkeypatch, capsys, "--configs", "vllm")
    assert "the work dir is kept for its logs" in capsys.readouterr().err


def test_a_second_run_in_the_same_dir_starts_every_engine_clean(tmp_path, monkeypatch, capsys):
    """``--dir`` reused: shared1 must not find the store the earlier run's shared1 wrote (the
    stand-in engine asserts it), shared2 finds this run's."""
    FakeEngine.wrong, FakeEngine.kill = set(), set()
    for _ in range(2):
        rc, _, _ = fake_run(tmp_path, monkeypatch, capsys, "--configs", "vllm,shared1,shared2", "--plot", "")
        assert rc == 0 and FakeEngine.starts == ["vllm", "shared1", "shared2"]
    assert sorted(os.listdir(tmp_path / "work" / "shared")) == ["shared1", "shared2"]


class FakeMaster:
    """Stands in for ``LocalMooncake(client=False)``: an address, stopped once."""

    made: ClassVar[list] = []

    def __init__(self, segment_bytes=0, client=True, log_dir=None):
        assert segment_bytes == 0 and client is False
        self.master_addr, self.stopped = "127.0.0.1:12345", False
        FakeMaster.made.append(self)

    def stop(self):
        self.stopped = True


def test_mooncake_store_engine_gets_its_master_and_a_store_of_the_working_set(tmp_path, monkeypatch, capsys):
    """vLLM's MooncakeStoreConnector beside kvcm: a master of its own on 127.0.0.1 for the
    engine's run (stopped after it), MOONCAKE_CONFIG_PATH naming a 0600 config (embedded,
    P2P handshake, TCP) whose segment holds the working set; kvcm's host tier beside it is
    as large; both rows in the report with ratios against the store connector."""
    from kvcm.dataplane import mooncake_store

    FakeEngine.wrong, FakeMaster.made = set(), []
    monkeypatch.setattr(mooncake_store, "LocalMooncake", FakeMaster)
    rc, report, _ = fake_run(tmp_path, monkeypatch, capsys, "--configs", "vllm,limit,mooncake-store,host-equal",
                               "--repeat", "2")
    assert rc == 0 and len(FakeMaster.made) == 2 and all(m.stopped for m in FakeMaster.made)
    env = FakeEngine.envs["mooncake-store"]
    path = env["MOONCAKE_CONFIG_PATH"]
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        cfg = json.load(f)
    p = plan()
    assert cfg["master_server_address"] == "127.0.0.1:12345" and cfg["metadata_server"] == "P2PHANDSHAKE"
    assert cfg["protocol"] == "tcp" and cfg["mode"] == "embedded"
    assert cfg["global_segment_size"] == p.store_blocks * bench_plan.PAGE >= p.working_set * bench_plan.PAGE
    assert "MOONCAKE_CONFIG_PATH" not in FakeEngine.envs["host-equal"]
    spec = bench_plan.engine_spec(str(tmp_path), "model", "host-equal", p)
    assert spec["connector"]["kv_connector_extra_config"]["host_bytes"] == cfg["global_segment_size"]
    assert bench_plan.engine_spec(str(tmp_path), "m", "mooncake-store", p)["connector"]["kv_connector"] == \
        "MooncakeStoreConnector"
    rows = {r["key"]: r for r in report["rows"]}
    assert rows["host-equal"]["ttft_p50_ms_x_mooncake-store"] is not None and len(rows["host-equal"]["runs"]) == 2
    assert FakeEngine.starts.count("mooncake-store") == 2  # interleaved: every config once, then again
    assert FakeEngine.starts[:4] == FakeEngine.starts[4:]


def test_a_run_started_above_the_quiet_load_is_marked_noisy(tmp_path, monkeypatch, capsys):
    """The load average before each engine is printed and a run that started above 1.0 is
    marked NOISY in the table."""
    FakeEngine.wrong = set()
    loads = iter([2.5, 2.5, 0.3, 0.3] * 4)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    _, report, out = fake_run(tmp_path, monkeypatch, capsys, "--configs", "vllm,limit")
    rows = {r["key"]: r for r in report["rows"]}
    assert rows["vllm"]["noisy"] and not rows["limit"]["noisy"]
    assert "2.50 NOISY" in out
