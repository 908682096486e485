"""The data plane follows set_quota (issue 22; DECISIONS.md "Quotas at run time"): pools grown
or shrunk without losing a live page's bytes, a disk pool's space reserved and its checksums
kept, refusals leave the pools as they were."""

from __future__ import annotations

import os

import pytest
import torch
from kvcm import AttentionLayer, KVCacheManagerConfig, OutOfPagesError, Tier
from kvcm.dataplane import DataPlane, DiskPool
from kvcm.dataplane.disk_pool import TRAILER

B = 4
SLOT = B * 8  # one attention layer of 8 bytes per token


def _cfg(tmp_path, gpu: int, host: int = 0, disk: int = 0) -> KVCacheManagerConfig:
    tiers = [Tier("gpu", gpu * SLOT)]
    if host:
        tiers.append(Tier("host", host * SLOT))
    if disk:
        tiers.append(Tier("disk", disk * SLOT, path=str(tmp_path / "disk")))
    return KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 8)], tiers=tiers)


def _page(tag: int) -> torch.Tensor:
    return torch.full((SLOT,), tag, dtype=torch.uint8)


def _block(mgr, plane, tag: int, close: bool = True):
    """A request that writes one block whose bytes are all ``tag`` and commits it."""
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(B)
    plane.apply(mgr.drain_copy_ops())
    plane.pool("gpu", 0)[kv.page_indices(0)[0]] = _page(tag)
    kv.commit([tag, tag + 1, tag + 2, tag + 3])
    if close:
        kv.close()
    return kv


def _read(plane, tier: str, slot: int) -> torch.Tensor:
    pool = plane.pool(tier, 0)
    return pool.read_rows([slot])[0] if isinstance(pool, DiskPool) else pool[slot]


def test_shrink_keeps_every_live_page_bytes(tmp_path, make_manager):
    mgr = make_manager(_cfg(tmp_path, gpu=4, host=4))
    with DataPlane(mgr.config) as plane:
        _block(mgr, plane, 10)
        _block(mgr, plane, 20)
        _block(mgr, plane, 30)
        live = _block(mgr, plane, 40, close=False)  # LOCKED in gpu slot 3
        assert live.page_indices(0) == [3]
        n = plane.set_quota(mgr, "gpu", 2 * SLOT)
        assert n == 4  # blocks 10 and 20 offloaded; 30 (slot 2) and 40 (slot 3) relocated
        assert plane.pool("gpu", 0).shape == (2, SLOT)
        assert plane.copies["relocate"] == 2 and plane.copies["offload"] == 2
        assert torch.equal(_read(plane, "gpu", live.page_indices(0)[0]), _page(40))
        # every block still reusable has its bytes where the manager says it is
        for tag in (10, 20, 30):
            kv = mgr.create_kv_cache([tag, tag + 1, tag + 2, tag + 3, 0])
            assert kv.num_committed_tokens == 4
            assert kv.resume()
            plane.apply(mgr.drain_copy_ops())
            assert torch.equal(_read(plane, "gpu", kv.page_indices(0)[0]), _page(tag)), tag
            kv.close()
        mgr.check_invariants()


def test_grow_keeps_bytes_and_adds_usable_slots(tmp_path, make_manager):
    mgr = make_manager(_cfg(tmp_path, gpu=2))
    with DataPlane(mgr.config) as plane:
        a = _block(mgr, plane, 7, close=False)
        assert plane.set_quota(mgr, 0, 6 * SLOT) == 0
        assert plane.pool("gpu", 0).shape == (6, SLOT)
        assert torch.equal(_read(plane, "gpu", a.page_indices(0)[0]), _page(7))
        kvs = [_block(mgr, plane, 50 + i, close=False) for i in range(5)]
        assert sorted(kv.page_indices(0)[0] for kv in kvs) == [1, 2, 3, 4, 5]
        for i, kv in enumerate(kvs):
            assert torch.equal(_read(plane, "gpu", kv.page_indices(0)[0]), _page(50 + i))


def test_disk_pool_grows_reserved_and_shrinks_with_checksums(tmp_path, make_manager):
    mgr = make_manager(_cfg(tmp_path, gpu=1, disk=2))
    with DataPlane(mgr.config) as plane:
        _block(mgr, plane, 1)
        _block(mgr, plane, 2)  # block 1 -> disk 0
        _block(mgr, plane, 3)  # block 2 -> disk 1
        plane.apply(mgr.drain_copy_ops())
        disk = plane.pool("disk", 0)
        record = SLOT + TRAILER.size
        plane.set_quota(mgr, "disk", 5 * SLOT)
        st = os.fstat(disk.fd)
        assert st.st_size == 5 * record and st.st_blocks * 512 >= 5 * record  # reserved, not sparse
        with pytest.raises(OSError, match="never written"):
            disk.read(4)  # a new record has no valid trailer until a page is written there
        assert torch.equal(disk.read_rows([0])[0], _page(1))
        # shrink to one slot: the oldest block (1, disk 0) is dropped, block 2 relocates 1 -> 0
        plane.set_quota(mgr, "disk", 1 * SLOT)
        assert os.fstat(disk.fd).st_size == record
        assert torch.equal(disk.read_rows([0])[0], _page(2))  # its checksum verified on read
        kv = mgr.create_kv_cache([2, 3, 4, 5])
        assert kv.num_committed_tokens == 4 and kv.resume()
        plane.apply(mgr.drain_copy_ops())
        assert torch.equal(_read(plane, "gpu", kv.page_indices(0)[0]), _page(2))


def test_refused_quota_leaves_the_pools_as_they_were(tmp_path, make_manager):
    mgr = make_manager(_cfg(tmp_path, gpu=2, disk=2))
    with DataPlane(mgr.config) as plane:
        _block(mgr, plane, 5, close=False)
        _block(mgr, plane, 6, close=False)
        before = mgr.snapshot()
        with pytest.raises(OutOfPagesError, match="2 LOCKED"):
            plane.set_quota(mgr, "gpu", 1 * SLOT)
        with pytest.raises(ValueError, match="no 'host' tier"):
            plane.set_quota(mgr, "host", 4 * SLOT)
        with pytest.raises(TypeError):
            plane.set_quota(mgr, "disk", 4.0 * SLOT)
        assert mgr.snapshot() == before
        assert plane.pool("gpu", 0).shape == (2, SLOT)
        assert plane.pool("disk", 0).shape == (2, SLOT)
        assert os.fstat(plane.pool("disk", 0).fd).st_size == 2 * (SLOT + TRAILER.size)


def test_a_disk_that_cannot_reserve_the_space_changes_nothing(tmp_path, make_manager, monkeypatch):
    mgr = make_manager(_cfg(tmp_path, gpu=2, disk=2))
    with DataPlane(mgr.config) as plane:
        before = mgr.snapshot()

        def full(fd: int, off: int, n: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(OSError, match="cannot reserve"):
            plane.set_quota(mgr, "disk", 100 * SLOT)
        assert mgr.snapshot() == before
        assert plane.pool("disk", 0).shape == (2, SLOT)
