"""The KV-event tools of ``python -m kvcm events`` (:mod:`kvcm.cli.events`): watch a
stream (:func:`watch`), run a demo publisher watched in process (:func:`demo`); the
publisher's cost (``--bench``) is :mod:`kvcm.bench.events`.  Needs the events extra (pyzmq,
msgspec).

The watcher prints one line per batch (``seq``, ``ts``, then each event) and, with
``--replay``, heals sequence gaps through the replay endpoint (``gap`` lines say so);
``--snapshot`` first prints the publisher's snapshot (kvcm publishers only).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from kvcm.fleet.wire import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Decoder,
    seq_bytes,
    seq_of,
)


def _h(x: Any) -> str:
    return x.hex()[:12] if isinstance(x, bytes) else str(x)


def describe(event: Any) -> str:
    """One wire event as one human-readable line."""
    if isinstance(event, BlockStored):
        spec = event.kv_cache_spec_kind or "?"
        if event.kv_cache_spec_sliding_window is not None:
            spec += f"({event.kv_cache_spec_sliding_window})"
        return (f"  stored   group={event.group_idx} {spec:<18} {event.medium:<7} parent={_h(event.parent_block_hash)}"
                f" blocks={[_h(h) for h in event.block_hashes]} tokens={len(event.token_ids)}"
                + (f" lora={event.lora_id}" if event.lora_id is not None else ""))
    if isinstance(event, BlockRemoved):
        return f"  removed  group={event.group_idx} {event.medium:<7} blocks={[_h(h) for h in event.block_hashes]}"
    if isinstance(event, AllBlocksCleared):
        return "  cleared"
    return f"  {event!r}"


def print_batch(seq: int, payload: bytes, dec: Decoder, label: str = "") -> None:
    """Decode one event batch (sequence number ``seq``) and print it, one line per event."""
    batch = dec.decode(payload)
    print(f"seq {seq} ts {batch.ts:g}{label}: {len(batch.events)} event(s)")
    for e in batch.events:
        print(describe(e))


def _request(ctx: zmq.Context, endpoint: str, req: bytes, timeout: float) -> list[tuple[int, bytes]]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart([b"", req])
    out = []
    try:
        while s.poll(int(timeout * 1000)):
            frames = s.recv_multipart()
            if frames[-2] == END_SEQ:
                return out
            out.append((seq_of(frames[-2]), frames[-1]))
        raise TimeoutError(f"no answer from {endpoint}")
    finally:
        s.close(linger=0)


def watch(connect: str, replay: str | None, topic: str, count: int | None, timeout: float,
          snapshot: bool, ctx: zmq.Context | None = None, ready: threading.Event | None = None,
          on_idle: Any = None) -> int:
    """Print batches as they arrive; returns the number printed.  Stops after ``count``
    batches or ``timeout`` seconds without one (``on_idle(printed)`` is called then)."""
    ctx = ctx or zmq.Context.instance()
    dec = Decoder()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(connect)
    expected = -1
    printed = 0
    try:
        if snapshot and replay:
            [(expected, payload)] = _request(ctx, replay, SNAPSHOT_REQUEST, timeout)
            print_batch(expected, payload, dec, " (snapshot)")
        if ready is not None:
            ready.set()
        while count is None or printed < count:
            if not sub.poll(int(timeout * 1000)):
                if on_idle is not None:
                    on_idle(printed)
                break
            _topic, sq, payload = sub.recv_multipart()
            seq = seq_of(sq)
            if seq < expected:
                continue
            if expected >= 0 and seq > expected and replay:
                print(f"gap: expected {expected}, got {seq}; replaying")
                for rs, rp in _request(ctx, replay, seq_bytes(expected), timeout):
                    if expected <= rs < seq:
                        print_batch(rs, rp, dec, " (replayed)")
                        printed += 1
            print_batch(seq, payload, dec)
            printed += 1
            expected = seq + 1
    finally:
        sub.close(linger=0)
    return printed


def demo(steps: int) -> int:
    """A small hybrid manager behind a publisher on 127.0.0.1, watched in this process."""
    import kvcm
    from kvcm import AttentionLayer, SsmLayer
    from kvcm.engine_loop import config_from_layout
    from kvcm.fleet.publisher import EventPublisher

    # pages of 128 bytes (32 + 32 + 64), six of them in each of gpu and host
    cfg = config_from_layout(4, [AttentionLayer(0, 8), AttentionLayer(1, 8, window=8), SsmLayer(2, 64)],
                             gpu_blocks=6, host_blocks=6, enable_partial_reuse=False)
    mgr = kvcm.KVCacheManager(cfg)
    with EventPublisher(mgr) as pub:
        print(f"publishing on {pub.endpoint}, replay/snapshot on {pub.replay_endpoint}")
        ready = threading.Event()
        t = threading.Thread(target=watch, args=(pub.endpoint, pub.replay_endpoint, "kvcm", None, 1.0, True),
                             kwargs={"ready": ready}, daemon=True)
        t.start()
        ready.wait(5)
        time.sleep(0.2)  # let the subscription join
        for i in range(steps):
            p = [(7 * i + j) % 11 for j in range(8)] + [100 + i] * 4
            kv = mgr.create_kv_cache(p)
            if kv.resume() and kv.resize(len(p)):
                for s in range(kv.num_committed_tokens, len(p), 4):
                    kv.commit(p[s:s + 4])
            kv.close()
            pub.publish(mgr.take_events())
            pub.flush()
            time.sleep(0.05)
        t.join(5)
    return 0


__all__ = ["demo", "describe", "print_batch", "watch"]
