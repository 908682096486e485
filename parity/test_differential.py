"""Differential run (SPEC sec. 13): two managers driven in lockstep by one random op sequence.

``test_differential[cpp]``    python vs cpp (the conformance check proper);
``test_differential[python]`` python vs python: two independent instances must agree step
                              by step (catches dict-order / hash / clock nondeterminism).

Every op comes from the :mod:`kvcm.oplog.ops` vocabulary — every public call, bad input included
(out-of-range / wrong-type tokens, bad scopes and priorities, wrong status, shrinking
capacity, commits beyond capacity, unknown life cycles, short buffers), batched decode steps
(``resize_batch`` / ``commit_batch`` with lists, arrays, numpy and torch containers;
repeated, closed, suspended and foreign caches, length mismatches), forks (any status, bad ids)
and beam steps (fork, copy-on-write resizes, prunes, either drain) — over hybrid
(full attention + window/sinks + ssm), pure-ssm and attention-only models, 1–3 tiers
(disk under a temp dir) and a shared tier under both write policies (driven with a model
store: the store ops drained so far, minus random deletions and failed writes; hits from
``shared_candidates``; failed shared onboards reported through ``forget_copies``), both copy
settlements (``"explicit"``: drains stay unsettled until ``settle_copies`` settles the oldest,
with a random failed subset of it, bad input, or nothing failed), partial reuse on/off,
several scopes and tight quotas.  After every
step: the outcomes (result or error type), every cache's properties, ``snapshot()``
(exact equality) and ``check_invariants()`` on both sides.  An error type outside the
documented ones (ValueError, TypeError, KvcmError family) is a crash even if both sides
agree.  A failure prints the op sequence, minimised by delta debugging on the op log
(:func:`kvcm.oplog.minimize`, instead of Hypothesis shrinking, which re-runs the whole
machine per attempt and took minutes), as a replayable op log
(``python -m kvcm oplog-replay FILE``).

Profile: ``KVCM_DIFF_EXAMPLES`` (default 300) examples × ``KVCM_DIFF_STEPS`` (default 50)
steps, derandomized, no database, no deadline; ``KVCM_DIFF_LONG=1`` runs 10× the examples;
``KVCM_DIFF_RANDOM=1`` draws new examples each run (exploration; a failure's minimised op
log is its reproducer).

The machine is this file; what it draws is parity/differential_draws.py, its ops are mixins
by topic: parity/differential_requests.py (the request life cycle),
parity/differential_batch_forks.py (batched decode steps, forks, beams) and
parity/differential_copies_quota.py (failed copies, settlement, quotas, probes).
"""

from __future__ import annotations

import contextlib
import dataclasses

import kvcm
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from kvcm import KVCacheManagerConfig
from kvcm.config import resolve_config
from kvcm.oplog import DOCUMENTED_ERRORS, Lockstep, config_to_json, format_log, minimize
from kvcm.oplog import ops as O

from parity.differential_batch_forks import BatchForkOps
from parity.differential_copies_quota import CopyQuotaOps
from parity.differential_draws import (
    _MINIMIZED,
    BAD_SCOPES,
    BAD_TOKEN_LISTS,
    BAD_TOKENS,
    DIFF_SETTINGS,
    EXAMPLES,
    EXPLICIT_FAILURES_SETTLED,
    PAIRS,
    SCOPES,
    SHARED_POLICIES_SEEN,
    SWITCHABLE_OPS,
    base_sequences,
    configs,
    token_st,
)
from parity.differential_requests import RequestOps


