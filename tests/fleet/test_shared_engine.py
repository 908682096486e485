"""Proof across processes (issue 11): separate engine processes (``kvcm.tools.engine_instance``, via
tests/shared_engine_child.py) share one store — a directory of files or a real Mooncake
Store — and a later process reuses an earlier one's prefill, with generated tokens and
logits equal to a run with no cache at all; also under faults (objects deleted or truncated
between lookup and load, foreign objects, failed writes, the store going down).

Runs on the env-selected backend (each CI leg: python, cpp); the children inherit it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from children import child_env
from kvcm.dataplane.store import OBJECT_SUFFIX
from kvcm.engine import TinyHybridModel, torch_threads

CHILD = Path(__file__).resolve().parents[1] / "shared_engine_child.py"
LOGIT_TOL = 1e-4  # float32 round-off of the paged vs the dense computation (test_engine_exactness)
WORKLOAD = "shared-system-prompt"
# A fresh process with an empty store reuses only within itself: this many tokens
# (measured; asserted in test_first_process_reuses_only_its_own).
LOCAL_ONLY_REUSED = 336


@pytest.fixture(scope="module")
def model() -> TinyHybridModel:
    return TinyHybridModel()


def child_command(store: str, tmp_path: Path, name: str, *extra: str, backend: str) -> tuple[list[str], dict]:
    """The command line and environment of one child process (its JSON: ``<name>.json``)."""
    env = child_env(KVCM_BACKEND=backend)  # the child imports this process's kvcm (issue #18 item 13)
    if "--workload" not in extra:
        extra = ("--workload", WORKLOAD, *extra)
    return [sys.executable, str(CHILD), "--shared-tier", store, "--json", str(tmp_path / f"{name}.json"), *extra], env


def child_result(tmp_path: Path, name: str, backend: str) -> dict:
    res = json.loads((tmp_path / f"{name}.json").read_text())
    assert res["backend"] == backend
    return res


def run_child(store: str, tmp_path: Path, name: str, *extra: str, backend: str) -> dict:
    cmd, env = child_command(store, tmp_path, name, *extra, backend=backend)
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return child_result(tmp_path, name, backend)


def assert_exact(model: TinyHybridModel, res: dict) -> None:
    """The child's own check, and the same check here, in this process."""
    assert res["tokens_equal"] and res["max_logit_diff"] < LOGIT_TOL
    with torch_threads(1):
        for r in res["requests"]:
            ref = model.reference_logits(r["prompt"], r["output"])
            assert ref.argmax(-1).tolist() == r["output"]
            assert float((torch.tensor(r["logits"]) - ref).abs().max()) < LOGIT_TOL


def assert_reused_from_shared(res: dict) -> None:
    """The process really took pages from tier 3: hits, onboard ops from the shared tier,
    and more reuse than a process on its own gets — with at most one lookup per request
    (one batched existence query, never one per block)."""
    assert res["counters"]["shared_hits"] > 0
    assert 0 < res["shared"]["lookups"] <= res["counters"]["requests"]
    assert res["routes"].get("shared->gpu", 0) > 0
    assert res["shared"]["loads"] == res["routes"]["shared->gpu"]
    assert sum(lc["shared_hit_blocks"] for lc in res["stats"]["lc"]) > 0
    assert res["counters"]["reused_tokens"] > LOCAL_ONLY_REUSED


def outputs(res: dict) -> list:
    return [r["output"] for r in res["requests"]]


@pytest.fixture(params=["file", "mooncake"])
def store(request, tmp_path) -> str:
    if request.param == "file":
        return str(tmp_path / "store")
    return request.getfixturevalue("fresh_mooncake").url


def test_second_process_reuses_first(store, tmp_path, model, backend):
    a = run_child(store, tmp_path, "a", backend=backend)
    assert a["counters"]["reused_tokens"] == LOCAL_ONLY_REUSED  # alone: only its own reuse
    assert a["routes"].get("shared->gpu", 0) == 0 and a["shared"]["stores"] > 0
    assert_exact(model, a)
    b = run_child(store, tmp_path, "b", backend=backend)
    assert_reused_from_shared(b)
    assert_exact(model, b)
    assert outputs(b) == outputs(a)
    c = run_child(store, tmp_path, "c", backend=backend)  # a third one: at least as much reuse
    assert_reused_from_shared(c)
    assert c["counters"]["reused_tokens"] >= b["counters"]["reused_tokens"]
    assert_exact(model, c)


