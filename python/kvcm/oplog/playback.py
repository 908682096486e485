"""Replaying a log: each manager's ops on fresh managers of the chosen backends, checked
against the recorded outcomes and across backends, stopping at the first divergence.
(Named *playback*: ``kvcm.oplog.replay`` is the function; the command that runs it,
``python -m kvcm oplog-replay``, is :mod:`kvcm.cli.oplog_replay`.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcm._select import manager_class
from kvcm.api import KVCacheManager, KVCacheManagerConfig
from kvcm.oplog.format import LoggedManager, config_from_json, format_log, read_log
from kvcm.oplog.lockstep import Divergence, Lockstep
from kvcm.oplog.minimise import minimize


@dataclass
class ReplayReport:
    path: str
    backends: tuple[str, ...]
    managers: int = 0
    steps: int = 0
    divergence: Divergence | None = None
    minimized: str | None = None  # a shortest log showing the divergence (replay(minimize=True))

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def __str__(self) -> str:
        head = f"replayed {self.steps} ops of {self.managers} manager(s) from {self.path} on {', '.join(self.backends)}"
        if self.ok:
            return head + ": no divergence"
        return head + "\n" + str(self.divergence)


def build_manager(config: KVCacheManagerConfig, backend: str) -> KVCacheManager:
    """A manager of ``backend`` that is never recorded (replaying must not log)."""
    return manager_class(backend)(config)


# The full check (every cache's properties, snapshot(), check_invariants()) costs the size
# of the whole state, which grows with the log: run after every op it made a replay
# quadratic (a 50-request log of the shipped trace took 11 minutes).  It runs after the
# first op, after the ops where the log read so far reaches 1/2, 1/4, 1/8, ... of the
# stream (down to FULL_CHECK_MIN_CHARS), and after the last op: the state at each is at
# most that fraction of the final one, so all of them cost about twice the final check,
# and the replay stays linear in the log.  Every op still gets the light check
# (outcomes, the caches it touches, stats()).
FULL_CHECK_MIN_CHARS = 1 << 16


def _schedule(sizes: Sequence[int]) -> list[bool]:
    """For each op of a stream: run the full check after it (see above)?"""
    out = [False] * len(sizes)
    if not sizes:
        return out
    out[0] = out[-1] = True
    marks = []
    mark = sum(sizes) / 2
    while mark >= FULL_CHECK_MIN_CHARS:
        marks.append(mark)
        mark /= 2
    marks.reverse()
    read = j = 0
    for k, n in enumerate(sizes):
        read += n
        while j < len(marks) and read >= marks[j]:
            out[k] = True
            j += 1
    return out


class _Run:
    """One stream run in lockstep from its first op, re-startable: :meth:`to` advances it
    (light checks only) to just after op ``k``, starting over with fresh managers when it
    is already past ``k``."""

    def __init__(self, stream: LoggedManager, factory: Any, backends: Sequence[str], check_invariants: bool) -> None:
        self.stream, self.factory, self.backends, self.check = stream, factory, backends, check_invariants
        self.ls: Lockstep | None = None
        self.done = -1

    def start(self) -> None:
        self.ls = Lockstep(self.factory(config_from_json(self.stream.config)), self.backends,
                           check_invariants=self.check, m=self.stream.m)
        self.done = -1

    def step(self, k: int, full: bool) -> Divergence | None:
        assert self.ls is not None and k == self.done + 1
        rec = self.stream.ops[k]
        op = {key: v for key, v in rec.items() if key in ("op", "args", "cache")}
        d = self.ls.step(op, rec.get("outcome"), full=full)
        self.done = k
        if d is not None:
            d.line = self.stream.lines[k]
        return d

    def to(self, k: int) -> Divergence | None:
        if self.ls is None or self.done > k:
            self.start()
        while self.done < k:
            d = self.step(self.done + 1, False)
            if d is not None:
                return d
        return None

    def full_check(self) -> Divergence | None:
        assert self.ls is not None
        d = self.ls.full_check()
        if d is not None:
            d.line = self.stream.lines[self.done] if self.done >= 0 else None
        return d


def _locate(run: _Run, lo: int, hi: int, found: Divergence) -> Divergence:
    """The full check passed after op ``lo`` (-1: none ran yet, the fresh managers) and
    failed after op ``hi``: bisect, re-running the stream, to the op after which it first
    fails (``found`` if re-running does not fail again: a nondeterministic backend)."""
    first = found
    while hi - lo > 1:
        mid = (lo + hi) // 2
        d = run.to(mid)
        if d is not None:  # the light check fails earlier on this run: that op is the first
            return d
        d = run.full_check()
        if d is None:
            lo = mid
        else:
            hi, first = mid, d
    return first


def replay(
    path: str,
    backends: Sequence[str] = ("python", "cpp"),
    *,
    check_invariants: bool = True,
    minimize_divergence: bool = False,
    progress: Callable[[int], Any] | None = None,
) -> ReplayReport:
    """Replay the log at ``path`` on each of ``backends``; stop at the first divergence.
    With ``minimize_divergence`` (and 2+ backends, or a crash/invariant divergence), also
    compute a shortest log showing it (``report.minimized``).  ``progress``: display only,
    called with the number of ops to replay; it returns the display, whose ``update(1)`` is
    called after each op and ``close()`` at the end (e.g. ``lambda n:
    kvcm.tools.progress.Progress(n, "python,cpp")``)."""
    backends = tuple(backends)
    if not backends:
        raise ValueError("replay needs at least one backend")
    streams = read_log(path)
    report = ReplayReport(path=path, backends=backends, managers=len(streams))

    def factory(cfg: KVCacheManagerConfig) -> list[Any]:
        return [build_manager(cfg, b) for b in backends]

    bar = progress(sum(len(s.ops) for s in streams)) if progress is not None else None
    try:
        for stream in streams:
            steps_before = report.steps
            run = _Run(stream, factory, backends, check_invariants)
            try:
                run.start()
            except Exception as e:  # noqa: BLE001 - a backend that cannot build it diverges
                report.divergence = Divergence(stream.m, -1, {"op": "<construct>"}, "construct",
                                               f"{type(e).__name__}: {e}")
                break
            sizes = stream.sizes if len(stream.sizes) == len(stream.ops) else [len(str(r)) for r in stream.ops]
            full = _schedule(sizes)
            checked = -1  # the last op after which the full check passed
            for k in range(len(stream.ops)):
                d = run.step(k, False)
                report.steps += 1
                if bar is not None:
                    bar.update(1)
                if d is None and full[k]:
                    d = run.full_check()
                    if d is None:
                        checked = k
                    elif k - checked > 1:
                        d = _locate(run, checked, k, d)
                if d is not None:
                    report.divergence = d
                    report.steps = steps_before + d.step + 1
                    break
            if report.divergence is not None:
                d = report.divergence
                if d.kind != "op" and minimize_divergence and (
                    len(backends) > 1 or d.kind in ("invariants", "not_implemented")
                ):
                    recs = minimize(config_from_json(stream.config), factory, backends, stream.ops[: d.step + 1],
                                    d.signature)
                    report.minimized = format_log(stream.config, recs, m=stream.m)
                break
    finally:
        if bar is not None:
            bar.close()
    return report
