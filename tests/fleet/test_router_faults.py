"""Issue 18 items 3-4: the router side of the wire under bad input.

* A malformed message of one instance (not ``(topic, seq, payload)``, a payload that is not
  a msgpack ``KVEventBatch``, a batch that does not fit the router's model) is dropped whole,
  counted for that instance and healed by a snapshot of that instance; ``poll`` / ``sync``
  go on for the fleet (real publishers on 127.0.0.1 sockets, ephemeral ports).
* A batch that fails validation changes nothing in the index (no half-applied batch).
* Int block hashes (vLLM's ``ExternalBlockHash`` is ``bytes | int``) are keyed as ints, never
  converted by value.

Runs on the env-selected backend (each CI leg: python, cpp)."""

from __future__ import annotations

import dataclasses
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import kvcm
import msgspec
import pytest
import zmq
from kvcm.fleet.publisher import EventPublisher
from kvcm.fleet.router_index import InvalidBatchError, RouterIndex, RouterModel
from kvcm.fleet.subscriber import FleetSubscriber
from kvcm.fleet.wire import BlockRemoved, BlockStored, Decoder, Encoder
from test_router_exact import BASES, B, Op, config, prompt_of, step

CFG = config("hybrid", gpu_pages=40, host_pages=8)  # partial reuse off: the router answers probe_reuse
MODEL = RouterModel.from_config(CFG)
JOIN_STEPS = 200


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def stored(hashes: list[Any], parent: Any = None, block_size: int = B, group: int | None = None,
           coverage: int | None = None) -> Any:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[0] * (B * len(hashes)),
                       block_size=block_size, lora_id=None, medium="GPU", lora_name=None, group_idx=group,
                       kvcm_coverage=coverage)


def batch(*events: Any) -> Any:
    return Decoder().decode(Encoder().encode(0.0, list(events)))


# ---------------------------------------------------------------------- item 4: int hashes


@pytest.mark.parametrize("h", [10**7, -1, 2**64 - 1, -(2**63)], ids=["1e7", "negative", "u64max", "i64min"])
def test_int_block_hash_is_keyed_as_an_int_not_allocated_by_value(h: int) -> None:
    """``bytes(h)`` allocated h zero bytes (10 MB for 10**7), raised for a negative hash and
    overflowed for a real 64-bit one.  Through the wire encoding (msgpack ints up to 64 bits),
    then stored, chained, answered and removed by the int itself."""
    idx = RouterIndex(MODEL)
    child = h - 1 if h > 0 else h + 1
    tracemalloc.start()
    try:
        idx.apply("v", batch(*(e for g in range(3) for e in (stored([h], group=g), stored([child], parent=h, group=g)))))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    blocks = idx.instance("v").blocks
    assert set(blocks) == {h, child} and all(type(k) is int for k in blocks)
    assert all(sys.getsizeof(k) < 64 for k in blocks)
    assert peak < 1 << 20  # nothing of the hash's magnitude was allocated
    assert blocks[child].parent == h
    assert idx.instance("v").reuse_keys([h, child]) == 2 * B  # all three groups hold both blocks
    assert idx.instance("v").reuse_keys([(h % 2**64).to_bytes(8, "big")]) == 0  # never a bytes key
    idx.apply("v", batch(*(BlockRemoved(block_hashes=[child, h], medium="GPU", group_idx=g) for g in range(3))))
    assert blocks == {}


def test_block_hash_of_another_type_is_rejected_with_a_clear_error() -> None:
    idx = RouterIndex(MODEL)
    for bad in (True, 1.5, "ab", bytearray(b"ab")):
        with pytest.raises(InvalidBatchError, match="bytes or int"):
            idx.apply("v", msgspec.structs.replace(batch(stored([b"k"])), events=[stored([bad])]))
    assert idx.instance("v").blocks == {}


# ---------------------------------------------------------------------- no half-applied batch


@pytest.mark.parametrize("bad", ["block_size", "group", "negative_group", "coverage", "spec"])
def test_invalid_batch_is_not_applied_half_way(bad: str) -> None:
    """The last event of a batch does not fit: the index is left as it was (it used to keep
    the events before it), for ``apply`` and for a snapshot ``reset``."""
    idx = RouterIndex(MODEL)
    idx.apply("v", batch(stored([b"a" * 32])))
    before = {k: (e.parent, dict(e.pages)) for k, e in idx.instance("v").blocks.items()}
    wrong = {
        "block_size": stored([b"z" * 32], block_size=2 * B),
        "group": stored([b"z" * 32], group=3),
        "negative_group": stored([b"z" * 32], group=-1),
        "coverage": stored([b"y" * 32, b"z" * 32], coverage=1),  # a partial coverage names one block
        "spec": msgspec.structs.replace(stored([b"z" * 32], group=2), kv_cache_spec_kind="full_attention"),
    }[bad]
    good = stored([b"b" * 32, b"c" * 32], parent=b"a" * 32)
    for call in (idx.apply, idx.reset):
        with pytest.raises(InvalidBatchError):
            call("v", batch(good, BlockRemoved(block_hashes=[b"a" * 32], medium="GPU"), wrong))
        assert {k: (e.parent, dict(e.pages)) for k, e in idx.instance("v").blocks.items()} == before


