"""KVCM_OPLOG recording (kvcm.oplog): the recording proxy logs every public call and forwards
results, several managers and processes in one log, and the op log never changes a call
(issue 8 item 5, SPEC sec. 15): a failing write (ENOSPC, EFBIG, a full filesystem), an
unusable or hostile path, a threaded run.  Builders: tests/tools/oplog_helpers.py."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import kvcm
import pytest
from kvcm import Status, Tier
from kvcm import oplog as L
from kvcm.oplog import ops as O
from oplog_helpers import D, config, py_manager, read_lines, record

# ---------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------


def test_maybe_wrap_is_a_no_op_without_the_env_var(monkeypatch):
    monkeypatch.delenv(L.ENV_VAR, raising=False)
    m = py_manager()
    assert L.maybe_wrap(m) is m
    assert L.maybe_wrap_class(type(m)) is type(m)


def test_recording_proxy_logs_every_public_call(tmp_path, monkeypatch):
    path = record(tmp_path, monkeypatch)
    lines = [json.loads(x) for x in read_lines(path)]
    head, ops = lines[0], lines[1:]
    assert head["kvcm_oplog"] == L.FORMAT_VERSION and head["backend"] == "python"
    assert L.config_from_json(head["config"]) == config()
    names = [r["op"] for r in ops]
    assert set(names) == set(O.OPS)
    assert [r["step"] for r in ops] == list(range(len(ops)))
    create = ops[0]
    assert create["args"]["input_tokens"][3] == {"digest": D.hex()}
    assert create["args"]["scope"] == {"lora_id": 0, "salt": None}
    assert create["outcome"] == {"result": 0}
    commit = next(r for r in ops if r["op"] == "commit")
    assert commit["args"]["tokens"][3] == {"digest": D.hex()}  # the tuple was recorded
    failed = [r for r in ops if "error" in r["outcome"]]
    assert [(r["op"], r["outcome"]["error"]) for r in failed] == [("commit", "ValueError"), ("resize_batch", "ValueError"),
                                                                  ("settle_copies", "ValueError")]
    assert "out of range" in failed[0]["message"]
    assert "appears twice" in failed[1]["message"] and failed[1]["args"]["caches"] == [0, 0]
    assert "copy_settlement='explicit'" in failed[2]["message"] and failed[2]["args"] == {"failed": []}
    rb = next(r for r in ops if r["op"] == "resize_batch")
    assert rb["args"] == {"caches": [0], "capacities": {"array": "q", "values": [9]}, "history_lengths": None}
    assert rb["outcome"] == {"result": [True]}
    cb = next(r for r in ops if r["op"] == "commit_batch")
    assert cb["args"] == {"caches": [0], "tokens": {"array": "i", "values": [6]}}
    ci = next(r for r in ops if r["op"] == "commit_input")
    assert ci["args"] == {"n": 0} and ci["outcome"] == {"result": None}
    pii = next(r for r in ops if r["op"] == "page_indices_into")
    assert pii["args"] == {"lc": 0, "size": 8, "dtype": "int32"}
    assert pii["outcome"]["result"] == {"count": 4, "out": [0, 1, 2, 3]}


def test_proxy_forwards_results_and_properties(tmp_path, monkeypatch):
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "log.jsonl"))
    m = L.maybe_wrap(py_manager())
    kv = m.create_kv_cache([1, 2, 3], id=9)
    assert isinstance(kv, kvcm.KVCache) and kv.id == 9 and kv.status is Status.SUSPENDED
    assert kv.resume() is True and kv.status is Status.ACTIVE
    assert kv.resize(4) and kv.capacity == 4
    kv.commit([1, 2, 3])
    assert kv.num_committed_tokens == 3 and kv.committed_tokens == [1, 2, 3]
    assert kv.page_indices(0) == py_manager_ref_indices()
    assert m.config == config() and m.life_cycles == m.inner.life_cycles
    assert m.snapshot() == m.inner.snapshot()
    m.check_invariants()
    assert all(isinstance(e, kvcm.Event) for e in m.take_events())


def py_manager_ref_indices() -> list[int]:
    ref = py_manager()
    kv = ref.create_kv_cache([1, 2, 3], id=9)
    kv.resume()
    kv.resize(4)
    kv.commit([1, 2, 3])
    return kv.page_indices(0)


def test_pid_in_path_and_several_managers_in_one_log(tmp_path, monkeypatch):
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "log-{pid}.jsonl"))
    m1 = L.maybe_wrap(py_manager())
    m2 = L.maybe_wrap(py_manager(config(enable_partial_reuse=False)))
    a = m1.create_kv_cache([1, 2, 3])
    b = m2.create_kv_cache([1, 2, 3])
    a.resume(), b.resume(), a.resize(4), b.resize(4), a.commit([1, 2, 3]), b.commit([1, 2, 3])
    a.close(), b.close()
    path = tmp_path / f"log-{os.getpid()}.jsonl"
    streams = L.read_log(str(path))
    assert len(streams) == 2 and streams[0].m != streams[1].m
    assert [len(s.ops) for s in streams] == [5, 5]
    assert L.config_from_json(streams[1].config).enable_partial_reuse is False
    report = L.replay(str(path), ["python"])
    assert report.ok and report.managers == 2 and report.steps == 10, str(report)


def test_kvcm_manager_entry_point_records_when_env_is_set(tmp_path, monkeypatch):
    """KVCM_OPLOG at construction → kvcm.KVCacheManager returns the recording proxy
    (the hook in kvcm.construct: ``maybe_wrap_class``)."""
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    m = kvcm.KVCacheManager(config(), backend="python")
    assert isinstance(m, L.RecordingManager), "KVCacheManager.__new__ does not call kvcm.oplog.maybe_wrap_class"
    m.create_kv_cache([1])
    assert len(path.read_text().splitlines()) == 2
    monkeypatch.delenv(L.ENV_VAR)
    assert not isinstance(kvcm.KVCacheManager(config(), backend="python"), L.RecordingManager)


# ---------------------------------------------------------------------------------------
# the op log never changes a call (issue #8 item 5, SPEC sec. 15)
# ---------------------------------------------------------------------------------------


def _enospc_after(monkeypatch, n_ok: int) -> list[int]:
    """Make the op-log writer's ``os.write`` fail with ENOSPC after ``n_ok`` writes (the
    errors a full filesystem gives); returns the attempt counter."""
    import errno

    real = os.write
    attempts = [0]

    def write(fd, data):
        attempts[0] += 1
        if attempts[0] > n_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return attempts


def _recorded(backend, tmp_path, monkeypatch, cfg=None):
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    return kvcm.KVCacheManager(cfg or config(), backend=backend), path


_FSIZE_SCRIPT = """
import json, os, resource, signal, sys
import kvcm
from kvcm import AttentionLayer, KVCacheManagerConfig, Tier

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
cfg = KVCacheManagerConfig(tokens_per_block=2, layers=[AttentionLayer(0, 4)], tiers=[Tier("gpu", 80)])
m = kvcm.KVCacheManager(cfg, backend=sys.argv[1])
kv = m.create_kv_cache()
assert kv.resume() and kv.resize(6)
size = os.path.getsize(os.environ["KVCM_OPLOG"])
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
out = {}