class DifferentialMachine(RequestOps, BatchForkOps, CopyQuotaOps, RuleBasedStateMachine):
    """Drive ``PAIR`` (set by :func:`machine_for`) in lockstep through a
    :class:`kvcm.oplog.Lockstep` (outcomes, cache properties, snapshot, invariants after
    every op)."""

    PAIR: tuple[str, str] = ("python", "python")

    def __init__(self) -> None:
        super().__init__()
        self.ls: Lockstep | None = None
        self.plans: list[list] = []  # per handle: the tokens it intends to commit
        self.scopes: list = []  # per handle: the scope it was created with (JSON form)
        self.config: KVCacheManagerConfig | None = None
        self.bases: list[list] = []
        self.disabled: set[str] = set()
        self.last_drain: list[list] = []  # the last drain's ops not reported yet (JSON form)
        # copy_settlement="explicit": the unsettled drains' ops, oldest first (JSON form)
        self.explicit = False
        self.unsettled: list[list[list]] = []
        # the model shared store: (key hex, lc) of every store op drained and not reported
        # failed, minus random deletions (objects evicted by the store or other instances)
        self.store: set[tuple[str, int]] = set()
        self.has_shared = False

    @property
    def names(self) -> list[str]:
        a, b = self.PAIR
        return [a, b] if a != b else [f"{a}#1", f"{b}#2"]

    @property
    def caches(self) -> list[list]:
        return self.ls.caches if self.ls is not None else [[], []]

    # ---- setup ---------------------------------------------------------------------
    @initialize(config=configs(), bases=base_sequences(), disabled=st.sets(st.sampled_from(SWITCHABLE_OPS), max_size=2),
                data_for_seed=st.data())
    def setup(self, config: KVCacheManagerConfig, bases: list[list], disabled: set[str], data_for_seed) -> None:
        self.config = config
        self.disabled = disabled
        self.bases = bases
        self.B = config.tokens_per_block
        managers = self.build(config)
        if managers is None:  # both sides rejected it identically: use the unratioed pools
            self.config = config = dataclasses.replace(config, pool_ratio=None)
            managers = self.build(config)
            assert managers is not None
        self.ls = Lockstep(managers, self.names, allowed_errors=DOCUMENTED_ERRORS)
        self.explicit = config.copy_settlement == "explicit"
        rc = resolve_config(config)
        self.nlc = len(rc.life_cycles)
        self.has_shared = rc.has_shared
        if rc.has_shared:
            SHARED_POLICIES_SEEN.add(config.shared_write)
            self.seed_store(data_for_seed)

    def build(self, config: KVCacheManagerConfig) -> list | None:
        """Both managers, or None when both raise the same ConfigError."""
        built, errors = [], []
        for b in self.PAIR:
            try:
                built.append(kvcm.KVCacheManager(config, backend=b))
                errors.append(None)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - compared across the pair below
                errors.append(e)
        if errors == [None, None]:
            return built
        names = [type(e).__name__ if e is not None else "ok" for e in errors]
        if names[0] == names[1] == "ConfigError":
            return None
        raise AssertionError(
            f"building the managers: {self.PAIR[0]}: {names[0]}, {self.PAIR[1]}: {names[1]} ({errors})"
        )

    def teardown(self) -> None:
        for m in self.ls.managers if self.ls is not None else []:
            with contextlib.suppress(Exception):  # open caches are fine at the end of a run
                m.shutdown()

    # ---- running one op ------------------------------------------------------------
    def run(self, op: dict) -> dict:
        assert self.ls is not None
        d = self.ls.step(op)
        if d is not None:
            if d.kind == "not_implemented":
                raise NotImplementedError(d.detail)
            self.fail(d)
        out = self.ls.records[-1]["outcome"]
        drained = out.get("result")
        if op["op"] == "drain_copy_runs" and isinstance(drained, list):
            # the same drain in column form (kvcm.api.CopyRun.to_json rows): its ops, in order
            drained = [[lc, st, ss, dt, ds, reason, *([run[6][k]] if len(run) > 6 else [])]
                       for run in drained
                       for lc, st, dt, reason in [run[:4]]
                       for k, (ss, ds) in enumerate(zip(run[4], run[5]))]
        if op["op"] in ("drain_copy_ops", "drain_copy_runs") and isinstance(drained, list):
            self.last_drain = list(drained)
            if self.explicit and drained:
                self.unsettled.append(list(drained))
            # the data plane executed them: the store ops' objects now exist
            self.store |= {(o[6], o[0]) for o in self.last_drain if o[5] == "store"}
        return out

    def fail(self, d) -> None:
        """Minimise the ops so far to a shortest sequence with the same divergence and
        raise it as a replayable op log."""
        assert self.ls is not None and self.config is not None
        key = O.dumps([config_to_json(self.config), self.ls.records])
        if key not in _MINIMIZED:
            recs = minimize(
                self.config, self.build, self.names, self.ls.records, d.signature, allowed_errors=DOCUMENTED_ERRORS
            )
            _MINIMIZED[key] = format_log(self.config, recs)
        log = _MINIMIZED[key]
        n = len(log.splitlines()) - 1
        backends = ",".join(dict.fromkeys(self.PAIR))
        raise AssertionError(
            f"{self.PAIR[0]} vs {self.PAIR[1]} diverge after {len(self.ls.records)} ops:\n{d}\n"
            f"--- minimised op log ({n} ops; save it as FILE and run "
            f"`python -m kvcm oplog-replay FILE --backend {backends}`) ---\n{log}"
        )

    # ---- helpers for argument choice -----------------------------------------------
    def props(self, h: int) -> dict:
        return O.cache_props(self.caches[0][h])

    def pick_handle(self, data, live: bool = True) -> int | None:
        n = len(self.caches[0])
        if n == 0:
            return None
        if live and data.draw(st.integers(0, 9)) > 0:
            open_ = [h for h in range(n) if self.props(h).get("status") != "CLOSED"]
            if open_:
                return data.draw(st.sampled_from(open_))
        return data.draw(st.integers(0, n - 1))

    def prompt(self, data) -> list:
        base = data.draw(st.sampled_from(self.bases))
        k = data.draw(st.sampled_from([len(base), len(base) - 1, None]))
        if k is None or k < 0:
            k = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(token_st, max_size=3)) if data.draw(st.integers(0, 3)) == 0 else []
        return base[:k] + tail

    def maybe_bad_tokens(self, data, tokens: list):
        r = data.draw(st.integers(0, 19))
        if r == 0:
            return data.draw(st.sampled_from(BAD_TOKEN_LISTS))
        if r == 1:
            bad = data.draw(st.sampled_from(BAD_TOKENS))
            i = data.draw(st.integers(0, len(tokens)))
            return tokens[:i] + [bad] + tokens[i:]
        return tokens

    def scope(self, data):
        if data.draw(st.integers(0, 29)) == 0:
            return data.draw(st.sampled_from(BAD_SCOPES))
        return data.draw(st.sampled_from(SCOPES))

    def check(self, ok: bool, what: str) -> None:
        """An oracle of the differential beyond the lockstep's: fails with the op log so far."""
        if not ok:
            assert self.config is not None and self.ls is not None
            raise AssertionError(f"{what}\n--- op log ({len(self.ls.records)} ops) ---\n"
                                 f"{format_log(self.config, self.ls.records)}")

    def op_plain(self, name: str):
        return lambda data: self.run({"op": name})

    # (generator, weight); ``step`` picks one by weight among those this example enables
    WEIGHTS = (
        ("engine_step", 120),
        ("create", 60),
        ("resume", 35),
        ("suspend", 30),
        ("resize", 35),
        ("commit", 35),
        ("commit_input", 25),
        ("close", 35),
        ("stop_committing", 15),
        ("page_indices", 25),
        ("probe", 25),
        ("probe_create", 30),
        ("drain_copy_ops", 30),
        ("drain_copy_runs", 10),
        ("forget_copies", 12),
        ("settle_copies", 20),
        ("take_events", 15),
        ("stats", 10),
        ("take_iteration_stats", 10),
        ("clear_reusable", 5),
        ("set_quota", 10),
        ("decode_step", 30),
        ("resize_batch", 20),
        ("commit_batch", 20),
        ("fork", 20),
        ("beam_step", 25),
        ("shutdown", 1),  # ends the interesting part of a run: rare
    )

    @rule(data=st.data())
    def step(self, data) -> None:
        table = [(n, w) for n, w in self.WEIGHTS if n not in self.disabled]
        total = sum(w for _, w in table)
        r = data.draw(st.integers(0, total - 1), label="op")
        for name, w in table:
            if r < w:
                break
            r -= w
        gen = getattr(self, f"op_{name}", None) or self.op_plain(name)
        gen(data)


def machine_for(pair: tuple[str, str]) -> type[DifferentialMachine]:
    return type(f"Differential_{pair[0]}_{pair[1]}", (DifferentialMachine,), {"PAIR": pair})


def test_differential(backend: str) -> None:
    """python vs ``backend`` in lockstep (python vs python: the determinism pair)."""
    run_state_machine_as_test(machine_for(PAIRS[backend]), settings=DIFF_SETTINGS)
    if EXAMPLES >= 100:  # the shared tier was driven under both write policies
        assert SHARED_POLICIES_SEEN >= {"commit", "evict"}, SHARED_POLICIES_SEEN
        # explicit settlement: failures were settled (pages forgotten, requests rolled back)
        assert EXPLICIT_FAILURES_SETTLED[0] > 0