# ---------------------------------------------------------------------- item 3: malformed messages


def on_publisher_thread(pub: EventPublisher, fn: Callable[[EventPublisher], None]) -> None:
    """Run ``fn(pub)`` on the publisher's thread, in order with the steps (its sockets are
    not thread-safe), and wait for it."""
    handle = pub._handle

    def once(item: Any) -> None:
        pub._handle = handle  # type: ignore[method-assign]
        fn(pub)

    pub._handle = once  # type: ignore[method-assign]
    pub._queue.put(("inject", 0.0, None))
    assert pub.flush()


def corrupt_next_batch(pub: EventPublisher, payload: Callable[[Any], bytes] | None = None,
                       events: Callable[[list], list] | None = None) -> None:
    """The publisher's next batch goes out (and into its replay buffer) with its payload or
    its wire events replaced; its mirror keeps the true state, so a snapshot is right."""
    def install(p: EventPublisher) -> None:
        enc, state = p._encoder.encode, p._state.translate

        def encode(ts: float, wire: list) -> bytes:
            p._encoder.encode = enc  # type: ignore[method-assign]
            return payload(enc(ts, wire)) if payload is not None else enc(ts, wire)

        def translate(evs: Any) -> list:
            p._state.translate = state  # type: ignore[method-assign]
            wire = state(evs)
            return events(wire) if events is not None else wire

        p._encoder.encode = encode  # type: ignore[method-assign]
        p._state.translate = translate  # type: ignore[method-assign]

    on_publisher_thread(pub, install)


