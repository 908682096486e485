"""The publisher on real ZeroMQ sockets (127.0.0.1, ephemeral ports): PUB frames, replay,
snapshot, the bounded queue, and resets.  Every receive is bounded by a poll timeout."""

from __future__ import annotations

import threading
import time
from typing import Any

import kvcm
import msgspec
import pytest
import zmq
from events_client import replay_request
from kvcm.fleet.publisher import EventPublisher
from kvcm.fleet.router_index import RouterIndex, RouterModel
from kvcm.fleet.subscriber import FleetSubscriber
from kvcm.fleet.wire import SNAPSHOT_REQUEST, AllBlocksCleared, BlockStored, Decoder, seq_bytes, seq_of
from test_wire import B, hybrid, run

TIMEOUT_MS = 3000


def sub_socket(ctx: zmq.Context, pub: EventPublisher) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"kvcm")
    s.connect(pub.endpoint)
    return s


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS), "nothing received in time"
    return sock.recv_multipart()


def joined(ctx: zmq.Context, pub: EventPublisher, mgr: kvcm.KVCacheManager) -> zmq.Socket:
    """A SUB socket that is known to receive (PUB/SUB joins asynchronously): publish
    single-block steps until one arrives."""
    s = sub_socket(ctx, pub)
    for i in range(200):
        run(mgr, [10_000 + i] * B)
        pub.publish(mgr.take_events())
        pub.flush()
        if s.poll(20):
            while s.poll(50):
                s.recv_multipart()
            return s
    raise AssertionError("subscription never joined")


def req_first_reply(ctx: zmq.Context, pub: EventPublisher, req: bytes) -> tuple[int, bytes]:
    """vLLM's replay client uses a REQ socket: it sees ``(topic, seq, payload)`` frames."""
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(pub.replay_endpoint)
    try:
        s.send(req)
        topic, sq, payload = recv(s)
        assert topic == b"kvcm"
        return seq_of(sq), payload
    finally:
        s.close(linger=0)




def test_pub_frames_are_topic_seq_payload_and_ts_is_the_step(ctx: zmq.Context) -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    with EventPublisher(mgr, topic="kvcm") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint.startswith("tcp://127.0.0.1:")
        sub = joined(ctx, pub, mgr)
        first = pub.next_seq
        pub.publish([])  # a step without events publishes nothing but counts as a step
        step_before = pub._step
        run(mgr, list(range(8)))
        assert pub.publish(mgr.take_events())
        topic, sq, payload = recv(sub)
        assert topic == b"kvcm" and len(sq) == 8 and seq_of(sq) == first
        batch = Decoder().decode(payload)
        assert batch.ts == float(step_before) and batch.data_parallel_rank == 0
        assert [type(e) for e in batch.events] == [BlockStored] * 6
        sub.close(linger=0)


def test_injected_clock_stamps_ts(ctx: zmq.Context) -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    ticks = iter([10.5, 11.5, 12.5] + [99.0] * 300)
    with EventPublisher(mgr, clock=lambda: next(ticks)) as pub:
        sub = joined(ctx, pub, mgr)
        run(mgr, list(range(8)))
        pub.publish(mgr.take_events())
        ts = Decoder().decode(recv(sub)[2]).ts
        assert ts in (11.5, 12.5, 99.0)  # the clock's value, not the step number
        sub.close(linger=0)


def test_replay_from_a_sequence_number_then_end_marker(ctx: zmq.Context) -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    with EventPublisher(mgr, buffer_steps=4) as pub:
        for i in range(6):
            run(mgr, list(range(100 * i, 100 * i + 4)))
            pub.publish(mgr.take_events())
        pub.flush()
        assert pub.next_seq == 6
        seq, payload = req_first_reply(ctx, pub, seq_bytes(3))
        assert seq == 3 and Decoder().decode(payload).events
        got = replay_request(ctx, pub, seq_bytes(3))
        assert [s for s, _ in got] == [3, 4, 5]
        got = replay_request(ctx, pub, seq_bytes(0))
        assert [s for s, _ in got] == [2, 3, 4, 5]  # the buffer keeps the last 4 batches
        assert replay_request(ctx, pub, seq_bytes(9)) == []
        assert pub.replays_served == 4