def test_two_processes_at_the_same_time(store, tmp_path, model, backend):
    """Two engine processes run AT THE SAME TIME on one store (released together from a
    barrier once both are imported), with crossed workloads: while one computes and writes
    a workload the other computes the other one, then each runs what the other wrote.  Both
    are exact against no cache, no load fails and nothing rolls back (a concurrent writer
    never shows a reader a partial object: temp + rename, Mooncake's put end), no write
    fails (two writers of one name both succeed), and at least one of them takes pages the
    other wrote from the store."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    order = {"a": f"{WORKLOAD},multi-turn", "b": f"multi-turn,{WORKLOAD}"}
    procs = {}
    for name, workloads in order.items():
        cmd, env = child_command(store, tmp_path, name, "--workload", workloads, "--barrier", str(barrier),
                                 backend=backend)
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(barrier) if f.startswith("ready-")]) < 2:
            assert all(p.poll() is None for p in procs.values()), "a child exited before the barrier"
            assert time.monotonic() < deadline, "the children did not get ready"
            time.sleep(0.01)
        (barrier / "go").touch()
        for name, p in procs.items():
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"{name} failed:\n{out}\n{err[-4000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    a, b = child_result(tmp_path, "a", backend), child_result(tmp_path, "b", backend)
    assert a["run_span"][0] < b["run_span"][1] and b["run_span"][0] < a["run_span"][1]  # they overlapped
    for res in (a, b):
        assert_exact(model, res)
        sh = res["shared"]
        assert sh["stores"] > 0 and sh["store_failures"] == 0 and sh["lookup_errors"] == 0
        assert sh["load_failures"] == 0 and res["counters"]["rollbacks"] == 0 and res["counters"]["copy_failures"] == 0
        assert sh["loads"] == res["routes"].get("shared->gpu", 0)
    # the same prompts gave the same tokens in both
    out_a = {tuple(r["prompt"]): r["output"] for r in a["requests"]}
    assert all(out_a[tuple(r["prompt"])] == r["output"] for r in b["requests"])
    assert a["routes"].get("shared->gpu", 0) + b["routes"].get("shared->gpu", 0) > 0
    assert max(a["counters"]["shared_hits"], b["counters"]["shared_hits"]) > 0


def test_write_back_policy(tmp_path, model, backend):
    """shared_write="evict": pages reach the store when dropped from the coldest local tier.
    The first process runs one workload, then another that pushes the first one's pages out
    of its tight gpu + host (into the store); a second process running the first workload
    reuses them, exactly."""
    store = str(tmp_path / "store")
    tight = ("--shared-write", "evict", "--gpu-slots", "14", "--host-slots", "6")
    a = run_child(store, tmp_path, "a", *tight, "--workload", f"{WORKLOAD},multi-turn", backend=backend)
    # written when dropped: mostly from the coldest local tier (host), plus the pages that
    # pruning frees with a victim, wherever they are
    assert a["shared"]["stores"] > 0 and a["copies"]["store"] == sum(
        n for route, n in a["routes"].items() if route.endswith("->shared"))
    assert a["routes"].get("host->shared", 0) > a["routes"].get("gpu->shared", 0)
    assert_exact(model, a)
    b = run_child(store, tmp_path, "b", *tight, backend=backend)
    assert_reused_from_shared(b)
    assert_exact(model, b)


@pytest.mark.parametrize("fault", ["delete-after-lookup", "truncate-after-lookup", "foreign", "fail-puts"])
def test_faults_file_store(fault, tmp_path, model, backend):
    store = str(tmp_path / "store")
    if fault == "fail-puts":  # the first process's writes half fail: never visible, nothing lost
        a = run_child(store, tmp_path, "a", "--fault", fault, backend=backend)
        assert a["fault_hits"] > 0 and a["counters"]["copy_failures"] > 0 and a["counters"]["rollbacks"] == 0
        assert a["shared"]["stores"] == len(os.listdir(store))  # every written object, no failed one
        assert_exact(model, a)
        b = run_child(store, tmp_path, "b", backend=backend)
        # the lookup finds only what was written (half of each block's pages: the hybrid
        # fixed point then needs pages that are missing, so nothing loads); never a failed one
        assert b["shared"]["lookup_hits"] > 0 and b["shared"]["load_failures"] == 0
        assert b["counters"]["rollbacks"] == 0
        assert_exact(model, b)
        return
    a = run_child(store, tmp_path, "a", backend=backend)
    if fault == "foreign":  # every object replaced by another one's bytes (other key)
        files = sorted(f for f in os.listdir(store) if f.endswith(OBJECT_SUFFIX))
        blobs = [(Path(store) / f).read_bytes() for f in files]
        for f, blob in zip(files, blobs[1:] + blobs[:1], strict=True):
            (Path(store) / f).write_bytes(blob)
        b = run_child(store, tmp_path, "b", backend=backend)
    else:
        b = run_child(store, tmp_path, "b", "--fault", fault, backend=backend)
        assert b["fault_hits"] > 0
    # every load from the store failed: rolled back, recomputed, exact
    assert b["counters"]["shared_hits"] > 0 and b["shared"]["load_failures"] > 0
    assert b["counters"]["copy_failures"] > 0 and b["counters"]["rollbacks"] > 0
    assert b["routes"].get("shared->gpu", 0) == 0
    assert_exact(model, b)
    assert outputs(b) == outputs(a)


@pytest.mark.parametrize("fault", ["delete-after-lookup", "truncate-after-lookup", "foreign-after-lookup"])
def test_faults_mooncake_object_after_lookup(fault, fresh_mooncake, tmp_path, model, backend):
    """An object deleted, truncated or replaced by a foreign one between lookup and load."""
    a = run_child(fresh_mooncake.url, tmp_path, "a", backend=backend)
    b = run_child(fresh_mooncake.url, tmp_path, "b", "--fault", fault, backend=backend)
    assert b["fault_hits"] > 0 and b["shared"]["load_failures"] > 0 and b["counters"]["rollbacks"] > 0
    assert_exact(model, b)
    assert outputs(b) == outputs(a)


def test_fault_mooncake_master_killed_mid_run(fresh_mooncake, tmp_path, model, backend):
    run_child(fresh_mooncake.url, tmp_path, "a", backend=backend)
    b = run_child(fresh_mooncake.url, tmp_path, "b", "--fault",
                  f"kill-master-after-lookup:{fresh_mooncake.master.pid}", backend=backend)
    assert b["fault_hits"] == 1
    assert b["shared"]["load_failures"] > 0 and b["counters"]["rollbacks"] > 0
    assert b["shared"]["lookup_errors"] > 0  # later lookups: the store holds nothing
    assert_exact(model, b)


def test_fault_mooncake_objects_gone_with_storage(fresh_mooncake, tmp_path, model, backend):
    """The storage client dies between the processes: its objects are gone.  Until the
    master notices (its client TTL, 10 s) it still lists them, so the next process may find
    them and then fail to load every one (Mooncake's TRANSFER_FAIL: a fault of the store,
    not of the object, so nothing is removed — a network blip must not wipe the fleet's
    objects); either way it computes, exactly.  Its writes of those names are no-ops while
    they are listed.  Once the master dropped them, a third process writes them again into
    the restarted storage client, where a fourth finds them."""
    run_child(fresh_mooncake.url, tmp_path, "a", backend=backend)
    prompt = child_result(tmp_path, "a", backend)["requests"][0]["prompt"][:-1]
    fresh_mooncake.kill_client()
    fresh_mooncake.start_client(str(tmp_path))
    b = run_child(fresh_mooncake.url, tmp_path, "b", backend=backend)
    assert b["routes"].get("shared->gpu", 0) == 0 and b["shared"]["removed_bad"] == 0
    taken = sum(lc["shared_hit_blocks"] for lc in b["stats"]["lc"])
    if taken:  # stale listings were taken: every load of them failed, each rolled back
        assert b["shared"]["load_failures"] > 0 and b["counters"]["rollbacks"] > 0
        assert b["counters"]["copy_failures"] > 0 and b["shared"]["loads"] == 0
    else:  # the master had noticed: nothing was taken, so nothing failed or rolled back
        assert b["shared"]["load_failures"] == 0 and b["counters"]["rollbacks"] == 0
    assert_exact(model, b)
    wait_unlisted(fresh_mooncake.url, model, prompt)
    c = run_child(fresh_mooncake.url, tmp_path, "c", backend=backend)
    assert c["shared"]["lookup_hits"] == 0 and c["shared"]["stores"] > 0
    assert_exact(model, c)
    d = run_child(fresh_mooncake.url, tmp_path, "d", backend=backend)
    assert_reused_from_shared(d)
    assert_exact(model, d)


def wait_unlisted(url: str, model: TinyHybridModel, prompt: list[int], timeout: float = 60.0) -> None:
    """Wait until the store lists none of the objects of ``prompt`` (as a child's engine
    names them: its default block size, gpu slots and namespace)."""
    from kvcm import KVCacheManager
    from kvcm.dataplane import DataPlane

    config = model.manager_config(16, 64, shared=url, shared_namespace="kvcm-tiny-hybrid")
    mgr = KVCacheManager(config, backend="python")
    deadline = time.monotonic() + timeout
    with DataPlane(config, dtype=torch.uint8) as plane:
        cands = mgr.shared_candidates(prompt)
        assert cands
        while plane.shared_lookup(cands):
            assert time.monotonic() < deadline, "the master still lists the lost objects"
            time.sleep(0.5)
    mgr.shutdown()


def test_copied_store_directory_is_reusable(tmp_path, model, backend):
    """A file store moved to another place (a shared filesystem mounted elsewhere) still
    serves: objects carry everything needed to verify them."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    run_child(str(a_dir), tmp_path, "a", backend=backend)
    shutil.copytree(a_dir, b_dir)
    b = run_child(f"file://{b_dir}", tmp_path, "b", backend=backend)
    assert_reused_from_shared(b)
    assert_exact(model, b)


