"""Publish a manager's KV events on the wire (SPEC sec. 16): ZeroMQ PUB + replay/snapshot.

Needs the ``events`` extra (``pip install kvcm[events]``: pyzmq, msgspec).  One call per
engine step::

    pub = EventPublisher(mgr, "tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    ...
    pub.publish(mgr.take_events())      # after the step's manager calls; never blocks
    ...
    pub.close()

``publish`` only checks the event ids and puts the list on a bounded queue; translating
(``kvcm.wire_state``), encoding (``kvcm.wire``) and sending happen on a background thread.
A full queue drops the step and counts it (``dropped``); the next ``publish`` then takes
``mgr.snapshot()`` and publishes a *reset* batch instead of its events: ``AllBlocksCleared``
followed by every reusable block as ``BlockStored`` (the state after all events so far).
The same happens when the manager's own event buffer overflowed (a gap in ``event_id``).

Sockets (frames as vLLM's ``ZmqEventPublisher``):

* PUB ``endpoint``: one message per published batch, ``(topic, seq, payload)``, ``seq`` an
  8-byte big-endian counter from 0; steps without events publish nothing.
* ROUTER ``replay_endpoint``:
  - replay: a client (REQ, or DEALER sending an empty delimiter frame) sends a start
    sequence number (8 bytes big-endian) and receives ``(seq, payload)`` for every buffered
    batch with ``seq >= start`` (the buffer keeps the last ``buffer_steps`` batches), then
    the end marker ``(seq -1, b"")``.
  - snapshot (kvcm): a client sends ``b"kvcm:snapshot"`` and receives one ``(S, payload)``,
    then the end marker.  The payload is a batch ``[AllBlocksCleared, BlockStored...]``
    holding every currently reusable block per life cycle and medium, parents before
    children; it is the state after every batch with ``seq < S``, so the client applies it
    and continues with batch ``S`` (live, or by replay from ``S``).

``ts``: vLLM stamps wall-clock time; kvcm never lets wall-clock time into anything that is
compared, so ``ts`` is the step number (the count of ``publish`` calls before this one) unless
a ``clock`` is injected.  With the default, two backends driven through the same op sequence
publish byte-identical payloads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

import zmq

from kvcm.api import Event, KVCacheManager, ReuseScope
from kvcm.wire import END_SEQ, SNAPSHOT_REQUEST, Encoder, Layout, seq_bytes, seq_of
from kvcm.wire_state import WireState

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"
_POLL_S = 0.002


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
        max_queue: int = 1024,
        hwm: int = 100_000,
        layout: Layout = "map",
        data_parallel_rank: int | None = 0,
        clock: Callable[[], float] | None = None,
        scopes: Iterable[ReuseScope] = (),
        context: zmq.Context | None = None,
        media: Sequence[str] | None = None,
    ) -> None:
        if buffer_steps < 1 or max_queue < 1:
            raise ValueError("buffer_steps and max_queue must be >= 1")
        self._mgr = manager
        self._clock = clock
        self._encoder = Encoder(layout, data_parallel_rank)
        self._state = WireState(manager.life_cycles, manager.config.tokens_per_block, scopes,
                                **({} if media is None else {"media": media}))
        snap = manager.snapshot()
        self._state.load_snapshot(snap)
        self._next_event = int(snap["next"]["event"])  # events before it are in the snapshot
        self._step = 0
        self._lost = False
        self._queue: queue.Queue[tuple[str, float, Any] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._last_ts = 0.0
        self._topic = topic.encode()
        self.dropped = 0  # steps dropped because the queue was full
        self.resets = 0  # reset batches published (after a drop or an event-id gap)
        self.published = 0  # batches sent
        self.replays_served = 0
        self.snapshots_served = 0
        self.thread_s = 0.0  # time the publisher thread spent on batches (reporting only)
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._stop = threading.Event()
        self._error: BaseException | None = None
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
        if self._stop.is_set():
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
            time.sleep(0.0005)
        return not self._queue.unfinished_tasks

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry (read after ``flush``)."""
        return self._seq

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), stop the thread, close the sockets."""
        if self._stop.is_set():
            return
        try:
            self.flush(timeout)
        finally:
            self._stop.set()
            self._thread.join(timeout)
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve(self._replay.recv_multipart())
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                t0 = time.perf_counter()
                try:
                    self._handle(item)
                finally:
                    self.thread_s += time.perf_counter() - t0
                    self._queue.task_done()
        except BaseException as e:  # noqa: BLE001 - surfaced by flush()
            self._error = e

    def _handle(self, item: tuple[str, float, Any] | None) -> None:
        if item is None:
            return
        kind, ts, data = item
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
        seq = self._seq
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        self._buffer.append((seq, payload))
        self._seq = seq + 1
        self._last_ts = ts
        self.published += 1

    def _serve(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) == 3 and frames[1] == b"":
            head, request = [frames[0], b""], frames[2]
        elif len(frames) == 2:
            head, request = [frames[0]], frames[1]
        else:
            return  # not a request we know
        if request == SNAPSHOT_REQUEST:
            payload = self._encoder.encode(self._last_ts, self._state.restatement())
            self._replay.send_multipart([*head, seq_bytes(self._seq), payload])
            self.snapshots_served += 1
        elif len(request) == 8:
            start = seq_of(request)
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([*head, seq_bytes(seq), payload])
            self.replays_served += 1
        else:
            return
        self._replay.send_multipart([*head, END_SEQ, b""])


__all__ = ["DEFAULT_ENDPOINT", "EventPublisher"]
