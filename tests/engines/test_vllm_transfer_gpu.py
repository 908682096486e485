"""The connector's CUDA transfer path (``kvcm.integrations.vllm.transfer.CudaCopier``): pinned
host staging, a side stream ordered after the compute stream by events, synchronous loads
made visible to the compute stream by an event wait (no host sync).

* On a real GPU (ci/gpu-check.sh, when a CUDA device is there; skipped otherwise).
* Its logic on CPU tensors, in every CI leg (and ci/gpu-check.sh's CPU part): the copier
  built with a stand-in for ``torch.cuda`` (:class:`FakeCuda`: streams and events that record
  what waited on what) and unpinned staging -- save, load (synchronous and asynchronous),
  close, both layouts (block dimension first; K/V first), page bytes as the CPU copier's.
(The CPU copier runs every protocol test in tests/engines/test_vllm_async.py.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from kvcm.integrations.vllm.metadata import LoadPlan, SavePlan
from kvcm.integrations.vllm.transfer import CpuCopier, CudaCopier, page_parts
from vllm_sim import SIM_PAGE, Chats, close, rig

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="no CUDA device (ci/gpu-check.sh runs this where there is one)")


# ---------------------------------------------------------------------------------------
# CudaCopier's logic on CPU tensors


class FakeEvent:
    """A CUDA event: ``record`` notes the stream; complete only once ``synchronize``d (or
    ``complete``d by the test), so what the copier holds until completion stays held."""

    def __init__(self) -> None:
        self.stream: FakeStream | None = None
        self.done = False

    def record(self, stream: FakeStream) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        assert self.stream is not None, "synchronize() on an event never recorded"
        self.done = True

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waits: list[FakeEvent] = []

    def wait_event(self, ev: FakeEvent) -> None:
        assert ev.stream is not None, f"stream {self.name} waits on an event never recorded"
        self.waits.append(ev)


class FakeCuda:
    """What CudaCopier takes from ``torch.cuda``: one compute stream (current outside
    ``stream(...)``), the side streams it makes, events."""

    def __init__(self) -> None:
        self.compute = FakeStream("compute")
        self.current = self.compute
        self.side: list[FakeStream] = []

    def Stream(self, device: torch.device | None = None) -> FakeStream:
        s = FakeStream(f"side{len(self.side)}")
        self.side.append(s)
        return s

    def Event(self) -> FakeEvent:
        return FakeEvent()

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        return self.current


def _page_bytes(tensors: list[torch.Tensor], block: int, kv_first: bool) -> torch.Tensor:
    """The page of ``block`` by hand: layer by layer, the block's bytes (K/V first: its K
    bytes, then its V bytes)."""
    rows = []
    for t in tensors:
        halves = [t[0, block], t[1, block]] if kv_first else [t[block]]
        rows += [h.contiguous().reshape(-1).view(torch.uint8) for h in halves]
    return torch.cat(rows)


@pytest.mark.parametrize("kv_first", [False, True], ids=["blocks-first", "kv-first"])
def test_cuda_copier_logic_on_cpu_saves_loads_and_closes(kv_first: bool) -> None:
    """The copier's own logic, stream and event stand-ins: a save waits (side stream) on the
    forward's marker and lands the page bytes of each block in its slot, in the layout by
    hand (K/V first: K bytes then V bytes per layer); a synchronous load makes the compute
    stream wait on its completion event and holds its buffers until the event completes;
    an asynchronous one waits on the marker it was given and completes before returning;
    close() waits for every held event and lets go of the buffers."""
    n, B, H, D = 12, 4, 2, 8
    shape = (2, n, B, H, D) if kv_first else (n, B, 2, H, D)
    kv = [torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * i for i in range(2)]
    names = ("l0", "l1")
    nbytes = (B * 2 * H * D * 4,) * 2
    cuda = FakeCuda()
    cp = CudaCopier(page_parts(kv, nbytes, n, names), torch.device("cpu"), cuda=cuda, pin=False)
    (side,) = cuda.side
    pool = torch.zeros((8, sum(nbytes)), dtype=torch.uint8)

    marker = cp.forward_marker()
    assert marker.stream is cuda.compute
    cp.save([3, 5, 7], [0, 1, 2], pool, marker)
    assert side.waits == [marker] and cuda.current is cuda.compute
    for slot, block in zip([0, 1, 2], [3, 5, 7], strict=True):
        assert torch.equal(pool[slot], _page_bytes(kv, block, kv_first)), (slot, block)
    want = torch.zeros_like(pool)
    CpuCopier(page_parts(kv, nbytes, n, names)).save([3, 5, 7], [0, 1, 2], want, None)
    assert torch.equal(pool, want)

    before = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    cp.load([0, 1, 2], [9, 10, 11], pool, sync=True)
    start, done = side.waits[-1], cuda.compute.waits[-1]
    assert start.stream is cuda.compute and done.stream is side  # after what was queued; the forward waits on it
    assert not done.done and len(cp._held) == 1  # no host sync: buffers held until the event completes
    for got, was in zip(kv, before, strict=True):
        if kv_first:
            assert torch.equal(got[:, 9:12], was[:, [3, 5, 7]])
        else:
            assert torch.equal(got[9:12], was[[3, 5, 7]])
    assert int(sum(t.count_nonzero() for t in kv)) == int(sum(t[:, [3, 5, 7]].count_nonzero() if kv_first
                                                              else t[[3, 5, 7]].count_nonzero() for t in before))

    queued = cp.forward_marker()
    cp.load([2], [1], pool, sync=False, after=queued)  # asynchronous: waits on the queued marker, done on return
    assert side.waits[-1] is queued and len(cuda.compute.waits) == 1
    assert torch.equal(kv[0][:, 1] if kv_first else kv[0][1], before[0][:, 7] if kv_first else before[0][7])

    cp.load([0], [2], pool, sync=True)  # the first held event still pending: both held
    assert len(cp._held) == 2
    done.synchronize()
    cp.load([1], [4], pool, sync=True)  # the completed one is let go, the others stay
    assert len(cp._held) == 2 and all(not ev.done for ev, _ in cp._held)
    held = [ev for ev, _ in cp._held]
    cp.close()
    assert not cp._held and all(ev.done for ev in held)


def test_cuda_copier_logic_on_cpu_tuple_blocks_pick_each_part_s_group() -> None:
    """Hybrid models: a block given as a tuple (one id per vLLM group) is read and written
    at its part's group's id."""
    n, B = 6, 4
    kv = [torch.arange(n * B * 2, dtype=torch.float32).view(n, B, 2) + 100 * i for i in range(2)]
    nbytes = (B * 2 * 4,) * 2
    parts = page_parts(kv, nbytes, n, ("full", "swa"), groups=(0, 1))
    cp = CudaCopier(parts, torch.device("cpu"), cuda=FakeCuda(), pin=False)
    pool = torch.zeros((2, sum(nbytes)), dtype=torch.uint8)
    cp.save([(1, 4)], [1], pool, None)
    assert torch.equal(pool[1], torch.cat([kv[0][1].reshape(-1).view(torch.uint8), kv[1][4].reshape(-1).view(torch.uint8)]))
    cp.load([1], [(2, 3)], pool, sync=False)
    assert torch.equal(kv[0][2], kv[0][1]) and torch.equal(kv[1][3], kv[1][4])
    cp.close()


# ---------------------------------------------------------------------------------------
# On a real GPU


@requires_cuda
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


@requires_cuda
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


@requires_cuda
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