def forge_all(url: str, model: TinyHybridModel, requests: list[dict]) -> int:
    """The forger, between two processes: every object the first one wrote for
    ``requests`` gets another object's payload of its life cycle (real K/V of another
    block), the CRC fixed and the header (its MAC) kept — intact objects that would load
    without authentication.  (It is given the names; it never uses the secret's MAC key.)
    Returns how many objects it replaced."""
    from kvcm import KVCacheManager
    from kvcm.dataplane import DataPlane
    from kvcm.dataplane.store import FIELDS, HEADER, Staging

    config = model.manager_config(16, 64, shared=url, shared_namespace="kvcm-tiny-hybrid")
    mgr = KVCacheManager(config, backend="python")
    with DataPlane(config, dtype=torch.uint8) as plane:
        assert plane.codec.authenticated  # names as the children's (the secret from the environment)
        cands = {}
        for r in requests:
            for k, lc in mgr.shared_candidates(r["prompt"] + r["output"]):
                cands[plane.codec.name(k, lc)] = lc
        present = plane.shared.exists(list(cands))
        by_lc: dict[int, list[str]] = {}
        for (name, lc), p in zip(cands.items(), present, strict=True):
            if p:
                by_lc.setdefault(lc, []).append(name)
        objects = []
        for lc, names in by_lc.items():
            size = HEADER.size + plane.life_cycles[lc].slot_bytes
            st = Staging(size * len(names))
            got = plane.shared.get([(n, i * size, size) for i, n in enumerate(names)], st)
            assert got == [size] * len(names)
            blobs = [bytes(st.view[i * size:(i + 1) * size]) for i in range(len(names))]
            st.close()
            for i, name in enumerate(names):
                payload = blobs[(i + 1) % len(blobs)][HEADER.size:]
                magic, fp, k, olc, n, _ = FIELDS.unpack_from(blobs[i])
                head = FIELDS.pack(magic, fp, k, olc, n, zlib.crc32(payload)) + blobs[i][FIELDS.size:HEADER.size]
                objects.append((name, head + payload))
        st = Staging(sum(len(b) for _, b in objects))
        plane.shared.register(st)
        try:
            off, items = 0, []
            for name, blob in objects:
                st.view[off:off + len(blob)] = blob
                items.append((name, off, len(blob)))
                off += len(blob)
            plane.shared.remove([n for n, _ in objects])  # (a Mooncake put does not replace an object)
            assert plane.shared.put(items, st) == [None] * len(items)
        finally:
            plane.shared.unregister(st)
            st.close()
    mgr.shutdown()
    return len(objects)


