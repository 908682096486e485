"""vLLM's KV-event wire format (SPEC sec. 16): the msgspec structs, and their encoding.

Layout followed: ``vllm/distributed/kv_events.py`` as of vLLM v0.26-v0.28 (after vLLM PR
#42892, "[KV Events] Switch event structs from array to map encoding", and #40984, which
added the cache-spec fields):

* ``EventBatch(ts, events, data_parallel_rank=None)`` — ``array_like=True``: the batch is a
  positional msgpack array ``[ts, [event, ...], data_parallel_rank]``;
* events are ``tag=True`` structs, **map-encoded** (``{"type": "BlockStored", ...}``),
  ``omit_defaults=True``, so a field left at its default is not on the wire:

  - ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
    kv_cache_spec_sliding_window=None)``
  - ``BlockRemoved(block_hashes, medium, group_idx=None)``
  - ``AllBlocksCleared()``

``layout="array"`` selects the layout before PR #42892 (vLLM <= v0.2x): the same fields,
each event a tagged positional array ``["BlockStored", hashes, parent, ...]``.  Fields vLLM
added later (``locality``, ``ownership``, ``session_id``, ``event_version``) default to None
and are never set by kvcm, so with ``omit_defaults`` they would not be on the wire either.

kvcm extensions (optional, default None, so a vLLM subscriber ignores them: msgspec skips
unknown map keys, and extra trailing array items in the array layout):

* ``BlockStored.kvcm_sink_tokens`` — sink tokens of a sliding-window life cycle; the
  router needs it for the stale-block rule of SPEC sec. 7 (vLLM has no sink tokens).
* ``BlockStored.kvcm_coverage`` — the tokens of the block its page covers, set only when
  fewer than ``block_size`` (a page adopted from a shorter partial block, SPEC sec. 5
  attach; an ssm snapshot then ends at ``block start + coverage``); such an event names
  exactly one block.  Absent: every named block is covered whole.  The router's SPEC
  sec. 6 fixed point needs it to be exact with partial reuse on.
* ``EventBatch.kvcm_instance`` — the identity of the publisher's life (bytes, a fourth
  batch item after ``data_parallel_rank``; vLLM's array-like ``EventBatch`` ignores extra
  trailing items).  A subscriber that sees it change knows the instance restarted and
  resynchronises (``kvcm.fleet.subscriber``).  Batches encoded without one (``Encoder``'s
  ``instance=None``, e.g. the in-process link) keep vLLM's three items exactly.

Block hashes are kvcm's 32-byte keys as ``bytes`` (vLLM's ``ExternalBlockHash`` is
``bytes | int``).  Framing (vLLM's ``ZmqEventPublisher``, verified in v0.26.0 and v0.32.0):
PUB frames ``(topic, seq as 8-byte big-endian, payload)``; replay replies ``(topic, seq,
payload)`` per batch, then the end marker ``(b"", END_SEQ, b"")`` (``REPLAY_END``).
"""

# No "from __future__ import annotations": msgspec resolves string annotations in module
# globals, which would make both layouts share the map structs.
from typing import Any, Literal

import msgspec

Layout = Literal["map", "array"]
LAYOUTS: tuple[str, ...] = ("map", "array")

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
# kvcm's shared tier (a store shared by many instances; DECISIONS.md "The shared tier"):
# vLLM names no medium for it, so kvcm extends the field with its own value
MEDIUM_SHARED = "SHARED"
# SPEC tier numbers (by kind: gpu 0, host 1, disk 2, shared 3) -> vLLM medium
MEDIA: tuple[str, ...] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE, MEDIUM_SHARED)

KIND_FULL = "full_attention"
KIND_WINDOW = "sliding_window"
KIND_MAMBA = "mamba"

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The last message of every replay / snapshot answer after the routing frames, as vLLM sends it
REPLAY_END: tuple[bytes, bytes, bytes] = (b"", END_SEQ, b"")
# A snapshot request on the replay socket (any request that is not 8 bytes long is not a
# vLLM replay request, so the two cannot be confused).
SNAPSHOT_REQUEST = b"kvcm:snapshot"


def seq_bytes(seq: int) -> bytes:
    """A batch sequence number as its 8-byte big-endian signed frame."""
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """The sequence number of an 8-byte big-endian signed frame."""
    return int.from_bytes(frame, "big", signed=True)


def _structs(array_like: bool) -> dict[str, type]:
    """The struct family of one layout (the batch is array-like in both)."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        """Base class of the KV cache events."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        kvcm_sink_tokens: int | None = None  # kvcm extension
        kvcm_coverage: int | None = None  # kvcm extension (None: the whole block)

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    class KVEventBatchOfInstance(KVEventBatch):
        """A batch stamped with the publisher's life (a 4th item; msgspec writes every
        field of an array-like struct, so the 3-item batch is a separate class)."""
        kvcm_instance: bytes | None = None  # kvcm extension

    return {c.__name__: c for c in (EventBatch, KVCacheEvent, BlockStored, BlockRemoved, AllBlocksCleared,
                                    KVEventBatch, KVEventBatchOfInstance)}


