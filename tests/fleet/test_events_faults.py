"""Faults of the publisher and its subscriber on real sockets (127.0.0.1, ephemeral ports),
issue #18 items 1, 2, 8, 10 and 11.  Each test is named after the fault it guards against;
the manager's backend is the one ``KVCM_BACKEND`` selects.  Every wait is bounded by a
deadline and the assertions are on outcomes, never on speed."""

from __future__ import annotations

import threading
import time
from typing import Any

import kvcm
import pytest
import zmq
from events_client import replay_request
from kvcm import AttentionLayer, KVCacheManagerConfig, Tier
from kvcm.fleet.publisher import EventPublisher
from kvcm.fleet.router_index import RouterIndex, RouterModel
from kvcm.fleet.subscriber import FleetSubscriber
from kvcm.fleet.wire import END_SEQ, SNAPSHOT_REQUEST, BlockStored, Decoder, Encoder, seq_bytes, seq_of
from test_wire import hybrid, run

WAIT_MS = 5000


def wide(tokens_per_block: int = 16, pages: int = 4096) -> KVCacheManagerConfig:
    """One attention life cycle with room for many blocks (big batches, few evictions)."""
    return KVCacheManagerConfig(tokens_per_block=tokens_per_block, layers=[AttentionLayer(0, 8)],
                                tiers=[Tier("gpu", pages * 8 * tokens_per_block)], enable_partial_reuse=False)


def step(mgr: kvcm.KVCacheManager, pub: EventPublisher, prompt: list[int]) -> None:
    run(mgr, prompt, chunk=len(prompt))
    pub.publish(mgr.take_events())


def joined_sub(ctx: zmq.Context, pub: EventPublisher, mgr: kvcm.KVCacheManager, **opts: int) -> zmq.Socket:
    """A SUB socket known to receive (PUB/SUB joins asynchronously)."""
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        s.setsockopt(getattr(zmq, k), v)
    s.setsockopt(zmq.SUBSCRIBE, b"kvcm")
    s.connect(pub.endpoint)
    B = mgr.config.tokens_per_block
    for i in range(400):
        step(mgr, pub, [7_000_000 + i] * B)
        assert pub.flush()
        if s.poll(20):
            while s.poll(50):
                s.recv_multipart()
            return s
    raise AssertionError("subscription never joined")


def kernel_send_buffer_max() -> int:
    """The most a TCP socket's send buffer grows to (Linux autotuning), 4 MiB if unknown."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20




def rebind(mgr: kvcm.KVCacheManager, endpoints: tuple[str, str], ctx: zmq.Context, **kw: Any) -> EventPublisher:
    for _ in range(250):  # the old sockets release their ports asynchronously
        try:
            return EventPublisher(mgr, *endpoints, context=ctx, **kw)
        except zmq.ZMQError:
            time.sleep(0.02)
    raise AssertionError("the endpoints were never released")


# ---------------------------------------------------------------- item 1


def test_replay_request_flood_does_not_stop_the_live_stream(ctx: zmq.Context) -> None:
    """One client looping replay requests over 2,000 buffered batches must not hold back
    the live stream, nor an honest client's answer."""
    mgr = kvcm.KVCacheManager(wide(tokens_per_block=4))
    # a queue longer than the steps: no step is dropped for a slow thread on a loaded machine
    with EventPublisher(mgr, buffer_steps=4000, max_queue=4096, context=ctx) as pub:
        for i in range(2000):
            step(mgr, pub, [i, i + 1, i + 2, i + 3])
        assert pub.flush(60) and pub.next_seq >= 2000
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.replay_endpoint)
            try:
                while not stop.is_set():
                    try:
                        s.send_multipart([b"", seq_bytes(0)], zmq.NOBLOCK)
                        sent[0] += 1
                    except zmq.Again:
                        pass
                    for _ in range(200):  # read some answers, never all of them
                        try:
                            s.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
            finally:
                s.close(linger=0)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            deadline = time.monotonic() + 30
            while sent[0] < 100 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sent[0] >= 100, "the flood never started"
            before = pub.published
            for i in range(300):
                step(mgr, pub, [50_000 + i] * 4)
            assert pub.flush(30), "the live stream stopped under the replay flood"
            assert pub.published >= before + 300
            # an honest client still gets a complete answer during the flood
            got = [s for s, _ in replay_request(ctx, pub, seq_bytes(pub.next_seq - 5), wait_ms=20_000)]
            start = pub.next_seq - 5
            assert got == list(range(start, start + 5))
            assert pub.stats()["requests_refused"] > 0  # the flooder's extra requests: capped
        finally:
            stop.set()
            flooder.join(10)