def test_forged_objects_never_reach_a_pool(store, tmp_path, model, backend, monkeypatch):
    """Engines with a store secret ($KVCM_STORE_SECRET, inherited by the children); a
    forger who can write the store but lacks the secret replaces every object with an
    intact one (valid CRC, another block's real K/V).  The next process finds them, every
    load fails on its MAC (counted, like a corrupted object: rolled back, recomputed), no
    page comes from the store, and its tokens and logits are exact."""
    monkeypatch.setenv("KVCM_STORE_SECRET", "the fleet's store secret, 32+ bytes")
    monkeypatch.delenv("KVCM_STORE_SECRET_FILE", raising=False)
    a = run_child(store, tmp_path, "a", backend=backend)
    assert a["shared"]["stores"] > 0 and a["shared"]["auth_failures"] == 0
    forged = forge_all(store, model, a["requests"])
    assert forged > 0
    if not store.startswith("mooncake://"):  # every object the store holds was forged
        assert forged == len([f for f in os.listdir(store) if f.endswith(OBJECT_SUFFIX)])
    b = run_child(store, tmp_path, "b", backend=backend)
    assert b["counters"]["shared_hits"] > 0 and b["shared"]["load_failures"] > 0
    assert b["shared"]["auth_failures"] == b["shared"]["load_failures"]
    assert b["counters"]["rollbacks"] > 0 and b["routes"].get("shared->gpu", 0) == 0
    assert b["shared"]["loads"] == 0
    assert_exact(model, b)
    assert outputs(b) == outputs(a)
