"""``python -m kvcm events --bench`` (:mod:`kvcm.cli.events`): the KV-event publisher's cost
per engine step on the shipped trace (:func:`bench`).  Needs the events extra (pyzmq,
msgspec)."""

from __future__ import annotations

import statistics
import threading
import time

import zmq


def bench(limit: int, backend: str | None, block_size: int) -> dict[str, float]:
    """Publisher cost per engine step on the shipped trace (one prefill step per request),
    with a SUB socket attached and drained by a thread.  Timing is reporting only."""
    import kvcm
    from kvcm.fleet.publisher import EventPublisher
    from kvcm.tools.replay import replay_config
    from kvcm.tools.trace import expand_prompt, load_trace, unique_blocks

    trace = load_trace(limit=limit)
    cfg = replay_config(block_size, max(1, unique_blocks(trace, block_size) // 2), enable_partial_reuse=False)
    mgr = kvcm.KVCacheManager(cfg, backend=backend)
    ctx = zmq.Context()
    received = [0]
    stop = threading.Event()
    with EventPublisher(mgr, context=ctx) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kvcm")
        sub.connect(pub.endpoint)

        def drain() -> None:
            while not stop.is_set():
                if sub.poll(10):
                    sub.recv_multipart()
                    received[0] += 1

        th = threading.Thread(target=drain, daemon=True)
        th.start()
        time.sleep(0.2)
        calls: list[float] = []
        events = 0
        clock = time.perf_counter
        t_all = clock()
        for req in trace:
            p = expand_prompt(req)
            kv = mgr.create_kv_cache(p)
            if kv.resume() and kv.resize(len(p)):
                kv.commit(p[kv.num_committed_tokens:])
            kv.close()
            mgr.drain_copy_ops()
            evs = mgr.take_events()
            events += len(evs)
            t0 = clock()
            pub.publish(evs)
            calls.append(clock() - t0)
        pub.flush(30)
        total = clock() - t_all
        empty = []
        for _ in range(1000):
            t0 = clock()
            pub.publish([])
            empty.append(clock() - t0)
        deadline = time.monotonic() + 5
        while received[0] < pub.published and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        th.join(2)
        sub.close(linger=0)
        thread_s = pub.thread_s
        published = pub.published
    ctx.term()
    steps = len(calls)
    return {
        "steps": steps, "events": events, "batches": published, "received": received[0],
        "publish_us_mean": 1e6 * statistics.fmean(calls), "publish_us_median": 1e6 * statistics.median(calls),
        "empty_step_us": 1e6 * statistics.median(empty),
        "thread_us_per_step": 1e6 * thread_s / steps, "thread_us_per_event": 1e6 * thread_s / max(1, events),
        "loop_s": total,
    }


__all__ = ["bench"]
