"""Data-plane faults (SPEC sec. 15, issue 8 items 1, 3, 17): a full filesystem, a truncated
or corrupted pool file and a failing copy are exceptions, never a signal or wrong bytes.

The filesystem tests use a real small tmpfs when this process may mount one (root), and
otherwise the same errors injected at the system call; every reproduction that could kill
the process with a signal runs in a subprocess, whose exit status proves it did not.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from kvcm import AttentionLayer, CopyError, CopyOp, KVCacheManagerConfig, SsmLayer, Tier
from kvcm.dataplane import DataPlane, remove_stale_pool_files
from kvcm.dataplane.disk_pool import POOL_PREFIX

B = 4
LAYERS = [AttentionLayer(0, 32), SsmLayer(1, 24)]  # slot bytes: 128 (attn), 24 (ssm)
PER = 152
GPU, HOST, DISK = 0, 1, 2


def config(path, gpu=4, host=2, disk=8) -> KVCacheManagerConfig:
    tiers = [Tier("gpu", gpu * PER)]
    if host:
        tiers.append(Tier("host", host * PER))
    tiers.append(Tier("disk", disk * PER, path=str(path)))
    return KVCacheManagerConfig(tokens_per_block=B, layers=LAYERS, tiers=tiers)


def _mount_tmpfs(path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       check=False)
    return r.returncode == 0


@pytest.fixture(params=["tmpfs", "injected"])
def small_fs(request, tmp_path, monkeypatch):
    """A directory on a 64 KiB filesystem: a real tmpfs, or ENOSPC injected past 64 KiB."""
    d = tmp_path / "small"
    d.mkdir()
    if request.param == "tmpfs":
        if not _mount_tmpfs(d, "64k"):
            pytest.skip("cannot mount a tmpfs here (needs root); the injected variant runs instead")
        yield d
        subprocess.run(["umount", "-l", str(d)], check=False)
        return
    real = os.posix_fallocate
    used = {"bytes": 0}

    def fallocate(fd, offset, length):
        if os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")).startswith(str(d)):
            if used["bytes"] + length > 64 * 1024:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            used["bytes"] += length
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    yield d


def test_full_filesystem_fails_at_construction_naming_tier_and_path(small_fs):
    """Was: the sparse file made DataPlane succeed and the first offload died of SIGBUS."""
    with pytest.raises(OSError, match=r"disk tier \(tier 2\).*cannot reserve") as info:
        DataPlane(config(small_fs, disk=4000))  # ~600 KB of disk pool on a 64 KiB filesystem
    assert info.value.errno == errno.ENOSPC
    assert str(small_fs) in str(info.value)
    assert os.listdir(small_fs) == []  # nothing left behind
    with DataPlane(config(small_fs, disk=8)) as p:  # one that fits is reserved whole
        files = os.listdir(small_fs)
        assert len(files) == 2
        assert sum(os.stat(small_fs / f).st_blocks for f in files) * 512 >= 8 * (PER + 2 * 8)
        p.apply([CopyOp(0, GPU, 0, DISK, 7, "offload")])
    assert os.listdir(small_fs) == []


_SIGBUS_REPRO = textwrap.dedent("""
    import os, sys
    import torch
    from kvcm import AttentionLayer, CopyError, CopyOp, KVCacheManagerConfig, SsmLayer, Tier
    from kvcm.dataplane import DataPlane
    path, mode = sys.argv[1], sys.argv[2]
    cfg = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 32), SsmLayer(1, 24)],
                               tiers=[Tier("gpu", 4 * 152), Tier("disk", 8 * 152, path=path)])
    p = DataPlane(cfg)
    p.pool("gpu", 0)[1] = 7
    p.apply([CopyOp(0, 0, 1, 2, 5, "offload")])
    f = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith("-lc0.bin"))
    if mode == "truncate":
        os.truncate(f, 0)  # another process truncates the pool file
    try:
        p.apply([CopyOp(0, 2, 5, 0, 2, "onboard")])
    except CopyError as e:
        assert e.ops == [CopyOp(0, 2, 5, 0, 2, "onboard")], e.ops
        assert isinstance(e.cause, OSError), e.cause
        print("COPYERROR", e.cause.errno)
    else:
        print("OK")
    p.close()
    print("FILES", len(os.listdir(path)))
""")


@pytest.mark.parametrize("mode", ["truncate", "intact"])
def test_truncated_pool_file_is_a_copy_error_not_sigbus(tmp_path, mode):
    """Was: an onboard from a truncated pool file killed the process with SIGBUS."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _SIGBUS_REPRO, str(tmp_path), mode], capture_output=True, text=True,
                       env=env, check=False, timeout=120)
    assert r.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert r.returncode == 0, r.stderr
    if mode == "truncate":
        assert f"COPYERROR {errno.EIO}" in r.stdout
    else:
        assert "OK" in r.stdout
    assert "FILES 0" in r.stdout