def attempt(name, call):
    try:
        out[name] = ["ok", call()]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]

attempt("commit", lambda: kv.commit([1, 2, 3]))
out["committed"] = kv.committed_tokens
created = []
attempt("create", lambda: created.append(m.create_kv_cache([1, 2])) or created[0].id)
out["open"] = [r["id"] for r in m.snapshot()["requests"]]
for c in [kv, *created]:
    c.close()
attempt("shutdown", lambda: m.shutdown())
out["oplog_error"] = getattr(m, "oplog_error", "no such attribute")
print(json.dumps(out))
"""


def test_oplog_write_failure_does_not_fail_commit_or_lose_a_cache(backend, tmp_path):
    """A failed log write used to raise OSError after the call took effect: commit with
    the tokens committed (a retry committed them twice), create_kv_cache with the cache
    created and unreachable (shutdown() then failed).  A real write failure: the file-size
    limit (RLIMIT_FSIZE, any user) makes the kernel refuse the log's writes."""
    import subprocess
    import sys

    env = dict(os.environ, KVCM_OPLOG=str(tmp_path / "log.jsonl"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(kvcm.__file__).parents[1]), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-W", "always", "-c", _FSIZE_SCRIPT, backend], capture_output=True, text=True,
                       env=env, timeout=120, check=False)  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["commit"] == ["ok", None], out  # no exception from the log ...
    assert out["committed"] == [1, 2, 3]  # ... and the tokens committed once
    assert out["create"] == ["ok", 1], out  # the cache is returned, not lost
    assert out["open"] == [0, 1]
    assert out["shutdown"] == ["ok", None], out  # nothing left held
    assert "File too large" in out["oplog_error"]
    assert p.stderr.count("OpLogWarning") == 1 and "KVCM_OPLOG" in p.stderr  # said once
    assert L.replay(str(tmp_path / "log.jsonl"), [backend]).ok  # what was written is a clean prefix


