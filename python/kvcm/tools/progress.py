"""A tiny dependency-free progress bar on stderr (display only: it never affects results)."""

from __future__ import annotations

import sys
import time
from typing import Self, TextIO


class Progress:
    """``with Progress(total, "python") as p: ... p.update(1)``.

    Redraws at most ``hz`` times a second; on a non-tty stream it prints one line at 25%
    steps instead of carriage-return redraws, so logs stay readable."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, width: int = 30, hz: float = 8.0):
        self.total = max(0, int(total))
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.n = 0
        self._min_dt = 1.0 / hz
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._next_pct = 25

    def update(self, k: int = 1) -> None:
        """Count ``k`` more done; redraw on a terminal at most every ``min_dt`` seconds."""
        self.n += k
        if self._tty:
            now = time.perf_counter()
            if now - self._last >= self._min_dt or self.n >= self.total:
                self._last = now
                self._draw(now)
        elif self.total:
            pct = 100 * self.n // self.total
            if pct >= self._next_pct and self.n < self.total:
                self.stream.write(f"{self.label}: {pct}% ({self.n}/{self.total})\n")
                self.stream.flush()
                while self._next_pct <= pct:
                    self._next_pct += 25

    def _draw(self, now: float) -> None:
        frac = self.n / self.total if self.total else 1.0
        filled = int(self.width * frac)
        bar = "#" * filled + "-" * (self.width - filled)
        dt = now - self._t0
        rate = self.n / dt if dt > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else 0.0
        self.stream.write(f"\r{self.label} [{bar}] {self.n}/{self.total} {rate:7.1f}/s eta {eta:5.0f}s")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final line and end it (on a terminal)."""
        if self._tty:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
