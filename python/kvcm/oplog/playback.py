"""Replaying a log (``python -m kvcm oplog-replay``): each manager's ops on fresh
managers of the chosen backends, checked against the recorded outcomes and across
backends, stopping at the first divergence.  (Named *playback*: ``kvcm.oplog.replay`` is
the function.)"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcm._select import BACKENDS, manager_class
from kvcm.api import KVCacheManager, KVCacheManagerConfig
from kvcm.oplog.format import LogFormatError, config_from_json, format_log, read_log
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


def replay(
    path: str,
    backends: Sequence[str] = ("python", "cpp"),
    *,
    check_invariants: bool = True,
    minimize_divergence: bool = False,
) -> ReplayReport:
    """Replay the log at ``path`` on each of ``backends``; stop at the first divergence.
    With ``minimize_divergence`` (and 2+ backends, or a crash/invariant divergence), also
    compute a shortest log showing it (``report.minimized``)."""
    backends = tuple(backends)
    if not backends:
        raise ValueError("replay needs at least one backend")
    streams = read_log(path)
    report = ReplayReport(path=path, backends=backends, managers=len(streams))

    def factory(cfg: KVCacheManagerConfig) -> list[Any]:
        return [build_manager(cfg, b) for b in backends]

    for stream in streams:
        config = config_from_json(stream.config)
        try:
            managers = factory(config)
        except Exception as e:  # noqa: BLE001 - a backend that cannot build it diverges
            report.divergence = Divergence(stream.m, -1, {"op": "<construct>"}, "construct", f"{type(e).__name__}: {e}")
            break
        ls = Lockstep(managers, backends, check_invariants=check_invariants, m=stream.m)
        for rec, lineno in zip(stream.ops, stream.lines):
            op = {k: v for k, v in rec.items() if k in ("op", "args", "cache")}
            d = ls.step(op, rec.get("outcome"))
            report.steps += 1
            if d is not None:
                d.line = lineno
                report.divergence = d
                break
        if report.divergence is not None:
            d = report.divergence
            if d.kind != "op" and minimize_divergence and (
                len(backends) > 1 or d.kind in ("invariants", "not_implemented")
            ):
                recs = minimize(config, factory, backends, stream.ops[: d.step + 1], d.signature)
                report.minimized = format_log(stream.config, recs, m=stream.m)
            break
    return report


def main_replay(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm oplog-replay PATH [--backend python,cpp] [--minimize OUT]``;
    exit 0 = no divergence, 1 = divergence, 2 = bad usage / unreadable or malformed log
    (one line on stderr naming the file, the line and the field)."""
    p = argparse.ArgumentParser(
        prog="python -m kvcm oplog-replay",
        description="Replay a kvcm op log (KVCM_OPLOG).",
        epilog="exit status: 0 no divergence, 1 a divergence (printed), 2 bad usage or an unreadable or malformed "
        "log (one line naming the file, line and field)",
    )
    p.add_argument("path")
    p.add_argument("--backend", default="python,cpp", help="comma-separated backends (default: python,cpp)")
    p.add_argument("--no-invariants", action="store_true", help="skip check_invariants() after each step")
    p.add_argument("--minimize", metavar="OUT", help="write a shortest log showing the divergence to OUT")
    a = p.parse_args(argv)
    backends = tuple(b.strip() for b in a.backend.split(",") if b.strip())
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        print(f"oplog-replay: unknown backend(s) {bad}; choices: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    try:
        report = replay(a.path, backends, check_invariants=not a.no_invariants, minimize_divergence=bool(a.minimize))
    except LogFormatError as e:
        print(f"oplog-replay: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"oplog-replay: {a.path}: {e}", file=sys.stderr)
        return 2
    d = report.divergence
    if d is not None and d.kind == "op":  # an op the log cannot mean (e.g. a cache never created)
        print(f"oplog-replay: {LogFormatError(a.path, d.line, d.detail)}", file=sys.stderr)
        return 2
    print(report)
    if a.minimize and not report.ok:
        if report.minimized is None:
            print("oplog-replay: minimising needs 2+ backends (one backend only diverges from the recording)")
        else:
            with open(a.minimize, "w", encoding="utf-8") as f:
                f.write(report.minimized)
            n = len(report.minimized.splitlines()) - 1
            print(f"minimised: {n} ops -> {a.minimize}")
    return 0 if report.ok else 1