def test_oplog_write_failure_warns_once_and_stops_writing(backend, tmp_path, monkeypatch):
    """An injected ENOSPC: one warning, the flag set, no further write attempted, the
    calls unaffected."""
    m, path = _recorded(backend, tmp_path, monkeypatch)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(6)
    attempts = _enospc_after(monkeypatch, 0)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        kv.commit([1, 2, 3])  # no exception: the call took effect exactly once
        assert kv.committed_tokens == [1, 2, 3] and kv.num_committed_tokens == 3
        kv.commit([4])  # logging stopped: no more writes, no second warning
        m.stats()
    assert kv.committed_tokens == [1, 2, 3, 4]
    assert attempts[0] == 1
    assert [w.category for w in warned] == [L.OpLogWarning]
    assert "No space left on device" in str(warned[0].message) and L.ENV_VAR in str(warned[0].message)
    assert "No space left" in m.oplog_error
    kv.close()
    m.shutdown()
    monkeypatch.undo()
    # the log is the complete prefix before the failure, and replays
    assert [json.loads(x).get("op") for x in read_lines(str(path))] == [None, "create_kv_cache", "resume", "resize"]
    assert L.replay(str(path), [backend]).ok


def test_oplog_write_failure_in_create_kv_cache_returns_the_cache(backend, tmp_path, monkeypatch):
    """An injected ENOSPC on create_kv_cache's record: the cache is returned and usable,
    and shutdown() works once it is closed."""
    m, _ = _recorded(backend, tmp_path, monkeypatch)
    _enospc_after(monkeypatch, 0)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        kv = m.create_kv_cache([1, 2, 3])
    assert isinstance(kv, kvcm.KVCache) and kv.status is Status.SUSPENDED
    assert [w.category for w in warned] == [L.OpLogWarning]
    assert kv.resume() and kv.resize(4)
    kv.commit([1, 2, 3])
    kv.close()
    m.shutdown()  # every cache closed: nothing held
    assert m.oplog_error is not None
    m.check_invariants()


def test_oplog_partial_line_on_a_full_disk_is_cut_off(tmp_path, monkeypatch):
    """A short write (the filesystem filled mid-line) leaves no half record behind."""
    import errno

    m, path = _recorded("python", tmp_path, monkeypatch)
    m.create_kv_cache([1])
    real = os.write

    def short_then_full(fd, data):
        if len(data) > 8:
            return real(fd, bytes(data[:8]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.warns(L.OpLogWarning):
        m.create_kv_cache([1, 2, 3, 4, 5, 6])
    monkeypatch.undo()
    lines = read_lines(str(path))
    assert len(lines) == 2 and all(json.loads(x) for x in lines)
    assert L.replay(str(path), ["python"]).ok


def _mount_tmpfs(where: Path, size: str) -> bool:
    import subprocess

    where.mkdir()
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       check=False)  # fmt: skip
    return r.returncode == 0


def test_oplog_on_a_really_full_filesystem(backend, tmp_path, monkeypatch):
    """The same on a real 64 KiB tmpfs (needs root to mount; skipped elsewhere, where the
    injected-ENOSPC tests above stand in)."""
    import subprocess

    fs = tmp_path / "small"
    if not _mount_tmpfs(fs, "64k"):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        m, path = _recorded(backend, fs, monkeypatch)
        big = list(range(2000))  # ~10 KB per record: the filesystem fills after a few
        results = []
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            for i in range(12):
                kv = m.create_kv_cache(big, id=f"r{i}")
                results.append((kv.resume(), kv.num_reused_tokens))
                kv.close()
        assert [w.category for w in warned] == [L.OpLogWarning]
        assert "No space left on device" in str(warned[0].message)
        assert "No space left on device" in m.oplog_error
        ref = L.build_manager(config(), backend)  # the same calls, unrecorded
        want = []
        for _ in range(12):
            kv = ref.create_kv_cache(big)
            want.append((kv.resume(), kv.num_reused_tokens))
            kv.close()
        assert results == want
        m.shutdown()
        lines = read_lines(str(path))
        assert 1 < len(lines) and all(json.loads(x) for x in lines)  # a clean prefix
        assert L.replay(str(path), [backend]).ok
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)  # lazy: the log's descriptor may be open