# ---------------------------------------------------------------- item 2


@pytest.mark.parametrize("path", ["live", "replay"])
def test_restart_on_the_same_endpoints_is_noticed_by_its_new_instance_identity(ctx: zmq.Context, path: str) -> None:
    """The old life's blocks reached the router by snapshot only (no live batch, so no
    sequence number to regress); the new life starts again at 0 on the same endpoints.
    Sequence numbers alone apply the new stream on top of the old state."""
    cfg = hybrid(enable_partial_reuse=False)
    old_prompts = [[100 * i + j for j in range(8)] for i in range(1, 4)]
    new_prompts = [[100 * i + j for j in range(8)] for i in range(5, 7)]
    m1 = kvcm.KVCacheManager(cfg)
    for p in old_prompts:
        run(m1, p)
    m1.take_events()
    pub1 = EventPublisher(m1, context=ctx, instance=b"life-1")
    endpoints = (pub1.endpoint, pub1.replay_endpoint)
    assert endpoints[1] is not None
    router = RouterIndex(RouterModel.from_config(cfg))
    sub = FleetSubscriber(router, {"a": endpoints}, context=ctx)  # type: ignore[dict-item]
    pub2 = None
    try:
        assert all(router.reuse("a", p) == m1.probe_reuse(p) > 0 for p in old_prompts)
        pub1.close()
        m2 = kvcm.KVCacheManager(cfg)  # the engine restarted: empty cache, sequence from 0
        pub2 = rebind(m2, endpoints, ctx, instance=b"life-2")  # type: ignore[arg-type]
        if path == "replay":
            sub.drop = lambda name, seq: True  # the new life is reached by replay only
        for p in new_prompts:
            run(m2, p)
            pub2.publish(m2.take_events())
        assert pub2.flush()
        sub.sync({"a": pub2.next_seq})
        assert sub.restarts >= 1
        for p in old_prompts + new_prompts:
            assert router.reuse("a", p) == m2.probe_reuse(p), p
        assert any(router.reuse("a", p) > 0 for p in new_prompts)
    finally:
        sub.close()
        pub1.close()
        if pub2 is not None:
            pub2.close()


def test_batches_of_a_life_left_behind_are_ignored(ctx: zmq.Context) -> None:
    """A late batch of the old life (still in flight when the router switched to the new
    one) must neither be applied nor trigger another resynchronisation."""
    cfg = hybrid(enable_partial_reuse=False)
    mgr = kvcm.KVCacheManager(cfg)
    with EventPublisher(mgr, context=ctx, instance=b"now") as pub:
        router = RouterIndex(RouterModel.from_config(cfg))
        with FleetSubscriber(router, {"a": (pub.endpoint, pub.replay_endpoint)}, context=ctx) as sub:  # type: ignore[dict-item]
            feed = sub._feeds["a"]
            assert feed.instance == b"now"
            feed.retired.add(b"before")
            # the old life's publisher, still sending: a second PUB the SUB also listens to
            old = ctx.socket(zmq.PUB)
            old.setsockopt(zmq.LINGER, 0)
            port = old.bind_to_random_port("tcp://127.0.0.1")
            feed.sub.connect(f"tcp://127.0.0.1:{port}")
            stored = BlockStored(block_hashes=[b"x" * 32], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                 block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                                 kv_cache_spec_kind="full_attention")
            stale = Encoder("map", 0, b"before").encode(0.0, [stored])
            seen = 0
            for _ in range(200):  # PUB/SUB joins asynchronously: send until one is looked at
                old.send_multipart([b"kvcm", seq_bytes(feed.expected), stale])
                seen += sub.poll(0.02)
                if seen:
                    break
            old.close(linger=0)
            assert seen and sub.restarts == 0 and sub.snapshots == 1 and sub.applied == 0
            assert router.instance("a").blocks == {}
            assert sub._life(feed, Encoder("map", 0, b"other").encode(0.0, [])) == "new"
            assert sub._life(feed, Encoder("map", 0, None).encode(0.0, [])) == "same"  # no identity: seq rules


