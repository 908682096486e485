"""The torch data plane: the memory behind kvcm's slot indices (SPEC sec. 14).

The manager only hands out slot indices and copy ops; a :class:`DataPlane` owns the bytes.
torch is imported lazily (on first construction), so ``import kvcm`` stays light.

Pools
-----
One pool tensor per ``(tier, life cycle)``, shaped ``uint8[num_slots, slot_bytes]`` where
``num_slots`` is the manager's pool size for that tier and lc (``resolve_config``) and
``slot_bytes`` is ``LifeCycle.slot_bytes``:

* ``gpu``  — on the engine's ``device`` (``cpu`` when there is no accelerator);
* ``host`` — CPU memory, pinned when CUDA is available (fast, async-capable H2D/D2H);
* ``disk`` — a :class:`DiskPool`: a file ``kvcm-pool-<pid>-<random>-lc<lc>.bin`` under the
  tier's ``path``, read and written with explicit ``os.pread`` / ``os.pwrite`` (never an
  mmap: a full filesystem or a truncated file must be an ``OSError``, never a SIGBUS).

Disk files (SPEC sec. 15)
-------------------------
* **Space is reserved** when the plane is built (``os.posix_fallocate`` of the whole file):
  a filesystem too small raises ``OSError(ENOSPC)`` naming the tier and the path, and the
  plane removes every file it created.
* **Each slot is a record** of ``slot_bytes`` data bytes then an 8-byte trailer: the
  ``zlib.crc32`` of the data (little-endian uint32) and the magic ``b"KVCP"``.  The trailer
  is written with the page and verified on every read: a mismatch, a never-written slot or
  a short read (a truncated file) raises ``OSError(EIO)`` — the op did not complete.
* **Stale files**: the plane holds an exclusive ``flock`` on each of its files while it is
  open (the kernel drops it when the process dies).  A new plane removes every
  ``kvcm-pool-*`` file in its directory whose lock it can take: the file of a crashed run.
  A file is created under a temporary name, locked, and only then renamed to
  ``kvcm-pool-*``, so a live plane's file is never seen unlocked.  (``flock`` is advisory
  and per host: do not share one disk directory between hosts.)

Byte layout of one slot
-----------------------
The layers of a life cycle are laid out one after another in **config order**
(``LifeCycle.layer_ids``); a slot is exactly ``slot_bytes`` bytes, no padding:

* attention lc: ``[layer][token 0..B-1][bytes_per_token]`` — layer ``l`` occupies bytes
  ``off_l .. off_l + B * bytes_per_token_l`` of the slot, token-major, so the K/V of token
  ``t`` of the block is one contiguous run of ``bytes_per_token`` bytes.
* ssm lc: ``[layer][state_bytes]`` — one recurrent state per layer.

Typed views (no copies) are offered per layer: :meth:`DataPlane.kv` returns
``dtype[num_slots, B, *token_shape]`` and :meth:`DataPlane.state` returns
``dtype[num_slots, *state_shape]``; ``token_shape``/``state_shape`` come from the
``shapes`` argument (default: flat, ``bytes // itemsize``).  The reference engine uses
``token_shape = (2, heads, head_dim)``: K then V of one token.

Copy ops and copy runs
----------------------
:meth:`DataPlane.apply_runs` executes :class:`~kvcm.api.CopyRun` s
(``KVCacheManager.drain_copy_runs()``: whole slots, raw bytes), runs in order, with the
result of the ops one by one in order: the ops of a run commute (DECISIONS.md "Copy runs"),
so a run of memory tiers (gpu, host) is **one** gather (``index_select``) and one scatter
(``index_copy_``) whose index tensors are the run's ``array('q')`` slot columns as they are
(``torch.frombuffer``: no per-op Python); a disk side goes op by op (``pread`` /
``pwrite``); consecutive runs of the shared tier with one direction that write no location
twice (``copy_runs`` cuts them apart at every change of life cycle) are one store or load
batch.  :meth:`DataPlane.apply` executes ``CopyOp`` s: it validates them and hands
``kvcm.api.copy_runs(ops)`` to the same code, so the project has one run rule.  Everything
is validated before anything is copied (known tier and lc, every slot in range, a known
reason, keys exactly on the shared side; for a run also that its ops commute): a bad op or
run raises ``ValueError`` and nothing is copied.

Failures (SPEC sec. 15): when an op fails (an ``OSError`` of disk I/O or a checksum, or any
exception of a torch copy, e.g. out of memory), the plane finishes the run it is in (the
shared batch it is in: its ops commute), executes **nothing after it**, and raises
:class:`kvcm.api.CopyError` whose ``ops`` (``CopyOp`` s: ``run.ops()``, or the very ops
given to :meth:`DataPlane.apply`) are the failed ops of the run and every op after the run,
in op order: exactly the ops whose destination cannot be trusted.  Stats count completed
ops only.  The engine passes them to ``KVCacheManager.forget_copies``.

A tier given as an int (in ops, :meth:`DataPlane.pool`, the views) is SPEC's number by
kind, as the manager's copy ops carry it: gpu 0, host 1, disk 2, shared 3 (a gpu + disk
config has tiers 0 and 2); ``self.pools`` itself is indexed by config position.

The shared tier (DECISIONS.md "The shared tier")
------------------------------------------------
A ``Tier("shared", quota_bytes, path)`` has no pool: its ``path`` names a store
(:func:`open_store`: a directory, ``file:///dir``, or
``mooncake://host:port?metadata=url``), or one is given as ``store=``.  Objects are named
and checked by an :class:`~kvcm.dataplane.store.ObjectCodec` of the config's layout
fingerprint (``layout_fingerprint(resolved, config.shared_namespace)``).

* :meth:`DataPlane.shared_lookup` turns the manager's ``shared_candidates`` into the present
  pairs with **one** batched existence query; a store that cannot answer counts as empty
  (``lookup_errors``): nothing is lost, the request computes.
* ``store`` ops (a pool slot -> an object) and shared ``onboard`` ops (an object -> a gpu
  slot) of one run are each executed as one batch per staging buffer's worth: the pages are
  gathered into a :class:`~kvcm.dataplane.store.Staging` buffer (registered with Mooncake: the
  put / get themselves are zero-copy), each object's header written / verified there, and
  loaded pages scattered into the pool with one ``index_copy_`` per (tier, lc).  In runs,
  the shared side of an op is the object ``(3, lc, key)``.
* Faults: a load that fails (missing, short, foreign, corrupted, store down) fails its op
  like a disk read: the run finishes, nothing after it runs, ``CopyError``.  A **store**
  op that fails stops nothing: every other op still runs, and the failed store ops are
  listed in the ``CopyError`` raised at the end (``forget_copies`` forgets nothing for
  them).  A failed write never shows an object (the stores publish whole objects only).
  An object the codec rejected (a :class:`~kvcm.dataplane.store.BadObjectError`: short, long,
  foreign, corrupted) is removed from the store, so that later lookups do not find it
  again and a later store can write it whole (``removed_bad``).  No other failure removes
  anything (a store that is down, slow, out of descriptors, an unknown error code: the
  object may be good, and it is shared by the whole fleet).
* A slow store: each ``exists`` / ``put`` / ``get`` call has a deadline
  (``shared_timeout_s``, from the store's ``timeout_s``: default
  :data:`~kvcm.dataplane.store.DEFAULT_TIMEOUT_S`); it runs on a worker thread and past the
  deadline fails as a store that is down (``timeouts``); its staging buffer is abandoned,
  so a late get never writes into anything read afterwards (``SharedIO._call``).  A
  store that answers with the wrong number of results fails the call the same way.
* Authentication: with a store secret (``shared_secret=``, else the config's
  ``shared_secret_file``, else ``$KVCM_STORE_SECRET_FILE`` / ``$KVCM_STORE_SECRET``) objects
  carry an HMAC-SHA256, checked with the rest of the object before any byte is scattered
  into a pool; an object without a valid one fails its load like a corrupted one, is
  removed, and is counted (``auth_failures``).
* ``shared_stats``: lookups, objects and payload bytes stored / loaded, failures, batches,
  timeouts, and the seconds the data plane spent in store and load batches (gather, checksums, I/O).

Modules (one job each)
----------------------
* :mod:`kvcm.dataplane.plane`: :class:`DataPlane`, the facade: it builds the parts below,
  gives each its collaborators, and keeps the methods and attributes users call;
* :mod:`kvcm.dataplane.copy_runs`: :class:`~kvcm.dataplane.copy_runs.CopyRuns`, the
  copy-op executor (``apply`` / ``apply_runs``), given the pools, the shared-tier I/O and
  the counters;
* :mod:`kvcm.dataplane.shared_io`: :class:`~kvcm.dataplane.shared_io.SharedIO`,
  ``shared_lookup`` and store / load batches under a deadline, given the pools and the
  counters;
* :mod:`kvcm.dataplane.slot_memory`: :class:`~kvcm.dataplane.slot_memory.SlotMemory`, the
  bytes behind the slots: the pools per ``(tier, lc)``, views, resizing;
* :mod:`kvcm.dataplane.copy_stats`: :class:`~kvcm.dataplane.copy_stats.CopyStats`, the
  counters of executed copies;
* :mod:`kvcm.dataplane.disk_pool`: :class:`DiskPool`, the disk tier's files;
* :mod:`kvcm.dataplane.store_factory`: :func:`open_store`;
* :mod:`kvcm.dataplane.store`: the store interface, object codec, staging buffer, file store;
* :mod:`kvcm.dataplane.mooncake_store`: the Mooncake Store client (optional dependency).

* :mod:`kvcm.dataplane.store_client`: :class:`StoreClient`, the shared tier's existence
  queries without pools (a side that moves no bytes: vLLM's scheduler);
The parts depend downwards only (``plane | store_client > copy_runs > shared_io > slot_memory | copy_stats``)
and call one another's public methods only; the stores (``store``, ``mooncake_store``) and
``disk_pool`` know nothing of kvcm's managers (import contracts in pyproject.toml).
"""

from kvcm.dataplane.copy_stats import COPY_REASONS
from kvcm.dataplane.disk_pool import DiskPool, remove_stale_pool_files
from kvcm.dataplane.plane import DataPlane
from kvcm.dataplane.store_client import StoreClient
from kvcm.dataplane.store_factory import open_store

__all__ = ["COPY_REASONS", "DataPlane", "DiskPool", "StoreClient", "open_store", "remove_stale_pool_files"]