def test_write_to_a_truncated_file_on_a_full_filesystem_is_a_copy_error(tmp_path):
    """The reservation is gone (truncated) and the filesystem full: an offload fails with
    ENOSPC as a CopyError, and the ops after its run are reported with it."""
    d = tmp_path / "small"
    d.mkdir()
    if not _mount_tmpfs(d, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    p = DataPlane(config(d, disk=8))
    try:
        f = next(d / n for n in os.listdir(d) if n.endswith("-lc0.bin"))
        os.truncate(f, 0)
        with open(d / "filler", "wb", buffering=0) as fill, pytest.raises(OSError):  # fill the filesystem
            while True:
                fill.write(b"\0" * 4096)
        ops = [CopyOp(0, GPU, 0, DISK, 7, "offload"), CopyOp(0, GPU, 2, DISK, 6, "offload"),
               CopyOp(0, GPU, 0, GPU, 1, "cow"), CopyOp(0, GPU, 1, HOST, 0, "offload")]
        p.pool("gpu", 0)[0] = 5
        with pytest.raises(CopyError) as info:
            p.apply(ops)
        assert info.value.cause.errno == errno.ENOSPC
        # ops 0 and 1 are one run (both tried, both fail); ops 2 and 3 (later runs) never ran
        assert info.value.ops == ops
        assert sum(p.copies.values()) == 0 and int(p.pool("gpu", 0)[1].count_nonzero()) == 0
    finally:
        p.close()
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_corrupted_disk_page_fails_its_checksum(tmp_path):
    """Was: bytes changed in the pool file by another process were served silently."""
    with DataPlane(config(tmp_path)) as p:
        p.pool("gpu", 0)[2] = 9
        p.apply([CopyOp(0, GPU, 2, DISK, 3, "offload")])
        f = next(tmp_path / n for n in os.listdir(tmp_path) if n.endswith("-lc0.bin"))
        rec = 128 + 8
        with open(f, "r+b") as fh:  # flip one byte of slot 3's data
            fh.seek(3 * rec + 17)
            b = fh.read(1)
            fh.seek(3 * rec + 17)
            fh.write(bytes([b[0] ^ 0xFF]))
        p.pool("gpu", 0)[1] = 0
        bad = CopyOp(0, DISK, 3, GPU, 1, "onboard")
        with pytest.raises(CopyError) as info:
            p.apply([bad])
        assert info.value.ops == [bad] and info.value.cause.errno == errno.EIO
        assert "checksum" in str(info.value.cause)
        assert int(p.pool("gpu", 0)[1].count_nonzero()) == 0  # nothing served
        # a never-written slot is no page either
        with pytest.raises(CopyError):
            p.apply([CopyOp(0, DISK, 5, GPU, 1, "onboard")])


def test_failed_op_stops_the_list_after_its_run(tmp_path):
    """The injected failure of one op: its run finishes, nothing after it runs, and
    CopyError.ops lists exactly the ops not completed, in order."""
    with DataPlane(config(tmp_path)) as p:
        for s in range(4):
            p.pool("gpu", 0)[s] = s + 1
        ops = [CopyOp(0, GPU, 0, HOST, 0, "offload"), CopyOp(0, GPU, 1, HOST, 1, "offload"),
               CopyOp(0, HOST, 1, GPU, 0, "onboard"), CopyOp(0, GPU, 3, GPU, 2, "cow")]
        p.fault = lambda op: (_ for _ in ()).throw(OSError(errno.EIO, "injected")) if op == ops[1] else None
        with pytest.raises(CopyError) as info:
            p.apply(ops)
        assert info.value.ops == ops[1:]
        assert torch.equal(p.pool("host", 0)[0], torch.full((128,), 1, dtype=torch.uint8))  # op 0 done
        assert int(p.pool("gpu", 0)[2][0]) == 3  # op 3 never ran
        assert p.copies == {"offload": 1, "onboard": 0, "cow": 0, "snapshot": 0, "store": 0, "relocate": 0}


def test_stale_pool_files_of_a_crashed_run_are_removed(tmp_path):
    """Was: every crashed run left its pool files behind."""
    code = textwrap.dedent("""
        import os, sys
        from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer, Tier
        from kvcm.dataplane import DataPlane
        cfg = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 32), SsmLayer(1, 24)],
                                   tiers=[Tier("gpu", 4 * 152), Tier("disk", 8 * 152, path=sys.argv[1])])
        p = DataPlane(cfg)
        os._exit(3)  # a crash: no close, no finalizer
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False,
                       timeout=120)
    assert r.returncode == 3, r.stderr
    stale = sorted(os.listdir(tmp_path))
    assert len(stale) == 2 and all(n.startswith(POOL_PREFIX) for n in stale)
    (tmp_path / "unrelated.bin").write_bytes(b"x")
    with DataPlane(config(tmp_path, host=0)) as live:
        mine = sorted(set(os.listdir(tmp_path)) - {"unrelated.bin"})
        assert len(mine) == 2 and not set(mine) & set(stale)  # the crashed run's files are gone
        # a live plane's files are locked: another plane (here, in the same process) keeps them
        with DataPlane(config(tmp_path, host=0)):
            assert set(mine) <= set(os.listdir(tmp_path))
        assert remove_stale_pool_files(str(tmp_path)) == []
        assert live.pool("disk", 0).num_slots == 8
    assert os.listdir(tmp_path) == ["unrelated.bin"]


@pytest.mark.parametrize("shape", [(-2, -4), (2, -4, -1), (0, 8), (2.0, 4)])
def test_negative_or_zero_shape_dims_are_rejected_at_construction(tmp_path, shape):
    """Was: (-2, -4) of float32 passed the byte check (8 elements * 4 bytes = 32) and failed
    later inside torch."""
    with pytest.raises(ValueError, match="positive int"):
        DataPlane(config(tmp_path), shapes={0: shape})
    assert os.listdir(tmp_path) == []
