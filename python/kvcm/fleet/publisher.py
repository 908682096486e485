"""Publish a manager's KV events on the wire (SPEC sec. 16): ZeroMQ PUB + replay/snapshot.

Needs the ``events`` extra (``pip install kvcm[events]``: pyzmq, msgspec).  One call per
engine step::

    pub = EventPublisher(mgr, "tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    ...
    pub.publish(mgr.take_events())      # after the step's manager calls; never blocks
    ...
    pub.close()

``publish`` only checks the event ids and puts the list on a bounded queue; translating
(``kvcm.fleet.wire_state``), encoding (``kvcm.fleet.wire``), sending and serving the replay socket
happen on one background thread, which owns both sockets (it closes them when it ends).
A full queue drops the step and counts it (``dropped``); the next ``publish`` then takes
``mgr.snapshot()`` and publishes a *reset* batch instead of its events: ``AllBlocksCleared``
followed by every reusable block as ``BlockStored`` (the state after all events so far).
The same happens when the manager's own event buffer overflowed (a gap in ``event_id``).

Sockets (frames as vLLM's ``ZmqEventPublisher``, v0.26 to v0.32 checked):

* PUB ``endpoint`` (an XPUB socket, which SUB subscribers cannot tell from PUB): one
  message per published batch, ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian
  counter from 0; steps without events publish nothing.  A batch whose payload exceeds
  ``max_batch_bytes`` is split into consecutive batches (its events in order; an event
  naming several blocks is split into a chain), so no message exceeds it unless one
  block's event alone does.
* ROUTER ``replay_endpoint``:
  - replay: a client (REQ, or DEALER sending an empty delimiter frame) sends a start
    sequence number (8 bytes big-endian) and receives ``(topic, seq, payload)`` for every
    batch with ``seq >= start`` that is buffered and was published when it asked, then the
    end marker ``(b"", seq -1, b"")``.  The buffer keeps the last ``buffer_steps`` batches,
    at most ``replay_buffer_bytes`` of payload (at least the newest batch).
  - snapshot (kvcm): a client sends ``b"kvcm:snapshot"`` and receives one
    ``(topic, S, payload)``, then the end marker.  The payload is a batch
    ``[AllBlocksCleared, BlockStored...]`` holding every currently reusable block per life
    cycle and medium, parents before children; it is the state after every batch with
    ``seq < S``, so the client applies it and continues with batch ``S`` (live, or by
    replay from ``S``).
  A DEALER that sends no delimiter gets answers without one.

Bounds (the live stream keeps flowing whatever the replay socket receives):

* Each turn of the thread handles up to ``_LIVE_PER_TURN`` queued steps, reads at most
  ``_REQUESTS_PER_TURN`` requests and sends at most ``_REPLAY_MSGS_PER_TURN`` replay
  messages (``_REPLAY_BYTES_PER_TURN`` bytes) and one freshly built snapshot (a snapshot
  asked again at the same ``S`` is served from the last one built).  Requests are queued
  per client and served round-robin; a client has at most ``_PER_CLIENT`` requests
  queued, at most ``max_replay_clients`` clients are queued at once; a request beyond
  either is not answered and counted (``requests_refused``).  A client whose pipe is full
  (it does not read) is skipped until it reads; one that went away is forgotten.
* A subscriber's PUB queue holds at most ``live_buffer_bytes``: its ZeroMQ high-water
  mark is ``live_buffer_bytes // max_batch_bytes`` messages (so also for the ROUTER's
  queue to one replay client).  A batch that a subscriber's full queue cannot take goes
  to the others; it is counted once in ``live_dropped`` (the subscriber sees the gap and
  heals by replay or snapshot).

Instance identity: every batch carries ``kvcm_instance`` (``kvcm.fleet.wire``), one value per
publisher life: ``instance`` if given, else 8 random bytes.  A subscriber that sees it
change resynchronises by snapshot: an engine restarted on the same endpoints starts a new
life with a new identity.  The random default is the one thing on the wire that is not a
function of the op sequence: tests and parity checks that compare payloads pass a fixed
``instance``.

``ts``: vLLM stamps wall-clock time; kvcm never lets wall-clock time into anything that is
compared, so ``ts`` is the step number (the count of ``publish`` calls before this one) unless
a ``clock`` is injected.  With the default, two backends driven through the same op sequence
(and the same ``instance``) publish byte-identical payloads.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import msgspec
import zmq

from kvcm.api import Event, KVCacheManager, ReuseScope
from kvcm.fleet.wire import REPLAY_END, SNAPSHOT_REQUEST, BlockRemoved, BlockStored, Encoder, Layout, seq_bytes, seq_of
from kvcm.fleet.wire_state import WireState

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"
_POLL_S = 0.002
MIB = 1 << 20
# Per turn of the publisher thread (see the module doc): the live queue first, then a
# bounded slice of replay work, so no request pattern can hold the live stream back.
_LIVE_PER_TURN = 64
_REQUESTS_PER_TURN = 64
_REPLAY_MSGS_PER_TURN = 64
_REPLAY_BYTES_PER_TURN = 4 * MIB
_PER_CLIENT = 2  # a REQ client has one request in flight; a DEALER may pipeline one more
_SUBSCRIPTIONS_PER_TURN = 64


@dataclass
class _Job:
    """One replay or snapshot request being answered."""

    head: list[bytes]  # the routing frames: client id (+ the empty delimiter it sent)
    snapshot: bool
    next: int = 0  # replay: the next sequence number to send
    end: int = 0  # replay: one past the last batch published when it asked
    snapshot_sent: bool = False  # snapshot: only the end marker is left


class EventPublisher:
    """Publishes ``take_events()`` of one manager, step by step (see the module doc)."""

    def __init__(
        self,
        manager: KVCacheManager,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = DEFAULT_ENDPOINT,
        *,
        topic: str = "kvcm",
        buffer_steps: int = 10_000,
        replay_buffer_bytes: int = 64 * MIB,
        max_queue: int = 1024,
        live_buffer_bytes: int = 64 * MIB,
        max_batch_bytes: int = 64 * 1024,
        max_replay_clients: int = 64,
        layout: Layout = "map",
        data_parallel_rank: int | None = 0,
        instance: bytes | None = None,
        clock: Callable[[], float] | None = None,
        scopes: Iterable[ReuseScope] = (),
        context: zmq.Context | None = None,
        media: Sequence[str] | None = None,
    ) -> None:
        if buffer_steps < 1 or max_queue < 1 or max_replay_clients < 1:
            raise ValueError("buffer_steps, max_queue and max_replay_clients must be >= 1")
        if max_batch_bytes < 1024:
            raise ValueError(f"max_batch_bytes must be >= 1024, got {max_batch_bytes}")
        if live_buffer_bytes < max_batch_bytes or replay_buffer_bytes < max_batch_bytes:
            raise ValueError("live_buffer_bytes and replay_buffer_bytes must be >= max_batch_bytes")
        if instance is None:
            # a fresh identity per life: a restarted engine with the same configuration
            # must not look like the one before it (see the module doc)
            instance = os.urandom(8)
        if not isinstance(instance, bytes) or not 1 <= len(instance) <= 64:
            raise ValueError("instance must be 1 to 64 bytes")
        self._mgr = manager
        self._clock = clock
        self.instance = instance
        self._encoder = Encoder(layout, data_parallel_rank, instance)
        self._state = WireState(manager.life_cycles, manager.config.tokens_per_block, scopes,
                                **({} if media is None else {"media": media}))
        snap = manager.snapshot()
        self._state.load_snapshot(snap)
        self._next_event = int(snap["next"]["event"])  # events before it are in the snapshot
        self._step = 0
        self._lost = False
        self._queue: queue.Queue[tuple[str, float, Any] | None] = queue.Queue(maxsize=max_queue)
        # the replay buffer: seq -> payload, contiguous from _buf_first
        self._buf: dict[int, bytes] = {}
        self._buf_first = 0
        self._buf_bytes = 0
        self._buffer_steps = buffer_steps
        self._replay_buffer_bytes = replay_buffer_bytes
        self._max_batch = max_batch_bytes
        self._max_clients = max_replay_clients
        self._jobs: OrderedDict[bytes, deque[_Job]] = OrderedDict()  # per client, in round-robin order
        self._snap_cache: tuple[int, bytes] | None = None  # (S, payload) of the last snapshot built
        self._seq = 0
        self._last_ts = 0.0
        self._topic = topic.encode()
        self.dropped = 0  # steps dropped because the queue was full
        self.resets = 0  # reset batches published (after a drop or an event-id gap)
        self.published = 0  # batches sent
        self.published_bytes = 0  # their payload bytes
        self.live_dropped = 0  # batches some subscriber's full queue (live_buffer_bytes) missed
        self.split = 0  # steps sent as several batches (max_batch_bytes)
        self.replays_served = 0
        self.snapshots_served = 0
        self.requests_refused = 0  # replay/snapshot requests over the per-client or client cap
        self.bad_requests = 0  # messages on the replay socket that are no request
        self.thread_s = 0.0  # time the publisher thread spent on batches (reporting only)
        self.hwm = max(1, live_buffer_bytes // max_batch_bytes)  # messages per subscriber queue
        self._ctx = context or zmq.Context.instance()
        # XPUB (not PUB): with XPUB_NODROP a send that a full subscriber queue cannot take
        # fails instead of vanishing, which is how live_dropped is counted
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, self.hwm)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(endpoint)
            self.endpoint: str = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, self.hwm)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full client pipe: EAGAIN, not a silent loss
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            self._close_sockets()
            raise
        self._stop = threading.Event()
        self._closing = False
        self._error: BaseException | None = None
        # the thread owns the sockets from here on (created here so that bind errors reach
        # the caller; Thread.start() is the memory barrier ZeroMQ asks for a migration)
        self._thread = threading.Thread(target=self._run, name="kvcm-event-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ scheduler side

    def register_scope(self, scope: ReuseScope) -> None:
        """Name ``scope``'s first blocks without a parent hash, with its lora_id / salt.
        Ordered with the steps (it goes through the queue, so it may wait while the queue
        is full; call it when a scope comes into use, not per step)."""
        self._queue.put(("scope", 0.0, scope))

    def publish(self, events: Sequence[Event]) -> bool:
        """Queue one step's ``take_events()``.  Never blocks; False when the step was
        dropped (queue full: counted in ``dropped``, healed by a reset batch later)."""
        if self._closing:
            raise RuntimeError("publisher is closed")
        ts = self._clock() if self._clock is not None else float(self._step)
        self._step += 1
        if events and events[0].event_id < self._next_event:  # already in the loaded snapshot
            events = [e for e in events if e.event_id >= self._next_event]
        if events and events[0].event_id != self._next_event:
            self._lost = True  # the manager's event buffer overflowed
        if self._lost:
            if self._queue.full():
                self.dropped += 1
                return False
            snap = self._mgr.snapshot()  # the state after every event taken so far
            self._next_event = int(snap["next"]["event"])
            self._lost = False
            self._queue.put_nowait(("reset", ts, snap))
            return True
        if not events:
            return True
        self._next_event = events[-1].event_id + 1
        try:
            self._queue.put_nowait(("events", ts, events))
        except queue.Full:
            self.dropped += 1
            self._lost = True
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued step has been sent (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError("publisher thread failed") from self._error
            if not self._thread.is_alive():
                break
            time.sleep(0.0005)
        return not self._queue.unfinished_tasks

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry (read after ``flush``)."""
        return self._seq

    def stats(self) -> dict[str, int]:
        """The publisher's counters (see the attributes of the same names)."""
        return {
            "published": self.published, "published_bytes": self.published_bytes, "dropped": self.dropped, "resets": self.resets,
            "live_dropped": self.live_dropped, "split": self.split,
            "replays_served": self.replays_served, "snapshots_served": self.snapshots_served,
            "requests_refused": self.requests_refused, "bad_requests": self.bad_requests,
            "replay_buffered": len(self._buf), "replay_buffered_bytes": self._buf_bytes,
        }

    def close(self, timeout: float = 2.0) -> bool:
        """Send what is queued (up to ``timeout``), then stop the thread and wait for it (up
        to ``timeout`` more).  The thread closes the sockets itself when it ends, so they are
        never closed under it; True when it has ended (False: it is still finishing a batch
        and will close them right after)."""
        if self._closing:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        self._closing = True
        try:
            self.flush(timeout)
        finally:
            self._stop.set()
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ publisher thread

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        try:
            busy = False
            while not self._stop.is_set():
                self._live(0.0 if busy else _POLL_S)
                self._drain_subscriptions()
                busy = self._replay is not None and (self._take_requests() | self._serve_jobs())
        except BaseException as e:  # noqa: BLE001 - surfaced by flush()
            self._error = e
        finally:
            self._close_sockets()

    def _live(self, wait_s: float) -> None:
        """Handle up to ``_LIVE_PER_TURN`` queued items (waiting ``wait_s`` for the first)."""
        for i in range(_LIVE_PER_TURN):
            try:
                item = self._queue.get(timeout=wait_s) if i == 0 and wait_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            try:
                self._handle(item)
            finally:
                self.thread_s += time.perf_counter() - t0
                self._queue.task_done()

    def _drain_subscriptions(self) -> None:
        # XPUB passes (un)subscriptions up; read them so that they do not pile up
        for _ in range(_SUBSCRIPTIONS_PER_TURN):
            try:
                self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _handle(self, item: tuple[str, float, Any] | None) -> None:
        if item is None:
            return
        kind, ts, data = item
        self._snap_cache = None  # the mirror may change
        if kind == "scope":
            self._state.register_scope(data)
        elif kind == "events":
            wire = self._state.translate(data)
            if wire:
                self._send(ts, wire)
        else:  # reset
            self._state.load_snapshot(data)
            self.resets += 1
            self._send(ts, self._state.restatement())

    def _send(self, ts: float, wire: list) -> None:
        payload = self._encoder.encode(ts, wire)
        if len(payload) <= self._max_batch:
            self._send_payload(ts, payload)
            return
        # cut into consecutive batches of at most max_batch_bytes, each event encoded once
        self.split += 1
        room = self._max_batch - 64  # the batch's own items (ts, rank, instance, headers)
        parts: list[list[msgspec.Raw]] = [[]]
        used = 0
        for e in wire:
            for raw in self._fit(e, room):
                if parts[-1] and used + len(raw) > room:
                    parts.append([])
                    used = 0
                parts[-1].append(raw)
                used += len(raw)
        for part in parts:
            self._send_payload(ts, self._encoder.encode_raw(ts, part))

    def _fit(self, e: Any, room: int) -> list[msgspec.Raw]:
        """``e`` encoded, or ``e`` cut into events naming fewer blocks, each at most ``room``
        bytes where one block's event allows it (vLLM subscribers apply them in order: the
        same blocks, the same parents)."""
        raw = self._encoder.raw(e)
        k = len(getattr(e, "block_hashes", ()))
        if k < 2 or len(raw) <= room:
            return [raw]
        m = k // 2
        if isinstance(e, BlockRemoved):
            a = msgspec.structs.replace(e, block_hashes=e.block_hashes[:m])
            b = msgspec.structs.replace(e, block_hashes=e.block_hashes[m:])
        else:
            assert isinstance(e, BlockStored)
            per = len(e.token_ids) // k  # every block of a multi-block event is full
            extra = e.extra_keys
            a = msgspec.structs.replace(e, block_hashes=e.block_hashes[:m], token_ids=e.token_ids[:m * per],
                                        extra_keys=None if extra is None else extra[:m])
            b = msgspec.structs.replace(e, block_hashes=e.block_hashes[m:], token_ids=e.token_ids[m * per:],
                                        parent_block_hash=e.block_hashes[m - 1],
                                        extra_keys=None if extra is None else extra[m:])
        return self._fit(a, room) + self._fit(b, room)

    def _send_payload(self, ts: float, payload: bytes) -> None:
        seq = self._seq
        frames = (self._topic, seq_bytes(seq), payload)
        try:
            self._pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            # a subscriber's queue is full (it does not read): the others still get the
            # batch; that one misses it and heals by replay / snapshot
            self._pub.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                self._pub.send_multipart(frames)
            finally:
                self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self.live_dropped += 1
        self._buf[seq] = payload
        self._buf_bytes += len(payload)
        while len(self._buf) > 1 and (len(self._buf) > self._buffer_steps
                                      or self._buf_bytes > self._replay_buffer_bytes):
            self._buf_bytes -= len(self._buf.pop(self._buf_first))
            self._buf_first += 1
        self._seq = seq + 1
        self._last_ts = ts
        self.published += 1
        self.published_bytes += len(payload)

    # ------------------------------------------------------------------ replay socket

    def _take_requests(self) -> bool:
        """Read up to ``_REQUESTS_PER_TURN`` requests into the per-client queues; True when
        the cap was reached (more may be waiting)."""
        assert self._replay is not None
        for _ in range(_REQUESTS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if len(frames) == 3 and frames[1] == b"":
                head, request = [frames[0], b""], frames[2]
            elif len(frames) == 2:
                head, request = [frames[0]], frames[1]
            else:
                self.bad_requests += 1
                continue
            if request == SNAPSHOT_REQUEST:
                job = _Job(head, snapshot=True)
            elif len(request) == 8:
                # vLLM reads the start unsigned; a negative one asks for everything
                job = _Job(head, snapshot=False, next=max(0, seq_of(request)), end=self._seq)
            else:
                self.bad_requests += 1
                continue
            jobs = self._jobs.get(frames[0])
            if (len(jobs) >= _PER_CLIENT) if jobs is not None else (len(self._jobs) >= self._max_clients):
                self.requests_refused += 1  # unanswered: the client's own timeout tells it
                continue
            if jobs is None:
                jobs = self._jobs[frames[0]] = deque()
            jobs.append(job)
        return True

    def _serve_jobs(self) -> bool:
        """Send one turn's share of the queued answers, clients in round-robin order;
        True when work is left that could proceed now."""
        assert self._replay is not None
        msgs, nbytes, fresh_snapshot = 0, 0, False
        for client in list(self._jobs):
            if msgs >= _REPLAY_MSGS_PER_TURN or nbytes >= _REPLAY_BYTES_PER_TURN:
                break
            jobs = self._jobs[client]
            self._jobs.move_to_end(client)
            while jobs and msgs < _REPLAY_MSGS_PER_TURN and nbytes < _REPLAY_BYTES_PER_TURN:
                job = jobs[0]
                done = False
                if job.snapshot and not job.snapshot_sent:
                    cached = self._snap_cache is not None and self._snap_cache[0] == self._seq
                    if not cached and fresh_snapshot:
                        break  # one snapshot built per turn
                    payload = self._snapshot_payload()
                    fresh_snapshot |= not cached
                    frames = [*job.head, self._topic, seq_bytes(self._seq), payload]
                elif job.snapshot:
                    frames, done = [*job.head, *REPLAY_END], True
                else:
                    job.next = max(job.next, self._buf_first)  # older batches left the buffer
                    if job.next >= job.end:
                        frames, done = [*job.head, *REPLAY_END], True
                    else:
                        frames = [*job.head, self._topic, seq_bytes(job.next), self._buf[job.next]]
                # counted before the end marker goes out, so a client that has it reads
                # the count (taken back if it does not go out)
                served = ("snapshots_served" if job.snapshot else "replays_served") if done else None
                if served is not None:
                    setattr(self, served, getattr(self, served) + 1)
                try:
                    self._replay.send_multipart(frames, zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    if served is not None:
                        setattr(self, served, getattr(self, served) - 1)
                    if e.errno == errno.EAGAIN:
                        break  # the client's pipe is full: it is not reading; skip it this turn
                    if e.errno != errno.EHOSTUNREACH:
                        raise
                    jobs.clear()  # the client went away
                    break
                msgs += 1
                nbytes += len(frames[-1])
                if done:
                    jobs.popleft()
                elif job.snapshot:
                    job.snapshot_sent = True
                else:
                    job.next += 1
            if not jobs:
                del self._jobs[client]
        return msgs >= _REPLAY_MSGS_PER_TURN or nbytes >= _REPLAY_BYTES_PER_TURN or fresh_snapshot

    def _snapshot_payload(self) -> bytes:
        if self._snap_cache is None or self._snap_cache[0] != self._seq:
            self._snap_cache = (self._seq, self._encoder.encode(self._last_ts, self._state.restatement()))
        return self._snap_cache[1]


__all__ = ["DEFAULT_ENDPOINT", "EventPublisher"]
