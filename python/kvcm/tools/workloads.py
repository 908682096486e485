"""The reference engine's workloads (kvcm.engine): multi-turn conversations run wave by wave
through a fresh :class:`~kvcm.engine.Engine`, and the check of every request against the
no-cache run.  Shared by the tests, the demo (``python -m kvcm demo``) and one engine
instance as a process (``python -m kvcm.tools.engine_instance``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.engine import Engine, EngineRequest, TinyHybridModel, compare_with_reference


@dataclass(frozen=True)
class Workload:
    """``waves`` of turns: conversation ``i``'s turn ``t`` prompt is the system prompt,
    then each earlier turn's user tokens and the model's answer, then its own user tokens.
    All conversations' turn ``t`` run as one batch."""

    name: str
    system: tuple[int, ...]
    conversations: tuple[tuple[tuple[int, ...], ...], ...]  # [conv][turn] user tokens
    max_new_tokens: int


def make_workload(name: str, *, seed: int = 0, vocab: int = 64, system_len: int = 37, conversations: int = 4,
                  turns: int = 3, user_len: tuple[int, int] = (5, 30), max_new_tokens: int = 8) -> Workload:
    rng = random.Random(f"{name}/{seed}")

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(n))

    convs = tuple(tuple(toks(rng.randint(*user_len)) for _ in range(turns)) for _ in range(conversations))
    return Workload(name, toks(system_len), convs, max_new_tokens)


BUILTIN_WORKLOADS = {
    # many requests, one system prompt, one turn each
    "shared-system-prompt": {"system_len": 53, "conversations": 8, "turns": 1, "user_len": (3, 40),
                             "max_new_tokens": 6},
    # each turn extends the previous: reuse ends inside a block (partial-block reuse, cow)
    "multi-turn": {"system_len": 21, "conversations": 3, "turns": 4, "user_len": (4, 24), "max_new_tokens": 9},
}


def builtin_workload(name: str, vocab: int = 64) -> Workload:
    return make_workload(name, vocab=vocab, **BUILTIN_WORKLOADS[name])


@dataclass
class Outcome:
    requests: list[EngineRequest]
    engine_counters: dict
    copies: dict  # executed copy ops by reason (data plane)
    stats: dict  # manager stats()
    routes: dict  # executed copy ops by route ("gpu->host", ...)
    shared: dict = field(default_factory=dict)  # the data plane's shared_stats (with a shared tier)
    tokens_equal: bool = False
    max_logit_diff: float = float("nan")


def run_workload(model: TinyHybridModel, manager: Any, workload: Workload | Sequence[Workload], *,
                 max_batch: int = 4, check: bool = True) -> Outcome:
    """Run ``workload`` (or several, one after the other) wave by wave through a fresh
    engine on ``manager``; with ``check``, compare every request with the no-cache reference."""
    engine = Engine(model, manager, max_batch=max_batch)
    try:
        done: list[EngineRequest] = []
        for w in [workload] if isinstance(workload, Workload) else workload:
            done += _run_waves(engine, w)
        manager.check_invariants()
        out = Outcome(done, dict(engine.counters), dict(engine.plane.copies), manager.stats(),
                      dict(engine.plane.routes), dict(engine.plane.shared_stats) if engine.plane.shared else {})
    finally:
        engine.close()
    if check:
        out.tokens_equal, out.max_logit_diff = compare_with_reference(model, done)
    return out


def _run_waves(engine: Engine, workload: Workload) -> list[EngineRequest]:
    history = [list(workload.system) for _ in workload.conversations]
    done: list[EngineRequest] = []
    nturns = max(len(c) for c in workload.conversations)
    for t in range(nturns):
        wave = []
        for i, conv in enumerate(workload.conversations):
            if t < len(conv):
                wave.append((i, EngineRequest(history[i] + list(conv[t]), workload.max_new_tokens)))
        engine.generate([r for _, r in wave])
        for i, r in wave:
            history[i] = r.prompt + r.output
        done.extend(r for _, r in wave)
    return done


__all__ = ["BUILTIN_WORKLOADS", "Outcome", "Workload", "builtin_workload", "make_workload", "run_workload"]