def test_snapshot_is_stamped_and_equals_the_replayed_state(ctx: zmq.Context) -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    with EventPublisher(mgr) as pub:
        for i in range(5):
            run(mgr, list(range(100 * i, 100 * i + 8)))
            pub.publish(mgr.take_events())
        pub.flush()
        [(stamp, payload)] = replay_request(ctx, pub, SNAPSHOT_REQUEST)
        assert stamp == pub.next_seq == 5
        snap = Decoder().decode(payload)
        assert isinstance(snap.events[0], AllBlocksCleared)
        model = RouterModel.from_config(hybrid())
        from_snapshot, from_stream = RouterIndex(model), RouterIndex(model)
        from_snapshot.reset("a", snap)
        for _, p in replay_request(ctx, pub, seq_bytes(0)):
            from_stream.apply("a", Decoder().decode(p))
        a, b = from_snapshot.instance("a").blocks, from_stream.instance("a").blocks
        assert {k: e.pages for k, e in a.items()} == {k: e.pages for k, e in b.items()} != {}


def test_full_queue_drops_and_counts_without_blocking_then_resets(ctx: zmq.Context) -> None:
    mgr = kvcm.KVCacheManager(hybrid(enable_partial_reuse=False))
    with EventPublisher(mgr, max_queue=1) as pub:
        gate = threading.Event()
        handle = pub._handle

        def gated(item: Any) -> None:
            gate.wait(5)
            handle(item)

        pub._handle = gated  # type: ignore[method-assign]  # hold the publisher thread
        prompts = [list(range(100 * i, 100 * i + 8)) for i in range(6)]
        t0 = time.perf_counter()
        results = []
        try:
            for p in prompts:
                run(mgr, p)
                results.append(pub.publish(mgr.take_events()))
            assert time.perf_counter() - t0 < 4.0  # publish never waited for the gated thread (5 s)
            assert results[0] and False in results and pub.dropped == results.count(False)
        finally:
            gate.set()
        pub.flush()
        run(mgr, list(range(900, 904)))
        assert pub.publish(mgr.take_events())  # after a drop: a reset batch instead
        pub.flush()
        # one reset per drop streak: 1 or 2 streaks, by when the thread took the first step
        assert 1 <= pub.resets <= 2
        router = RouterIndex(RouterModel.from_config(hybrid()))
        with FleetSubscriber(router, {"a": (pub.endpoint, pub.replay_endpoint)}, context=ctx) as sub:
            sub.sync({"a": pub.next_seq})
            for p in [*prompts, list(range(900, 904))]:
                assert router.reuse("a", p) == mgr.probe_reuse(p)


def test_manager_event_overflow_is_detected_and_reset(ctx: zmq.Context) -> None:
    mgr = kvcm.KVCacheManager(hybrid(max_events=2, enable_partial_reuse=False))
    with EventPublisher(mgr) as pub:
        run(mgr, list(range(12)))  # 3 stored events, 1 of them dropped by the manager
        assert pub.publish(mgr.take_events())
        pub.flush()
        assert pub.resets == 1
        [(_, payload)] = replay_request(ctx, pub, seq_bytes(0))
        events = Decoder().decode(payload).events
        assert isinstance(events[0], AllBlocksCleared) and len(events) == 1 + 9  # 3 blocks x 3 lcs


def test_publish_after_close_raises() -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    pub = EventPublisher(mgr)
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish([])


def test_publisher_payload_decodes_with_plain_msgpack(ctx: zmq.Context) -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    with EventPublisher(mgr) as pub:
        run(mgr, list(range(4)))
        pub.publish(mgr.take_events())
        pub.flush()
        [(_, payload)] = replay_request(ctx, pub, seq_bytes(0))
        ts, events, rank, instance = msgspec.msgpack.decode(payload)  # 4th: kvcm's instance identity
        assert ts == 0.0 and rank == 0 and [e["type"] for e in events] == ["BlockStored"] * 3
        assert instance == pub.instance and len(instance) == 8