class Pair:
    """Two instances, each a manager behind a real publisher, and one subscriber."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.mgrs = {n: kvcm.KVCacheManager(CFG) for n in "ab"}
        self.pubs = {n: EventPublisher(m, context=ctx) for n, m in self.mgrs.items()}
        self.router = RouterIndex(MODEL)
        self.sub = FleetSubscriber(self.router, {n: (p.endpoint, p.replay_endpoint) for n, p in self.pubs.items()},
                                   context=ctx, timeout=5.0)
        self.prompts: list[list[int]] = []
        self.n = 0
        for n in "ab":
            self.join(n)

    def request(self, name: str) -> None:
        op = Op(0, self.n % 3, 8 + (5 * self.n) % 32, self.n % 4, 4, False, False, False, True, False)
        self.n += 1
        step(self.mgrs[name], op, [])
        self.prompts.append(prompt_of(op))
        self.pubs[name].publish(self.mgrs[name].take_events())
        assert self.pubs[name].flush()

    def join(self, name: str) -> None:
        """PUB/SUB joins asynchronously: publish steps until one arrives live."""
        for _ in range(JOIN_STEPS):
            before = self.sub.applied  # only ``name`` publishes meanwhile
            self.request(name)
            self.sub.poll(0.02)
            if self.sub.applied > before:
                return
        raise AssertionError(f"the subscription to {name} never joined")

    def catch_up(self) -> None:
        self.sub.sync({n: p.next_seq for n, p in self.pubs.items()})

    def check(self) -> None:
        for n, m in self.mgrs.items():
            for p in [*self.prompts, *(b[:40] for b in BASES)]:
                assert self.router.reuse(n, p) == m.probe_reuse(p), (n, p)

    def close(self) -> None:
        self.sub.close()
        for p in self.pubs.values():
            p.close()


def _send_raw(frames: list[bytes]) -> Callable[[EventPublisher], None]:
    return lambda p: p._pub.send_multipart(frames)


MALFORMED: dict[str, Callable[[EventPublisher], None]] = {
    "two_frames": lambda pub: on_publisher_thread(pub, _send_raw([b"kvcm", b"\x93\x00\x90\x00"])),
    "four_frames": lambda pub: on_publisher_thread(pub, _send_raw([b"kvcm", b"\0" * 8, b"x", b"y"])),
    "short_seq_frame": lambda pub: on_publisher_thread(pub, _send_raw([b"kvcm", b"\0", b"\x93\x00\x90\x00"])),
    "not_msgpack": lambda pub: corrupt_next_batch(pub, payload=lambda _: b"\xc1 not msgpack"),
    "not_a_batch": lambda pub: corrupt_next_batch(pub, payload=lambda _: msgspec.msgpack.encode({"a": 1})),
    "other_block_size": lambda pub: corrupt_next_batch(
        pub, events=lambda wire: [*wire, stored([b"q" * 32], block_size=2 * B)]),
    "unknown_group": lambda pub: corrupt_next_batch(pub, events=lambda wire: [*wire, stored([b"q" * 32], group=7)]),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_message_of_one_instance_does_not_kill_poll_for_the_fleet(ctx: zmq.Context, kind: str) -> None:
    """Instance a sends one malformed message between good ones; b keeps publishing.  poll and
    sync do not raise; a's message is dropped, counted in ``stats()`` and a is resynced by a
    snapshot (a corrupted *batch* is in a's replay buffer too, so a replay could not heal it);
    b is untouched; the router answers both instances' ``probe_reuse`` afterwards."""
    pair = Pair(ctx)
    try:
        pair.catch_up()
        before, b_seq = pair.sub.stats(), pair.pubs["b"].next_seq
        for _ in range(2):
            pair.request("a")
            pair.request("b")
        pair.sub.poll(0.02)
        MALFORMED[kind](pair.pubs["a"])
        pair.request("a")  # a's next step: for a corrupted batch, this is it
        for _ in range(3):
            pair.request("b")
            pair.request("a")
            pair.sub.poll(0.02)  # used to raise out of poll for every instance
        pair.catch_up()
        after = pair.sub.stats()
        a, b = after["instances"]["a"], after["instances"]["b"]
        assert a["malformed"] >= 1 and a["last_malformed"]
        assert a["snapshots"] > before["instances"]["a"]["snapshots"]
        assert b["malformed"] == 0 and b["snapshots"] == before["instances"]["b"]["snapshots"]
        assert b["applied"] - before["instances"]["b"]["applied"] == pair.pubs["b"].next_seq - b_seq >= 3
        assert b["expected"] == pair.pubs["b"].next_seq
        assert after["malformed"] == a["malformed"]
        pair.check()
        assert any(pair.router.reuse("a", p) > 0 for p in pair.prompts)
    finally:
        pair.close()


def test_publisher_of_another_model_is_left_unsynchronised_and_backs_off(ctx: zmq.Context) -> None:
    """Instance x runs another block size than the router's model: its snapshot does not fit
    either.  The subscriber starts anyway (it used to raise), x answers 0 and is counted,
    its later messages are skipped with snapshots retried after 1, 3, 7, ... of them (not one
    per message), and instance a is exact throughout."""
    other = dataclasses.replace(CFG, tokens_per_block=2 * B)
    mx, ma = kvcm.KVCacheManager(other), kvcm.KVCacheManager(CFG)
    px, pa = EventPublisher(mx, context=ctx), EventPublisher(ma, context=ctx)
    try:
        prompt = BASES[0][:32]
        for m, p in ((mx, px), (ma, pa)):
            kv = m.create_kv_cache(prompt)
            assert kv.resume() and kv.resize(len(prompt) + 1)
            kv.commit(prompt)
            kv.close()
            p.publish(m.take_events())
            assert p.flush()
        router = RouterIndex(MODEL)
        with FleetSubscriber(router, {"x": (px.endpoint, px.replay_endpoint), "a": (pa.endpoint, pa.replay_endpoint)},
                             context=ctx) as sub:
            st = sub.stats()["instances"]
            assert st["x"]["malformed"] == 1 and st["x"]["expected"] == -1 and "block size" in st["x"]["last_malformed"]
            assert router.reuse("x", prompt) == 0 and router.reuse("a", prompt) == ma.probe_reuse(prompt) == 32
            live = 0
            for i in range(60):
                q = [1000 + i] * (2 * B)
                kv = mx.create_kv_cache(q)
                assert kv.resume() and kv.resize(len(q) + 1)
                kv.commit(q)
                kv.close()
                px.publish(mx.take_events())
                assert px.flush()
                live += sub.poll(0.02)
            st = sub.stats()["instances"]["x"]
            assert live > 20  # precondition: the messages did arrive
            assert st["skipped"] >= live - 8 and st["snapshots"] <= 8  # 1 + log2(live) attempts, not `live`
            assert st["expected"] == -1 and router.reuse("x", q) == 0
            sub.sync({"a": pa.next_seq})
            assert router.reuse("a", prompt) == 32
    finally:
        px.close()
        pa.close()