_MAP = _structs(array_like=False)
_ARRAY = _structs(array_like=True)

# The map layout is the default; these names are what callers construct.
KVEventBatch = _MAP["KVEventBatch"]
BlockStored = _MAP["BlockStored"]
BlockRemoved = _MAP["BlockRemoved"]
AllBlocksCleared = _MAP["AllBlocksCleared"]
WireEvent = Any  # BlockStored | BlockRemoved | AllBlocksCleared of either layout


def structs(layout: Layout) -> dict[str, type]:
    """The msgspec struct classes of wire ``layout`` (``"map"`` or ``"array"``), by name."""
    if layout == "map":
        return _MAP
    if layout == "array":
        return _ARRAY
    raise ValueError(f"unknown wire layout {layout!r}; choices: {', '.join(LAYOUTS)}")


class Encoder:
    """Encode a step's wire events as one ``KVEventBatch`` payload in a chosen layout.

    Events are built as map-layout structs; the array layout converts them field by field
    (``msgspec.structs.asdict``), so both layouts carry exactly the same values.  With an
    ``instance``, every batch carries it as ``kvcm_instance``."""

    def __init__(self, layout: Layout = "map", data_parallel_rank: int | None = 0,
                 instance: bytes | None = None) -> None:
        self.layout = layout
        self._s = structs(layout)
        self._enc = msgspec.msgpack.Encoder()
        self.data_parallel_rank = data_parallel_rank
        self.instance = instance

    def encode(self, ts: float, events: list[Any]) -> bytes:
        """One ``KVEventBatch`` of ``events`` at time ``ts`` (with this encoder's instance identity, if
        any) as msgpack bytes."""
        if self.layout != "map":
            events = [self._s[type(e).__name__](**msgspec.structs.asdict(e)) for e in events]
        if self.instance is None:
            return self._enc.encode(self._s["KVEventBatch"](ts=float(ts), events=events,
                                                             data_parallel_rank=self.data_parallel_rank))
        return self._enc.encode(self._s["KVEventBatchOfInstance"](
            ts=float(ts), events=events, data_parallel_rank=self.data_parallel_rank, kvcm_instance=self.instance))

    def raw(self, event: Any) -> msgspec.Raw:
        """One event encoded in this layout; ``encode`` takes such items as events (a batch
        is its items' encodings in a row, so the payload is the same as from the events)."""
        if self.layout != "map":
            event = self._s[type(event).__name__](**msgspec.structs.asdict(event))
        return msgspec.Raw(self._enc.encode(event))

    def encode_raw(self, ts: float, events: list[msgspec.Raw]) -> bytes:
        """``encode`` of events already encoded by ``raw``."""
        batch = "KVEventBatch" if self.instance is None else "KVEventBatchOfInstance"
        extra = {} if self.instance is None else {"kvcm_instance": self.instance}
        return self._enc.encode(self._s[batch](ts=float(ts), events=events,
                                               data_parallel_rank=self.data_parallel_rank, **extra))


class Decoder:
    """Decode a payload of either layout into map-layout structs (the router's input);
    ``kvcm_instance`` is None when the batch carries none."""

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(type=_MAP["KVEventBatchOfInstance"])
        self._array = msgspec.msgpack.Decoder(type=_ARRAY["KVEventBatchOfInstance"])

    def decode(self, payload: bytes) -> Any:
        """One batch from msgpack bytes, in either layout, as map-layout structs."""
        try:
            return self._map.decode(payload)
        except msgspec.ValidationError:
            batch = self._array.decode(payload)
            events = [_MAP[type(e).__name__](**msgspec.structs.asdict(e)) for e in batch.events]
            return _MAP["KVEventBatchOfInstance"](ts=batch.ts, events=events,
                                                  data_parallel_rank=batch.data_parallel_rank,
                                                  kvcm_instance=batch.kvcm_instance)


class _Head(msgspec.Struct, array_like=True):
    """A batch's items without decoding its events (``instance_of``)."""

    ts: msgspec.Raw
    events: msgspec.Raw
    data_parallel_rank: msgspec.Raw = msgspec.Raw(b"\xc0")
    kvcm_instance: bytes | None = None


_HEAD = msgspec.msgpack.Decoder(type=_Head)


def instance_of(payload: bytes) -> bytes | None:
    """The ``kvcm_instance`` a payload carries, without decoding its events; None when it
    carries none or is not a batch (decoding it properly is what reports that)."""
    try:
        return _HEAD.decode(payload).kvcm_instance
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


__all__ = [
    "END_SEQ",
    "KIND_FULL",
    "KIND_MAMBA",
    "KIND_WINDOW",
    "LAYOUTS",
    "MEDIA",
    "REPLAY_END",
    "SNAPSHOT_REQUEST",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Decoder",
    "Encoder",
    "KVEventBatch",
    "instance_of",
    "seq_bytes",
    "seq_of",
    "structs",
]