# ---------------------------------------------------------------- item 8


def test_replay_replies_are_framed_as_vllm_frames_them(ctx: zmq.Context) -> None:
    """vLLM's ZmqEventPublisher (v0.26.0, v0.32.0) answers a replay request with
    ``(topic, seq, payload)`` per batch and ends with ``(b"", END_SEQ, b"")``; a replay
    client written for vLLM must read kvcm the same way."""
    mgr = kvcm.KVCacheManager(hybrid())
    with EventPublisher(mgr, context=ctx) as pub:
        for i in range(3):
            run(mgr, [100 * i + j for j in range(8)])
            pub.publish(mgr.take_events())
        assert pub.flush()
        for request, want in ((seq_bytes(1), [1, 2]), (SNAPSHOT_REQUEST, [3])):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.replay_endpoint)
            s.send_multipart([b"", request])
            seqs = []
            while True:
                assert s.poll(WAIT_MS)
                frames = s.recv_multipart()
                assert len(frames) == 4 and frames[0] == b""  # delimiter + vLLM's three frames
                topic, sq, payload = frames[1:]
                if sq == END_SEQ:
                    assert (topic, payload) == (b"", b"")
                    break
                assert topic == b"kvcm" and len(sq) == 8
                Decoder().decode(payload)
                seqs.append(seq_of(sq))
            s.close(linger=0)
            assert seqs == want
        # a REQ client (as vLLM's examples use) sees the first reply as three frames
        r = ctx.socket(zmq.REQ)
        r.setsockopt(zmq.LINGER, 0)
        r.connect(pub.replay_endpoint)
        r.send(seq_bytes(2))
        assert r.poll(WAIT_MS)
        topic, sq, _payload = r.recv_multipart()
        assert topic == b"kvcm" and seq_of(sq) == 2
        r.close(linger=0)


# ---------------------------------------------------------------- item 10


def test_stalled_subscriber_pins_bounded_bytes_and_its_drops_are_counted(ctx: zmq.Context) -> None:
    """A subscriber that stays connected but never reads: what the publisher keeps for it
    is bounded by ``live_buffer_bytes`` (it receives at most that, plus what the kernel's
    socket buffers held, once it reads again), and the batches it missed are counted."""
    budget = 256 * 1024
    mgr = kvcm.KVCacheManager(wide(tokens_per_block=64, pages=8192))
    with EventPublisher(mgr, context=ctx, live_buffer_bytes=budget, max_batch_bytes=16 * 1024,
                        replay_buffer_bytes=1 << 20) as pub:
        assert pub.hwm == 16
        # its own queue holds one message and its kernel buffer little: the backlog stays
        # with the publisher, which is what is measured
        stalled = joined_sub(ctx, pub, mgr, RCVHWM=1, RCVBUF=16 * 1024)
        slack = kernel_send_buffer_max() + (1 << 20)  # + its RCVBUF and a batch in flight
        bytes_before = pub.stats()["published_bytes"]
        sent = 0
        for i in range(4000):  # ~12 KB per batch, until twice what a bounded queue may hold
            step(mgr, pub, [4096 * (i + 16) + t for t in range(32 * 64)])
            if i % 50 == 49:
                assert pub.flush(30)
                sent = pub.stats()["published_bytes"] - bytes_before
                if sent > 2 * (budget + slack):
                    break
        assert pub.flush(30) and sent > 2 * (budget + slack)
        end = pub.next_seq
        # read again: count what was kept for it, up to a marker batch published afterwards
        received, seqs, marker = 0, [], None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not stalled.poll(200):
                marker = pub.next_seq
                step(mgr, pub, [9_000_000 + len(seqs)] * 64)
                assert pub.flush()
                continue
            _topic, sq, payload = stalled.recv_multipart()
            seq = seq_of(sq)
            if marker is not None and seq >= marker:
                break
            received += len(payload)
            seqs.append(seq)
        else:
            raise AssertionError("the subscriber never caught up")
        assert seqs and set(range(seqs[0], end)) - set(seqs)  # it missed batches
        print(f"stalled subscriber: {sent} bytes published, {received} received after it read again")
        assert received <= budget + slack, (received, budget, slack)
        assert pub.stats()["live_dropped"] > 0
        assert pub.stats()["replay_buffered_bytes"] <= 1 << 20
        stalled.close(linger=0)


