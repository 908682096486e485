"""The connector's CUDA transfer path (``kvcm.integrations.vllm.transfer.CudaCopier``) on a
real GPU: pinned host staging, a side stream ordered after the compute stream by events,
synchronous loads made visible to the compute stream by an event wait (no host sync).
Run by ci/gpu-check.sh when a CUDA device is there; skipped otherwise (the CPU copier runs
every protocol test in tests/engines/test_vllm_async.py)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (ci/gpu-check.sh runs this where there is one)", allow_module_level=True)

from kvcm.integrations.vllm.metadata import LoadPlan, SavePlan
from kvcm.integrations.vllm.transfer import CpuCopier, CudaCopier, page_parts
from vllm_sim import SIM_PAGE, Chats, close, rig


@pytest.mark.parametrize("kv_first", [False, True], ids=["blocks-first", "kv-first"])
def test_cuda_copier_round_trips_pages_like_the_cpu_one(kv_first: bool) -> None:
    """Both layouts (block dim first; K/V first, e.g. FlashAttention): a save after a kernel
    still writing the blocks on the compute stream reads what it wrote (the side stream waits
    on the marker event), and the page bytes equal the CPU copier's."""
    n, B, H, D = 12, 16, 2, 8
    shape = (2, n, B, H, D) if kv_first else (n, B, 2, H, D)
    gpu = [torch.zeros(shape, device="cuda") for _ in range(2)]
    names = ("l0", "l1")
    nbytes = (B * 2 * H * D * 4,) * 2
    parts = page_parts(gpu, nbytes, n, names)
    cp = CudaCopier(parts, torch.device("cuda"))
    pool = torch.zeros((8, sum(nbytes)), dtype=torch.uint8)
    big = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # keep the compute stream busy, then write the blocks on it
        big = big @ big / 2048
    for i, t in enumerate(gpu):
        t.copy_(torch.arange(t.numel(), device="cuda", dtype=torch.float32).view(shape) + i)
    cp.save([3, 5, 7], [0, 1, 2], pool, cp.forward_marker())
    cpu = [t.cpu() for t in gpu]
    want = torch.zeros_like(pool)
    CpuCopier(page_parts(cpu, nbytes, n, names)).save([3, 5, 7], [0, 1, 2], want, None)
    assert torch.equal(pool, want)
    for t in gpu:
        t.zero_()
    cp.load([0, 1, 2], [9, 10, 11], pool, sync=True)  # the compute stream waits on its event
    got = [t.clone() for t in gpu]  # queued on the compute stream, after the wait
    torch.cuda.synchronize()
    for g, c in zip(got, cpu, strict=True):
        if kv_first:
            assert torch.equal(g[:, 9:12].cpu(), c[:, [3, 5, 7]])
        else:
            assert torch.equal(g[9:12].cpu(), c[[3, 5, 7]])
    cp.load([2], [1], pool, sync=False)  # asynchronous: done on return
    assert torch.equal((gpu[0][:, 1] if kv_first else gpu[0][1]).cpu(),
                       cpu[0][:, 7] if kv_first else cpu[0][7])
    cp.close()


def test_async_load_waits_for_what_the_compute_stream_queued_before_it() -> None:
    """An asynchronous load runs on the transfer thread, whose current stream is not vLLM's:
    it starts after the marker recorded on vLLM's (non-default) compute stream when it was
    queued, so a write vLLM queued to the block before (a slow one here) never lands on top
    of the loaded bytes."""
    import threading

    n, B, H, D = 12, 16, 2, 8
    gpu = [torch.zeros((n, B, 2, H, D), device="cuda")]
    nbytes = (B * 2 * H * D * 4,)
    cp = CudaCopier(page_parts(gpu, nbytes, n, ("l0",)), torch.device("cuda"))
    pool = torch.arange(4 * nbytes[0], dtype=torch.int64).remainder(251).to(torch.uint8).view(4, -1)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        big = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):
            big = big @ big / 2048
        gpu[0][9].fill_(-1.0)  # queued behind the busy work
        marker = cp.forward_marker()
    t = threading.Thread(target=cp.load, args=([2], [9], pool, False, marker))
    t.start()
    t.join(60)
    torch.cuda.synchronize()
    assert torch.equal(gpu[0][9].cpu().view(torch.uint8).reshape(-1), pool[2])
    cp.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_protocol_exact_on_cuda(tmp_path, backend, async_scheduling) -> None:
    """The engine-free protocol run (vllm_sim) with vLLM's KV tensors on the GPU: loads
    (host hits synchronous, disk hits asynchronous) and saves through the CUDA copier,
    every forward reading exactly the KV a cold run computes."""
    extra = {"backend": backend, "host_bytes": 24 * SIM_PAGE, "disk_path": str(tmp_path / "disk"),
             "disk_bytes": 96 * SIM_PAGE}
    sim = rig(extra, num_blocks=20, async_scheduling=async_scheduling, device="cuda")
    try:
        assert isinstance(sim.workers[0].engine.copier, CudaCopier)
        Chats().run(sim, 3)
        c = sim.sched.counters
        assert not sim.violations and c["loads_sync"] > 0 and c["loads_async"] > 0 and c["saved_blocks"] > 0
        assert c["hit_blocks_host"] > 0 and c["hit_blocks_disk"] > 0
    finally:
        close(sim)


def test_plans_are_plain_data() -> None:
    assert LoadPlan(1, "r", [0], [1], True).sync and SavePlan(2, "r", [1], [0]).slots == [0]
