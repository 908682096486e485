"""A replay client of the event publisher as vLLM's: a DEALER socket sends an empty
delimiter and the request (a start sequence number or the snapshot request) and reads
``(topic, seq, payload)`` batches up to the end marker.  Shared by the events tests
(tests/fleet/) and the wire parity scenario (parity/test_events_wire.py)."""

from __future__ import annotations

import zmq
from kvcm.fleet.publisher import EventPublisher
from kvcm.fleet.wire import END_SEQ, seq_of


def replay_request(ctx: zmq.Context, pub: EventPublisher, request: bytes,
                   wait_ms: int = 5000) -> list[tuple[int, bytes]]:
    """``(seq, payload)`` of every batch the replay endpoint answers ``request`` with; each
    receive waits at most ``wait_ms``."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(pub.replay_endpoint)
    s.send_multipart([b"", request])
    out = []
    try:
        while True:
            assert s.poll(wait_ms), "no complete answer from the replay endpoint"
            empty, topic, sq, payload = s.recv_multipart()
            assert empty == b""
            if sq == END_SEQ:
                assert topic == payload == b""
                return out
            assert topic == b"kvcm"
            out.append((seq_of(sq), payload))
    finally:
        s.close(linger=0)


__all__ = ["replay_request"]
