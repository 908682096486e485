"""The router's side of the wire: subscribe to many instances and keep a ``RouterIndex`` exact.

Per instance: a SUB socket on its PUB endpoint and a DEALER socket on its replay endpoint
(frames as vLLM's replay clients: an empty delimiter, then the request; answers are
``(topic, seq, payload)`` as vLLM frames them, the client reads the last two).  Every batch
carries a sequence number; the client tracks the next one it needs, ``expected``:

* a batch with ``seq == expected`` is applied; ``seq < expected`` was already applied
  through a replay, ignored — unless it is not above the last *live* sequence number: PUB/SUB
  keeps order, so that means the publisher restarted (its numbers start again at 0), and the
  client takes a snapshot;
* ``seq > expected`` is a **gap** (lost messages, or a subscription that started late): the
  client asks the replay endpoint for everything from ``expected`` and applies it in order;
  if the publisher's buffer no longer holds ``expected``, it falls back to a snapshot;
* a **snapshot** (``b"kvcm:snapshot"`` request, see ``kvcm.fleet.publisher``) replaces the instance's
  state and sets ``expected`` to the sequence number it is stamped with.  A router that
  starts (or restarts) takes one snapshot per instance before anything else.
* **instance identity**: a kvcm publisher stamps every batch with ``kvcm_instance``, one
  value per life.  A batch (live or replayed) of another life than the snapshot the index
  was built from means the instance restarted on the same endpoints: the client counts a
  restart and takes a snapshot of the new life; batches of a life it has left are ignored.
  Batches without an identity (other publishers) fall back to the sequence-number rules.

A **malformed** message — a live message that is not ``(topic, 8-byte seq, payload)``, a
payload that does not decode as a ``KVEventBatch``, or a batch the router rejects
(``kvcm.fleet.router_index.InvalidBatchError``: another block size, a group or spec the model does not
have, a block hash that is neither bytes nor int) — never raises out of ``poll`` / ``sync``:
it is dropped whole (nothing of it applied), counted for its instance (``stats()``), and that
instance alone is resynchronised by a snapshot; the other instances go on.  A snapshot that is
malformed itself leaves the instance empty and unsynchronised (it answers 0 reuse): its
later messages are skipped and it tries again after 1, 3, 7, ... of them (at most 1023), so a
publisher that does not fit the router's model is not asked for a snapshot per message.

All waits are bounded (``timeout``); a publisher that does not answer raises TimeoutError.
``drop`` (tests) discards live messages before they are looked at, as a lossy network would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import msgspec
import zmq

from kvcm.fleet.router_index import InvalidBatchError, RouterIndex
from kvcm.fleet.wire import END_SEQ, SNAPSHOT_REQUEST, Decoder, instance_of, seq_bytes, seq_of


@dataclass
class _Feed:
    name: Any
    sub: zmq.Socket
    replay: zmq.Socket
    expected: int = -1  # -1: no snapshot yet
    last_live: int = -1  # the last sequence number received live
    instance: bytes | None = None  # the publisher life the index follows (None: unknown)
    retired: set[bytes] = field(default_factory=set)  # lives left behind (restarts)
    counts: dict[str, int] = field(default_factory=dict)  # see FleetSubscriber.stats
    failures: int = 0  # snapshots in a row that were malformed
    hold: int = 0  # live messages to skip before the next resync attempt (unsynchronised)


class FleetSubscriber:
    """Feeds a ``RouterIndex`` from the wire streams of many instances."""

    def __init__(
        self,
        router: RouterIndex,
        instances: Mapping[Any, tuple[str, str]],
        *,
        topic: str = "kvcm",
        timeout: float = 5.0,
        drop: Callable[[Any, int], bool] | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.router = router
        self.timeout = timeout
        self.drop = drop
        self.gaps = 0
        self.replays = 0
        self.snapshots = 0
        self.dropped = 0
        self.applied = 0
        self.restarts = 0  # publisher restarts detected
        self.malformed = 0  # malformed messages / batches / snapshots, all instances
        self._dec = Decoder()
        self._why: dict[Any, str] = {}  # instance -> why its last malformed message was dropped
        self._ctx = context or zmq.Context.instance()
        self._feeds: dict[Any, _Feed] = {}
        self._by_sock: dict[zmq.Socket, _Feed] = {}
        self._poller = zmq.Poller()
        for name, (endpoint, replay_endpoint) in instances.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(endpoint)
            rep = self._ctx.socket(zmq.DEALER)
            rep.setsockopt(zmq.LINGER, 0)
            rep.connect(replay_endpoint)
            feed = _Feed(name, sub, rep)
            self._feeds[name] = feed
            self._by_sock[sub] = feed
            self._poller.register(sub, zmq.POLLIN)
        for feed in self._feeds.values():
            self._snapshot(feed)

    def expected(self, name: Any) -> int:
        """The next sequence number instance ``name``'s index needs."""
        return self._feeds[name].expected

    # ------------------------------------------------------------------ receiving

    def poll(self, timeout: float = 0.0) -> int:
        """Apply what has arrived (waiting up to ``timeout`` s for the first message);
        returns the number of live messages looked at."""
        n = 0
        wait_ms = int(timeout * 1000)
        while True:
            ready = dict(self._poller.poll(wait_ms))
            if not ready:
                return n
            wait_ms = 0
            for sock in ready:
                feed = self._by_sock[sock]
                while sock.poll(0):
                    frames = sock.recv_multipart()
                    n += 1
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self._malformed(feed, f"a live message of {len(frames)} frames "
                                              f"(seq frame {len(frames[1]) if len(frames) > 1 else 0} bytes)")
                        continue
                    _topic, sq, payload = frames
                    seq = seq_of(sq)
                    life = self._life(feed, payload)
                    if life == "retired":
                        continue  # a late batch of a life the index has left
                    restarted = life == "new" or seq <= feed.last_live
                    feed.last_live = seq
                    if restarted:
                        self.restarts += 1
                        self._snapshot(feed)
                    if self.drop is not None and self.drop(feed.name, seq):
                        self.dropped += 1
                        self._count(feed, "dropped")
                        continue
                    self._live(feed, seq, payload)

    def sync(self, targets: Mapping[Any, int], timeout: float | None = None) -> None:
        """Wait until each instance's index has applied every batch below ``targets[name]``
        (its publisher's ``next_seq``), healing missing tails by replay.  Bounded."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            for n, t in targets.items():
                if self._feeds[n].expected > t:  # ahead of its publisher: it restarted
                    self.restarts += 1
                    self._snapshot(self._feeds[n])
            behind = [self._feeds[n] for n, t in targets.items() if self._feeds[n].expected < t]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router behind for {[(f.name, f.expected) for f in behind]}")
            if self.poll(0.02) == 0:
                for f in behind:  # nothing more is coming live: the tail was lost
                    if f.expected < targets[f.name]:
                        self._replay(f)

    def _live(self, feed: _Feed, seq: int, payload: bytes) -> None:
        if feed.expected < 0 and feed.hold > 0:  # unsynchronised, backing off
            feed.hold -= 1
            self._count(feed, "skipped")
            return
        if seq < feed.expected:
            return
        if seq > feed.expected:
            self.gaps += 1
            self._replay(feed)
            if feed.expected < 0:  # a malformed snapshot: unsynchronised, backing off
                return
            if seq < feed.expected:
                return
            if seq > feed.expected:  # the replay buffer no longer reaches back
                if not self._snapshot(feed):
                    return
                if seq != feed.expected:
                    if seq > feed.expected:
                        self._replay(feed)
                    return
        self._apply(feed, seq, payload)

    @staticmethod
    def _life(feed: _Feed, payload: bytes) -> str:
        """Whether ``payload`` is of the life the index follows ("same", also when either
        side has no identity), of a new one ("new") or of one left behind ("retired")."""
        inst = instance_of(payload)
        if inst is None or feed.instance is None or inst == feed.instance:
            return "same"
        return "retired" if inst in feed.retired else "new"

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> bool:
        """Apply batch ``seq``; False when it was malformed (dropped, instance resynced)."""
        try:
            self.router.apply(feed.name, self._dec.decode(payload))
        except (msgspec.MsgspecError, InvalidBatchError) as e:
            self._malformed(feed, f"batch {seq}: {e}")
            return False
        feed.expected = seq + 1
        self.applied += 1
        self._count(feed, "applied")
        return True

    # ------------------------------------------------------------------ malformed input

    def _count(self, feed: _Feed, what: str) -> None:
        feed.counts[what] = feed.counts.get(what, 0) + 1

    def _note_malformed(self, feed: _Feed, why: str) -> None:
        self.malformed += 1
        self._count(feed, "malformed")
        self._why[feed.name] = why

    def _malformed(self, feed: _Feed, why: str) -> None:
        """Drop a malformed message or batch of ``feed`` (counted) and resynchronise that
        instance by a snapshot."""
        self._note_malformed(feed, why)
        if feed.expected < 0 and feed.hold > 0:  # unsynchronised, backing off
            feed.hold -= 1
            return
        self._snapshot(feed)

    def stats(self) -> dict[str, Any]:
        """Counters: fleet totals, and per instance ``applied`` (batches), ``dropped`` (by
        the ``drop`` hook), ``malformed`` (messages, batches or snapshots dropped whole),
        ``skipped`` (live messages skipped while unsynchronised), ``snapshots``, ``expected``
        (-1: unsynchronised) and ``last_malformed`` (why the last malformed one was dropped)."""
        per = {}
        for name, f in self._feeds.items():
            c = {k: f.counts.get(k, 0) for k in ("applied", "dropped", "malformed", "skipped", "snapshots")}
            per[name] = {**c, "expected": f.expected, "last_malformed": self._why.get(name)}
        return {"applied": self.applied, "dropped": self.dropped, "malformed": self.malformed,
                "gaps": self.gaps, "replays": self.replays, "snapshots": self.snapshots,
                "restarts": self.restarts, "instances": per}

    # ------------------------------------------------------------------ requests

    def _request(self, feed: _Feed, request: bytes) -> list[tuple[int, bytes]]:
        rep = feed.replay
        while rep.poll(0):  # a late answer to an earlier, timed-out request
            rep.recv_multipart()
        rep.send_multipart([b"", request])
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not rep.poll(int(left * 1000) + 1):
                raise TimeoutError(f"instance {feed.name!r}: no answer from the replay endpoint")
            frames = rep.recv_multipart()
            if len(frames) < 2 or len(frames[-2]) != 8:  # not a (seq, payload) reply: dropped
                self._note_malformed(feed, f"a replay reply of {len(frames)} frames")
                continue
            sq, payload = frames[-2], frames[-1]
            if sq == END_SEQ:
                return out
            out.append((seq_of(sq), payload))

    def _replay(self, feed: _Feed) -> None:
        if feed.expected < 0:
            self._snapshot(feed)
            return
        self.replays += 1
        for seq, payload in self._request(feed, seq_bytes(feed.expected)):
            life = self._life(feed, payload)
            if life == "retired":
                continue
            if life == "new":  # the endpoint now serves another life: it restarted
                self.restarts += 1
                self._snapshot(feed)
                return
            if seq == feed.expected:
                if not self._apply(feed, seq, payload):
                    return  # resynchronised by snapshot (or not): the rest is stale
            elif seq > feed.expected:  # the buffer starts after what we need
                self._snapshot(feed)
                return

    def _snapshot(self, feed: _Feed) -> bool:
        """Replace the instance's state by a snapshot.  A malformed answer is counted and
        leaves the instance empty and unsynchronised (``expected`` -1), holding off the next
        attempt for 2**k - 1 live messages after k failures in a row (at most 1023)."""
        self.snapshots += 1
        self._count(feed, "snapshots")
        answer = self._request(feed, SNAPSHOT_REQUEST)
        why = f"a snapshot answer of {len(answer)} batches"
        if len(answer) == 1:
            seq, payload = answer[0]
            try:
                batch = self._dec.decode(payload)
                self.router.reset(feed.name, batch)
            except (msgspec.MsgspecError, InvalidBatchError) as e:
                why = f"snapshot {seq}: {e}"
            else:
                feed.expected = seq
                feed.failures = feed.hold = 0
                if batch.kvcm_instance is not None and batch.kvcm_instance != feed.instance:
                    if feed.instance is not None:
                        feed.retired.add(feed.instance)
                    feed.retired.discard(batch.kvcm_instance)
                    feed.instance = batch.kvcm_instance
                return True
        self._note_malformed(feed, why)
        self.router.clear(feed.name)  # what it held is not known to be true any more
        feed.expected = -1
        feed.failures += 1
        feed.hold = 2 ** min(feed.failures, 10) - 1
        return False

    def close(self) -> None:
        """Close every instance's sockets (no linger)."""
        for feed in self._feeds.values():
            feed.sub.close(linger=0)
            feed.replay.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["FleetSubscriber"]