def test_oplog_unusable_path_names_the_variable(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (blocker / "log.jsonl", tmp_path):  # under a regular file; a directory
        monkeypatch.setenv(L.ENV_VAR, str(bad))
        with pytest.raises(OSError, match=rf"^\[Errno \d+\] {L.ENV_VAR}='{bad}': cannot open"):
            kvcm.KVCacheManager(config(), backend="python")
    assert blocker.read_text() == "x"


def test_oplog_refuses_a_symlink_path(tmp_path, monkeypatch):
    """The log holds prompts: it is never written through a symlink (someone else's
    target, or a link planted where the log will be)."""
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    link = tmp_path / "log.jsonl"
    link.symlink_to(target)
    monkeypatch.setenv(L.ENV_VAR, str(link))
    with pytest.raises(OSError, match=f"{L.ENV_VAR}=.*symbolic link"):
        kvcm.KVCacheManager(config(), backend="python")
    assert target.read_text() == "precious\n"
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "not-yet")
    monkeypatch.setenv(L.ENV_VAR, str(dangling))
    with pytest.raises(OSError, match="symbolic link"):
        kvcm.KVCacheManager(config(), backend="python")
    assert not (tmp_path / "not-yet").exists()


def test_oplog_refuses_a_hard_link_and_a_fifo(tmp_path, monkeypatch):
    other = tmp_path / "other.txt"
    other.write_text("mine\n")
    os.link(other, tmp_path / "log.jsonl")
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "log.jsonl"))
    with pytest.raises(OSError, match="hard links"):
        kvcm.KVCacheManager(config(), backend="python")
    assert other.read_text() == "mine\n"
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "fifo"))
    with pytest.raises(OSError, match="not a regular file"):  # and no hang waiting for a reader
        kvcm.KVCacheManager(config(), backend="python")


def test_oplog_file_is_created_0600(tmp_path, monkeypatch):
    import stat

    old = os.umask(0)  # even with a permissive umask
    try:
        # the directory must exist: the op log creates none (issue 20 item 9,
        # tests/tools/test_cli.py::test_kvcm_oplog_in_a_missing_directory_is_refused_not_created)
        (tmp_path / "new-dir").mkdir()
        m, path = _recorded("python", tmp_path / "new-dir", monkeypatch)
        m.create_kv_cache([1])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        loose = tmp_path / "loose.jsonl"
        loose.write_text("")
        loose.chmod(0o644)
        monkeypatch.setenv(L.ENV_VAR, str(loose))
        kvcm.KVCacheManager(config(), backend="python").create_kv_cache([1])
        assert stat.S_IMODE(loose.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_oplog_threaded_run_replays_without_divergence(backend, tmp_path, monkeypatch):
    """Records of calls from several threads used to be written after the manager lock
    was released, so the file's order could differ from the order the calls took effect
    and oplog-replay reported a false divergence.  A slow log write (sleep before it)
    widens that window."""
    import sys
    import threading
    import time

    real_write = L._LogWriter.write

    def slow_write(self, record):
        time.sleep(0.0002)
        real_write(self, record)

    monkeypatch.setattr(L._LogWriter, "write", slow_write)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    # tight gpu, shared prefixes: what each call returns depends on the calls before it
    cfg = config(tiers=[Tier("gpu", 40 * 3)])
    m, path = _recorded(backend, tmp_path, monkeypatch, cfg)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for k in range(25):
                prompt = [1, 2, 3, 4, 5, 6][: 2 + (i + k) % 5] + [100 + i, k]
                kv = m.create_kv_cache(prompt)
                if kv.resume() and kv.resize(len(prompt) + 1):
                    kv.commit(prompt[kv.num_committed_tokens :])
                m.probe_reuse(prompt)
                kv.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    monkeypatch.undo()
    report = L.replay(str(path), [backend] + (["python"] if backend != "python" else []))
    assert report.steps == len(read_lines(str(path))) - 1 > 400
    assert report.ok, str(report)
    assert m.oplog_error is None


def test_recording_does_not_change_what_tokens_are_accepted(tmp_path, monkeypatch):
    """Issue 8 (items 6/13, SPEC sec. 15 "observability never changes outcomes"): an
    iterator is refused with the op log on exactly as with it off (it used to be turned
    into a list first, so the recorded call succeeded where the plain one fails)."""
    errors = {}

    def run(m):
        a = m.create_kv_cache()
        assert a.resume() and a.resize(8)
        for name, bad in (("iter", iter([1, 2])), ("gen", (t for t in [1, 2])), ("set", {1, 2})):
            with pytest.raises(TypeError) as ei:
                a.commit(bad)
            errors.setdefault(name, []).append(str(ei.value))
        assert a.num_committed_tokens == 0

    run(py_manager())
    path = record(tmp_path, monkeypatch, run=run)
    assert all(len(set(v)) == 1 and len(v) == 2 for v in errors.values()), errors
    ops = [json.loads(x) for x in read_lines(path)][1:]
    assert [r["outcome"] for r in ops if r["op"] == "commit"] == [{"error": "TypeError"}] * 3