def test_large_step_is_split_into_batches_within_max_batch_bytes(ctx: zmq.Context) -> None:
    """The byte bound needs bounded messages: a step whose batch exceeds ``max_batch_bytes``
    goes out as consecutive batches (multi-block events cut into chains), and a subscriber
    applying them in order holds exactly the blocks of the step."""
    cfg = wide(tokens_per_block=16)
    mgr = kvcm.KVCacheManager(cfg)
    with EventPublisher(mgr, context=ctx, max_batch_bytes=2048) as pub:
        router = RouterIndex(RouterModel.from_config(cfg))
        with FleetSubscriber(router, {"a": (pub.endpoint, pub.replay_endpoint)}, context=ctx) as sub:  # type: ignore[dict-item]
            prompts = [list(range(1000 * i, 1000 * i + 16 * 40)) for i in range(1, 4)]
            for p in prompts:
                step(mgr, pub, p)
            assert pub.flush()
            assert pub.split == 3 and pub.next_seq > 3
            batches = replay_request(ctx, pub, seq_bytes(0))
            assert [s for s, _ in batches] == list(range(pub.next_seq))
            assert all(len(p) <= 2048 for _, p in batches)
            stored = [e for _, p in batches for e in Decoder().decode(p).events]
            assert sum(len(e.block_hashes) for e in stored) == 3 * 40
            sub.sync({"a": pub.next_seq})
            for p in prompts:
                for n in (16, 320, 640):
                    assert router.reuse("a", p[:n]) == mgr.probe_reuse(p[:n]) == n


# ---------------------------------------------------------------- item 11


def test_close_with_a_busy_thread_leaves_the_sockets_to_the_thread(ctx: zmq.Context) -> None:
    """``close(timeout)`` must not close the sockets while the publisher thread may still
    use them (ZeroMQ sockets are not thread-safe): the thread closes them when it ends."""
    mgr = kvcm.KVCacheManager(hybrid())
    pub = EventPublisher(mgr, context=ctx)
    gate, inside = threading.Event(), threading.Event()
    handle = pub._handle

    def held(item: Any) -> None:
        inside.set()
        gate.wait(30)
        handle(item)

    pub._handle = held  # type: ignore[method-assign]
    try:
        run(mgr, list(range(8)))
        pub.publish(mgr.take_events())
        assert inside.wait(10)
        assert pub.close(timeout=0.1) is False  # the thread is still busy with the step
        assert pub._thread.is_alive()
        assert not pub._pub.closed and pub._replay is not None and not pub._replay.closed
    finally:
        gate.set()
    pub._thread.join(10)
    assert not pub._thread.is_alive()
    assert pub._pub.closed and pub._replay.closed
    assert pub.close() is True  # a second close only waits
    with pytest.raises(RuntimeError):
        pub.publish([])
