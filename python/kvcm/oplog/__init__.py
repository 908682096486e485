"""Op log (sec. 11): record every public call as JSON lines, replay a log on one or both
backends and report the first divergence.

Recording: with ``KVCM_OPLOG=path`` set when a manager is built, ``kvcm.KVCacheManager(...)``
returns a :class:`RecordingManager` proxy (same ABCs; it forwards every call and appends
one line per public call).  ``{pid}`` in the path is replaced by the process id.  Lines::

    {"kvcm_oplog": 1, "m": "<pid>.<n>", "backend": "python", "config": {...}}   # a manager
    {"m": "<pid>.<n>", "step": 0, "op": "create_kv_cache", "args": {...}, "outcome": {...}}

Several managers may write to one file: ``m`` tells their records apart and each replays
independently.

Recording never changes what a call does (SPEC sec. 15): a record is taken under the
proxy's lock together with the call it records, so records from several threads are in
the order the calls took effect; a write that fails (a full disk, an I/O error) stops that
file's logging with one :class:`OpLogWarning`, and ``RecordingManager.oplog_error`` then
says why; the line cut short is cut off, so the file stays a replayable prefix.  The file
is opened once per process and path: created ``0600`` (an existing one is tightened to
``0600``), never through a symlink, and only if it is a regular file of this user with one
link; otherwise building the manager raises an ``OSError`` that names ``KVCM_OPLOG``.  Only state-visible public calls are recorded (the :mod:`kvcm.oplog.ops`
vocabulary); property reads, ``snapshot()`` and ``check_invariants()`` are not.

Replay: :func:`replay` (``python -m kvcm oplog-replay PATH [--backend python,cpp]``, the
command :mod:`kvcm.cli.oplog_replay`) runs each manager's ops on fresh managers of the chosen
backends, checks every outcome against the recorded one, compares ``snapshot()`` across
backends after every step and runs ``check_invariants()``; it stops at the first
divergence.

The package, one module per concern (every name below is importable from ``kvcm.oplog``):

* :mod:`kvcm.oplog.format`: configs as JSON, :func:`read_log`, :func:`format_log`;
* :mod:`kvcm.oplog.record`: the recording proxy (:class:`RecordingManager`);
* :mod:`kvcm.oplog.lockstep`: :class:`Lockstep`, :func:`run_ops`, :class:`Divergence`;
* :mod:`kvcm.oplog.minimise`: :func:`minimize`;
* :mod:`kvcm.oplog.playback`: :func:`replay`, :func:`build_manager`.
"""

from __future__ import annotations

from kvcm.oplog.format import (
    ENV_VAR,
    FORMAT_VERSION,
    LogFormatError,
    LoggedManager,
    config_from_json,
    config_to_json,
    format_log,
    read_log,
)
from kvcm.oplog.lockstep import DOCUMENTED_ERRORS, Divergence, Lockstep, first_difference, run_ops
from kvcm.oplog.minimise import minimize
from kvcm.oplog.playback import ReplayReport, build_manager, replay
from kvcm.oplog.record import (
    OpLogWarning,
    RecordingCache,
    RecordingManager,
    maybe_wrap,
    maybe_wrap_class,
    oplog_path,
    wrap,
)
from kvcm.oplog.record import (
    _LogWriter as _LogWriter,  # re-exported for tests that slow a write down
)

__all__ = [
    "DOCUMENTED_ERRORS",
    "ENV_VAR",
    "FORMAT_VERSION",
    "Divergence",
    "Lockstep",
    "LogFormatError",
    "LoggedManager",
    "OpLogWarning",
    "RecordingCache",
    "RecordingManager",
    "ReplayReport",
    "build_manager",
    "config_from_json",
    "config_to_json",
    "first_difference",
    "format_log",
    "maybe_wrap",
    "maybe_wrap_class",
    "minimize",
    "oplog_path",
    "read_log",
    "replay",
    "run_ops",
    "wrap",
]
