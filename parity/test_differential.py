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
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import tempfile

import kvcm
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer, Tier
from kvcm.config import resolve_config
from kvcm.keys import block_keys_py
from kvcm.oplog import DOCUMENTED_ERRORS, Lockstep, config_to_json, format_log, minimize
from kvcm.oplog import ops as O

from parity.helpers import held_block_tiers

EXAMPLES = int(os.environ.get("KVCM_DIFF_EXAMPLES", "300")) * (10 if os.environ.get("KVCM_DIFF_LONG") == "1" else 1)
STEPS = int(os.environ.get("KVCM_DIFF_STEPS", "50"))

DIFF_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    derandomize=os.environ.get("KVCM_DIFF_RANDOM") != "1",
    database=None,
    deadline=None,
    report_multiple_bugs=False,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
    # no Hypothesis shrinking: a failure is minimised on its op log (kvcm.oplog.minimize),
    # which is far faster than re-running the state machine thousands of times
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)


PAIRS = {"cpp": ("python", "cpp"), "python": ("python", "python")}

_DISK_DIR: str | None = None


def disk_dir() -> str:
    global _DISK_DIR
    if _DISK_DIR is None:
        _DISK_DIR = tempfile.mkdtemp(prefix="kvcm-diff-disk-")
    return _DISK_DIR


# ---------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------

MODELS = {
    "full": lambda w, s: [AttentionLayer(0, 2), AttentionLayer(1, 1)],
    "window": lambda w, s: [AttentionLayer(0, 2), AttentionLayer(1, 1, window=w, sink_tokens=s)],
    "hybrid": lambda w, s: [AttentionLayer(0, 2), AttentionLayer(1, 1, window=w, sink_tokens=s), SsmLayer(2, 24)],
    "attn_ssm": lambda w, s: [AttentionLayer(0, 2), SsmLayer(1, 16), SsmLayer(2, 8)],
    "ssm": lambda w, s: [SsmLayer(0, 32)],
    "window_ssm": lambda w, s: [AttentionLayer(0, 1, window=w, sink_tokens=s), SsmLayer(1, 16)],
}


@st.composite
def configs(draw) -> KVCacheManagerConfig:
    B = draw(st.sampled_from([1, 2, 3, 4]))
    model = draw(st.sampled_from(sorted(MODELS)))
    window = draw(st.integers(1, 3 * B + 1))
    sinks = draw(st.sampled_from([0, 0, 1, B, B + 1]))
    layers = MODELS[model](window, sinks)
    # one slot of every life cycle costs `per`; quotas are counted in those units
    probe = KVCacheManagerConfig(tokens_per_block=B, layers=layers, tiers=[Tier("gpu", 10**9)])
    lcs = resolve_config(probe).life_cycles
    per = sum(lc.slot_bytes for lc in lcs)
    n_tiers = draw(st.sampled_from([1, 2, 3]))
    # the shared tier (DECISIONS.md "The shared tier"), driven with a model store; under
    # "evict" the gpu is small, so that eviction (which writes) happens
    shared_write = draw(st.sampled_from([None, None, "commit", "evict"]))
    gpu_units = draw(st.integers(3, 4 if shared_write == "evict" else 10))
    tiers = [Tier("gpu", gpu_units * per + draw(st.sampled_from([0, 0, per // 2])))]
    if n_tiers >= 2:
        tiers.append(Tier("host", draw(st.integers(1, 6)) * per))
    if n_tiers >= 3:
        tiers.append(Tier("disk", draw(st.integers(1, 6)) * per, path=disk_dir()))
    pool_ratio = None
    if len(lcs) > 1 and draw(st.booleans()):
        pool_ratio = {lc.id: draw(st.sampled_from([1, 1, 2, 0.5])) for lc in lcs}
    if shared_write is not None:
        tiers.append(Tier("shared", 0, path=disk_dir()))
    return KVCacheManagerConfig(
        tokens_per_block=B,
        layers=layers,
        tiers=tiers,
        pool_ratio=pool_ratio,
        enable_partial_reuse=draw(st.booleans()),
        reuse_match_backoff=draw(st.sampled_from([0, 0, 0, 1, B + 1])),
        max_util_for_resume=draw(st.sampled_from([1.0, 1.0, 1.0, 0.6])),
        default_priority=draw(st.sampled_from([50, 50, 0, 100])),
        max_events=draw(st.sampled_from([10_000, 10_000, 3, 0])),
        shared_write=shared_write or "commit",
        shared_namespace="differential" if shared_write is not None else "",
        copy_settlement=draw(st.sampled_from(["drain", "explicit"])),
    )


# ---------------------------------------------------------------------------------------
# tokens, scopes and other arguments (JSON forms, see kvcm.oplog.ops)
# ---------------------------------------------------------------------------------------

DIGESTS = [{"digest": (bytes([i]) * 32).hex()} for i in (0xA1, 0xB2)]
BAD_TOKENS = [-1, 2**31, 2**31 + 5, "x", 1.5, True, None, {"digest": "00ff"}, [1]]
BAD_TOKEN_LISTS = ["abc", 5, {"bytes": "0102"}]
SCOPES = [None, None, None, {"lora_id": 0}, {"salt": 7}, {"lora_id": 1, "salt": 2}, {}]
BAD_SCOPES = ["scope", 3, {"lora_id": -1}, {"salt": 2**64}]
PRIORITIES = [None, None, None, 0, 10, 90, 100]
BAD_PRIORITIES = [-1, 101, "high", 1.5, True]

token_st = st.integers(0, 5)
HAVE_TORCH = importlib.util.find_spec("torch") is not None
# ops an example may switch off (swarm testing): e.g. never close, so pressure builds;
# never drain, so copy ops pile up.  create is never switched off.
SWITCHABLE_OPS = ("close", "stop_committing", "suspend", "drain_copy_ops", "drain_copy_runs", "clear_reusable",
                  "shutdown", "probe", "probe_create", "decode_step", "set_quota", "settle_copies")


@st.composite
def base_sequences(draw) -> list[list]:
    """A few sequences: prompts are prefixes (+ a small tail) of these, so they share
    prefixes.  Now and then one holds a multimodal digest token."""
    bases = []
    for _ in range(3):
        seq = draw(st.lists(token_st, min_size=0, max_size=16))
        if seq and draw(st.integers(0, 4)) == 0:
            seq[draw(st.integers(0, len(seq) - 1))] = draw(st.sampled_from(DIGESTS))
        bases.append(seq)
    return bases


_MINIMIZED: dict[str, str] = {}  # failing run -> its minimised log (the final re-run reuses it)
# the shared tier's write policies the examples of this process ran with (test_differential
# checks that both were driven)
SHARED_POLICIES_SEEN: set[str] = set()
# explicit settlement: how many settle_copies calls with failed ops succeeded (test_differential
# checks that roll-backs through settle_copies were driven)
EXPLICIT_FAILURES_SETTLED = [0]


class DifferentialMachine(RuleBasedStateMachine):
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

    # ---- rules ---------------------------------------------------------------------
    def request_tokens(self, data, args: dict, turn_odds: int = 3) -> list:
        """Tokens of a new request (or probe); may set ``args["scope"]``.  One time in
        ``turn_odds`` it is the next turn of an earlier conversation: that request's
        committed tokens (in its scope) plus a new part, which is what makes reuse frequent."""
        earlier = [h for h in range(len(self.caches[0])) if self.props(h).get("num_committed_tokens")]
        if earlier and data.draw(st.integers(0, turn_odds - 1)) == 0:
            prev = data.draw(st.sampled_from(earlier))
            tokens = O.encode_tokens(self.caches[0][prev].committed_tokens)
            cut = data.draw(st.sampled_from([len(tokens), len(tokens), len(tokens) - 1, len(tokens) // 2]))
            tokens = tokens[: max(cut, 0)] + data.draw(st.lists(token_st, max_size=self.B + 1))
            if self.scopes[prev] is not None:
                args["scope"] = self.scopes[prev]
            return tokens
        if data.draw(st.integers(0, 3)) == 0:
            args["scope"] = self.scope(data)
        return self.prompt(data)

    def op_create(self, data) -> None:
        args: dict = {}
        tokens = self.request_tokens(data, args)
        args["input_tokens"] = self.maybe_bad_tokens(data, tokens)
        r = data.draw(st.integers(0, 9))
        if r == 0:
            args["priority"] = data.draw(st.sampled_from(BAD_PRIORITIES))
        elif r < 5:
            args["priority"] = data.draw(st.sampled_from(PRIORITIES))
        r = data.draw(st.integers(0, 19))
        if r == 0:
            existing = [self.props(h).get("id") for h in range(len(self.caches[0]))]
            args["id"] = data.draw(st.sampled_from(existing + [0, "req", 1.5, True, None]))
        elif r <= 2:
            args["id"] = data.draw(st.sampled_from([100, "a", "b"]))
        hits = self.shared_hits(data, args["input_tokens"], args.get("scope"))
        if hits is not None:
            args["shared_hits"] = hits
        out = self.run({"op": "create_kv_cache", "args": args})
        if "result" in out:
            # what this request will commit: its prompt, then a continuation (its "output")
            base = next((b for b in self.bases if b[: len(tokens)] == tokens), tokens)
            extra = base[len(tokens) :] + data.draw(st.lists(token_st, max_size=2 * self.B + 2))
            self.plans.append(tokens + extra)
            self.scopes.append(args.get("scope"))

    def seed_store(self, data) -> None:
        """Other instances of the fleet wrote prefixes of the base sequences (default scope)
        before this one started: per base, the first n full blocks, for all life cycles or
        a drawn subset of them (e.g. attention without the ssm snapshot)."""
        everyone = (1 << self.nlc) - 1
        for base in self.bases:
            ks = block_keys_py(O.decode_tokens(base), self.B)[: len(base) // self.B]
            n = data.draw(st.sampled_from([len(ks), len(ks), -1]))
            if n < 0:
                n = data.draw(st.integers(0, len(ks)))
            mask = data.draw(st.sampled_from([everyone, everyone, -1]))
            if mask < 0:
                mask = data.draw(st.integers(0, everyone))
            self.store |= {(ks[i].hex(), lc) for i in range(n) for lc in range(self.nlc) if mask >> lc & 1}

    def shared_hits(self, data, tokens, scope) -> list | None:
        """What an engine with a shared tier passes to create_kv_cache or a probe for
        ``tokens`` in ``scope`` (JSON forms; scope None: not passed): the candidates (one
        call, recorded as an op) that the model store holds.  Before the lookup the store
        may lose objects; now and then a hit that is no candidate, or bad input.  Without
        a shared tier: rarely, hits anyway (a ValueError)."""
        if not self.has_shared:
            return [] if data.draw(st.integers(0, 29)) == 0 else None
        if data.draw(st.integers(0, 7)) == 0:
            return None  # an engine that does not look up this time
        if self.store and data.draw(st.integers(0, 4)) == 0:  # objects deleted since they were written
            gone = data.draw(st.lists(st.sampled_from(sorted(self.store)), max_size=3))
            self.store -= set(gone)
        cand = {"op": "shared_candidates", "args": {"tokens": tokens}}
        if scope is not None:
            cand["args"]["scope"] = scope
        out = self.run(cand)
        if not isinstance(out.get("result"), list):
            return None
        hits = [c for c in out["result"] if (c[0], c[1]) in self.store]
        r = data.draw(st.integers(0, 14))
        if r == 0 and self.store:  # a pair that is no candidate: ignored
            key, lc = data.draw(st.sampled_from(sorted(self.store)))
            hits.append([key, lc])
        elif r == 1:
            hits.append(data.draw(st.sampled_from([{"value": 3}, {"value": "ab"}, ["00" * 31, 0],
                                                   ["00" * 32, self.nlc], ["00" * 32, -1], {"value": [b"", 0]}])))
        elif r == 2:
            return data.draw(st.sampled_from([{"value": 5}, "abc"]))
        elif r == 3 and hits:
            hits = hits[: data.draw(st.integers(0, len(hits) - 1))]  # a store that answered for fewer
        return hits

    def op_resume(self, data) -> None:
        h = self.pick_handle(data)
        if h is not None:
            self.run({"op": "resume", "cache": h})

    def op_suspend(self, data) -> None:
        h = self.pick_handle(data)
        if h is not None:
            self.run({"op": "suspend", "cache": h})

    def op_resize(self, data) -> None:
        h = self.pick_handle(data)
        if h is None:
            return
        p = self.props(h)
        cap, hist, nc = (
            p[k] if isinstance(p[k], int) else 0 for k in ("capacity", "history_length", "num_committed_tokens")
        )
        B = self.B
        choices = [cap + 1, cap + B, cap + 3 * B, nc + B + 1, cap, max(hist, nc), cap + 1, cap + 2 * B]
        bad = [hist - 1, nc - 1, -1, "8", 2.0, None, 10**6]
        if data.draw(st.integers(0, 7)) == 0:
            capacity = data.draw(st.sampled_from(bad))
        else:
            capacity = data.draw(st.sampled_from(choices))
        args: dict = {"capacity": capacity}
        r = data.draw(st.integers(0, 5))
        if r == 1:
            c = capacity if isinstance(capacity, int) else cap
            args["history_length"] = data.draw(st.sampled_from([hist, hist + 1, c, c + 1, nc - 1, hist - 1, None, "1"]))
        elif r == 2:
            args["history_length"] = None
        self.run({"op": "resize", "cache": h, "args": args})

    def committed_and_room(self, h) -> tuple[int, int]:
        """The cache's committed tokens and the room left below its capacity (0 for a
        cache whose properties raise, e.g. closed)."""
        p = self.props(h)
        cap = p["capacity"] if isinstance(p["capacity"], int) else 0
        nc = p["num_committed_tokens"] if isinstance(p["num_committed_tokens"], int) else 0
        return nc, max(0, cap - nc)

    def op_commit(self, data) -> None:
        h = self.pick_handle(data)
        if h is None:
            return
        nc, room = self.committed_and_room(h)
        k = data.draw(st.sampled_from([room, room, 1, self.B, min(room, self.B), 0, room + 1, 2 * self.B + 1]))
        k = min(k, 8 * self.B + 8)  # a capacity of 10**6 (bad input resizes) is no commit to draw
        plan = self.plans[h]
        tokens = plan[nc : nc + k]
        if len(tokens) < k:
            tokens += data.draw(st.lists(token_st, min_size=k - len(tokens), max_size=k - len(tokens)))
        self.run({"op": "commit", "cache": h, "args": {"tokens": self.maybe_bad_tokens(data, tokens)}})

    def op_commit_input(self, data) -> None:
        """The prompt handed over at create, committed by count (kvcm.api.KVCache.commit_input)."""
        h = self.pick_handle(data)
        if h is None:
            return
        _, room = self.committed_and_room(h)
        n = data.draw(st.sampled_from([None, None, room, 1, self.B, min(room, self.B), 0, room + 1, -1, "1", True]))
        self.run({"op": "commit_input", "cache": h, "args": {} if n is None and data.draw(st.booleans()) else {"n": n}})

    def op_engine_step(self, data) -> None:
        """What an engine does with one request: resume it, grow its capacity, commit a
        chunk of its plan, drain copy ops; close it when its plan is done; when out of
        pages, preempt (suspend) or finish (close) another request."""
        h = self.pick_handle(data)
        if h is None:
            return
        if self.props(h)["status"] == "SUSPENDED" and self.run({"op": "resume", "cache": h}).get("result") is not True:
            self.preempt(data, h)
            return
        p = self.props(h)
        if p["status"] != "ACTIVE" or not all(isinstance(p[k], int) for k in ("capacity", "num_committed_tokens")):
            return
        nc = p["num_committed_tokens"]
        plan = self.plans[h]
        if nc >= len(plan) and data.draw(st.integers(0, 2)) > 0:
            self.run({"op": "close", "cache": h})  # request finished
            return
        chunk = data.draw(st.sampled_from([1, self.B, 2 * self.B, max(1, len(plan) - nc)]))
        if nc + chunk > p["capacity"]:
            out = self.run({"op": "resize", "cache": h, "args": {"capacity": nc + chunk + 1}})
            if out.get("result") is not True:
                self.preempt(data, h)
                return
        tokens = plan[nc : nc + chunk]
        tokens += data.draw(st.lists(token_st, min_size=chunk - len(tokens), max_size=chunk - len(tokens)))
        self.run({"op": "commit", "cache": h, "args": {"tokens": tokens}})
        if data.draw(st.integers(0, 2)) == 0:
            self.run({"op": "drain_copy_ops"})
            if self.explicit:
                if self.unsettled and data.draw(st.booleans()):  # how an earlier drain's copies ended
                    self.op_settle_copies(data)
            elif self.last_drain and data.draw(st.integers(0, 3)) == 0:  # the data plane failed
                self.op_forget_copies(data)

    def preempt(self, data, h: int) -> None:
        """Out of pages: suspend or close some other open request (or this one)."""
        open_ = [i for i in range(len(self.caches[0])) if self.props(i).get("status") in ("ACTIVE", "SUSPENDED")]
        if not open_:
            return
        victim = data.draw(st.sampled_from(open_))
        status = self.props(victim)["status"]
        op = "suspend" if status == "ACTIVE" and data.draw(st.booleans()) else "close"
        self.run({"op": op, "cache": victim})

    def op_stop_committing(self, data) -> None:
        h = self.pick_handle(data)
        if h is not None:
            self.run({"op": "stop_committing", "cache": h})

    def op_close(self, data) -> None:
        h = self.pick_handle(data)
        if h is not None:
            self.run({"op": "close", "cache": h})

    def op_page_indices(self, data) -> None:
        h = self.pick_handle(data)
        if h is None:
            return
        lc = data.draw(st.sampled_from(list(range(self.nlc)) * 3 + [-1, self.nlc, "0", None]))
        if data.draw(st.integers(0, 2)) == 0:
            p = self.props(h)
            cap = p["capacity"] if isinstance(p["capacity"], int) else 0
            need = -(-cap // self.B)
            size = data.draw(st.sampled_from([need, need, need + 2, max(0, need - 1), 1, 0]))
            dtype = data.draw(st.sampled_from(["int32", "int32", "int32", "int64", "float32"]))
            self.run({"op": "page_indices_into", "cache": h, "args": {"lc": lc, "size": size, "dtype": dtype}})
        else:
            self.run({"op": "page_indices", "cache": h, "args": {"lc": lc}})

    # ---- the batched decode step (resize_batch / commit_batch) ------------------------
    def batch_handles(self, data) -> list[int]:
        """The caches of a batch: mostly the ACTIVE ones (an engine's running batch), in
        creation or shuffled order; now and then any handles (closed, suspended)."""
        n = len(self.caches[0])
        if n == 0:
            return []
        if data.draw(st.integers(0, 4)) == 0:
            return data.draw(st.lists(st.integers(0, n - 1), max_size=4, unique=True))
        active = [h for h in range(n) if self.props(h).get("status") == "ACTIVE"]
        if active and data.draw(st.booleans()):
            active = data.draw(st.permutations(active))
        return active[: data.draw(st.sampled_from([len(active), len(active), 1, 2]))]

    def container(self, data, values: list) -> object:
        """``values`` (ints, or bad values) in the JSON form of a list, an ``array``, a numpy
        array or a torch tensor (kvcm.oplog.ops), as engines pass sequence lengths and tokens."""
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        kinds = ["list", "list", "list"]
        if ints and all(-(2**63) <= v < 2**63 for v in values):
            kinds += ["array", "numpy"] + (["torch"] if HAVE_TORCH else [])
        kind = data.draw(st.sampled_from(kinds))
        if kind == "list":
            return list(values)
        wide = any(not -(2**31) <= v < 2**31 for v in values)
        if kind == "array":
            return {"array": "q" if wide else data.draw(st.sampled_from(["q", "i"])), "values": values}
        if kind == "numpy":
            dtypes = ["int64"] if wide else ["int64", "int32", "int32", "float64", "bool"]
            return {"numpy": data.draw(st.sampled_from(dtypes)), "values": values}
        return {"torch": "int64" if wide else data.draw(st.sampled_from(["int64", "int32"])), "values": values}

    def mutate_batch(self, data, handles: list, values: list) -> tuple[object, list]:
        """Now and then, bad input: a repeated cache, a cache of no manager of this run, a
        value that is no cache, a length mismatch (kvcm.oplog.ops JSON forms)."""
        items: list = list(handles)
        r = data.draw(st.integers(0, 13))
        if r == 0 and items:
            items.insert(data.draw(st.integers(0, len(items))), data.draw(st.sampled_from(items)))
            values = values + values[:1]
        elif r == 1:
            items.insert(data.draw(st.integers(0, len(items))), data.draw(st.sampled_from([{"foreign": True}, {"value": 0}, {"value": "kv"}])))
            values = values + values[:1]
        elif r == 2:
            values = values[:-1] if values and data.draw(st.booleans()) else values + values[:1] + [1]
        elif r == 3:
            return data.draw(st.sampled_from(["abc", None, 3])), values
        elif r <= 5:  # a closed or SUSPENDED cache among the running ones
            idle = [h for h in range(len(self.caches[0])) if self.props(h).get("status") != "ACTIVE"]
            if idle:
                items.insert(data.draw(st.integers(0, len(items))), data.draw(st.sampled_from(idle)))
                values = values + values[:1] if values else [1]
        return items, values

    def op_resize_batch(self, data) -> None:
        handles = self.batch_handles(data)
        caps = []
        for h in handles:
            p = self.props(h)
            cap, nc = (p[k] if isinstance(p[k], int) else 0 for k in ("capacity", "num_committed_tokens"))
            caps.append(data.draw(st.sampled_from([cap + 1, cap + 1, cap + self.B, nc + 2 * self.B + 1, cap, cap + 4 * self.B])))
        if caps and data.draw(st.integers(0, 5)) == 0:
            caps[data.draw(st.integers(0, len(caps) - 1))] = data.draw(st.sampled_from([-1, "8", 2.0, None, True, 0]))
        items, caps = self.mutate_batch(data, handles, caps)
        args: dict = {"caches": items, "capacities": self.container(data, caps)}
        r = data.draw(st.integers(0, 5))
        if r == 0:
            hists = [self.props(h)["history_length"] if isinstance(h, int) else 0 for h in handles] + [0] * (len(caps) - len(handles))
            hists = [hv + data.draw(st.sampled_from([0, 0, 1, -1])) if isinstance(hv, int) else hv for hv in hists]
            args["history_lengths"] = self.container(data, hists[: len(caps)])
        elif r == 1:
            args["history_lengths"] = None
        self.run({"op": "resize_batch", "args": args})

    def op_commit_batch(self, data) -> None:
        handles = self.batch_handles(data)
        toks = []
        for h in handles:
            nc = self.props(h)["num_committed_tokens"]
            plan = self.plans[h]
            toks.append(plan[nc] if isinstance(nc, int) and nc < len(plan) else data.draw(token_st))
        if toks and data.draw(st.integers(0, 7)) == 0:
            toks[data.draw(st.integers(0, len(toks) - 1))] = data.draw(st.sampled_from(BAD_TOKENS + DIGESTS))
        items, toks = self.mutate_batch(data, handles, toks)
        self.run({"op": "commit_batch", "args": {"caches": items, "tokens": self.container(data, toks)}})

    def op_decode_step(self, data) -> None:
        """An engine's decode step over its running batch: resize_batch(capacity + 1) for
        every ACTIVE cache, commit_batch of the next token of each that got room, drain."""
        if len(self.caches[0]) < 2 or data.draw(st.integers(0, 3)) == 0:
            self.op_create(data)  # a new request arrives
        for h in range(len(self.caches[0])):  # the scheduler admits waiting requests
            if self.props(h).get("status") == "SUSPENDED" and data.draw(st.booleans()):
                self.run({"op": "resume", "cache": h})
        handles = [h for h in range(len(self.caches[0])) if self.props(h).get("status") == "ACTIVE"]
        if not handles:
            return
        caps = [self.props(h)["capacity"] + data.draw(st.sampled_from([1, 1, 1, self.B])) for h in handles]
        out = self.run({"op": "resize_batch", "args": {"caches": handles, "capacities": self.container(data, caps)}})
        ok = out.get("result") or [False] * len(handles)
        grown = [h for h, good in zip(handles, ok) if good]
        toks = []
        for h in grown:
            nc = self.props(h)["num_committed_tokens"]
            toks.append(self.plans[h][nc] if nc < len(self.plans[h]) else data.draw(token_st))
        if grown:
            self.run({"op": "commit_batch", "args": {"caches": grown, "tokens": self.container(data, toks)}})
        if data.draw(st.integers(0, 2)) > 0:
            self.run({"op": "drain_copy_ops"})
            if self.explicit and self.unsettled and data.draw(st.booleans()):  # an earlier step's copies ended
                self.op_settle_copies(data)

    # ---- forks (issue 22) -------------------------------------------------------------
    def fork(self, h: int, args: dict) -> dict:
        """Run ``fork`` on handle ``h``; a new cache plans its parent's committed tokens
        and a continuation of its own."""
        out = self.run({"op": "fork", "cache": h, "args": args})
        if "result" in out:
            p = self.props(h)
            nc = p["num_committed_tokens"] if isinstance(p["num_committed_tokens"], int) else 0
            self.plans.append(self.plans[h][:nc] + [self.B + 7 + len(self.plans) % 5] + self.plans[h][nc + 1:])
            self.scopes.append(self.scopes[h])
        return out

    def op_fork(self, data) -> None:
        """A fork of any cache (any status, history past the committed tokens, room beyond
        them or not), with an id drawn like create's: fresh, in use, or of a bad type."""
        h = self.pick_handle(data)
        if h is None:
            return
        args: dict = {}
        r = data.draw(st.integers(0, 9))
        if r == 0:
            existing = [self.props(i).get("id") for i in range(len(self.caches[0]))]
            args["id"] = data.draw(st.sampled_from(existing + [1.5, True, None]))
        elif r == 1:
            args["id"] = data.draw(st.sampled_from([200, "f"]))
        self.fork(h, args)

    def op_beam_step(self, data) -> None:
        """Beam search on one request: fork it into a few branches, each resizes by one
        token (the shared partial page is copied on write) and commits a different token;
        some branches are pruned (closed); the step's copy ops are drained by either drain."""
        h = self.pick_handle(data)
        if h is None:
            return
        if self.props(h).get("status") == "SUSPENDED":
            self.run({"op": "resume", "cache": h})
        if self.props(h).get("status") != "ACTIVE":
            return
        beams = [h]
        for _ in range(data.draw(st.integers(1, 3))):
            out = self.fork(h, {})
            if "result" in out:
                beams.append(out["result"])
        for k, b in enumerate(beams):
            p = self.props(b)
            if p.get("status") != "ACTIVE" or not isinstance(p.get("num_committed_tokens"), int):
                continue
            nc = p["num_committed_tokens"]
            if self.run({"op": "resize", "cache": b, "args": {"capacity": max(p["capacity"], nc + 1)}}).get("result"):
                # the parent follows its plan; each branch commits a token of its own
                tokens = self.plans[b][nc:nc + 1] if k == 0 else [k % 6]
                self.run({"op": "commit", "cache": b, "args": {"tokens": tokens or [k % 6]}})
        for b in beams:
            if data.draw(st.integers(0, 2)) == 0:
                self.run({"op": "close", "cache": b})  # pruned
        self.run({"op": data.draw(st.sampled_from(["drain_copy_ops", "drain_copy_runs"]))})

    def op_forget_copies(self, data) -> None:
        """A data plane that failed: report the ops from some position of the last drain
        on (what DataPlane.apply's CopyError lists), a random subset, or bad input."""
        ops = list(self.last_drain)
        kind = data.draw(st.sampled_from(["suffix", "suffix", "subset", "shared", "bad"]))
        if kind == "suffix" and ops:
            ops = ops[data.draw(st.integers(0, len(ops) - 1)):]
        elif kind == "subset" and ops:
            ops = [o for o in ops if data.draw(st.booleans())]
        elif kind == "shared":  # loads from the store that failed (object gone, store down)
            ops = [o for o in ops if o[1] == 3 and data.draw(st.integers(0, 2)) > 0]
        elif kind == "bad":
            bad = data.draw(st.sampled_from([[0, 0, 99, 1, 0, "offload"], [0, 0, 0, 0, 1, "teleport"],
                                             {"value": 3}, {"value": [0, 0, 0, 0, 0, "cow"]}]))
            ops = [*ops[:1], bad]
        self.run({"op": "forget_copies", "args": {"ops": ops}})
        if kind != "bad" and self.ls.records[-1]["outcome"].get("result") is not None:
            for o in ops:
                self.last_drain.remove(o)
                if o[5] == "store":  # a failed write never makes a block look stored
                    self.store.discard((o[6], o[0]))

    def op_settle_copies(self, data) -> None:
        """An engine whose copies run asynchronously learns how the oldest drain in flight
        ended (copy_settlement="explicit"): nothing failed, the ops from some position on
        (a CopyError's), a random subset, failed shared loads, or bad input (an op of a
        newer drain only, an op listed more often than issued, garbage).  With no
        unsettled drain, or in the drain mode, the call is refused (compared too)."""
        if not self.explicit and data.draw(st.integers(0, 3)) > 0:
            self.op_forget_copies(data)  # the drain mode's report (settle_copies is refused there)
            return
        oldest = list(self.unsettled[0]) if self.unsettled else []
        kind = data.draw(st.sampled_from(["none", "none", "suffix", "subset", "shared", "bad"]))
        failed: list = []
        if kind == "suffix" and oldest:
            failed = oldest[data.draw(st.integers(0, len(oldest) - 1)):]
        elif kind == "subset" and oldest:
            failed = [o for o in oldest if data.draw(st.booleans())]
        elif kind == "shared":  # loads from the store that failed (object gone, store down)
            failed = [o for o in oldest if o[1] == 3 and data.draw(st.integers(0, 2)) > 0]
        elif kind == "bad":
            newer = [o for d in self.unsettled[1:] for o in d if o not in oldest]
            choices: list = [[0, 0, 99, 1, 0, "offload"], [0, 0, 0, 0, 1, "teleport"], {"value": 3}, "twice"]
            if newer:
                choices.append(data.draw(st.sampled_from(newer)))
            bad = data.draw(st.sampled_from(choices))
            if bad == "twice":
                failed = oldest[:1] * (oldest.count(oldest[0]) + 1) if oldest else [{"value": None}]
            else:
                failed = [*oldest[:1], bad]
        args = {"failed": failed} if failed or data.draw(st.booleans()) else {}
        out = self.run({"op": "settle_copies", "args": args})
        if "result" in out:
            self.unsettled.pop(0)
            if failed:
                EXPLICIT_FAILURES_SETTLED[0] += 1
            for o in failed:
                if o[5] == "store":  # a failed write never makes a block look stored
                    self.store.discard((o[6], o[0]))

    def op_set_quota(self, data) -> None:
        """Quotas at run time (DECISIONS.md): a configured tier by kind or number, resized
        to 0..12 slot units (grow, shrink below what is held, refusals), or bad input."""
        assert self.config is not None
        rc = resolve_config(self.config)
        per = sum(lc.slot_bytes for lc in rc.life_cycles)
        r = data.draw(st.integers(0, 9))
        if r == 0:
            tier = data.draw(st.sampled_from(["shared", "nvme", 7, -1, True, 1.5, None]))
        elif r < 4:
            tier = data.draw(st.sampled_from(list(rc.tier_ids)))
        else:
            tier = data.draw(st.sampled_from(list(rc.tier_kinds)))
        if data.draw(st.integers(0, 9)) == 0:
            nbytes = data.draw(st.sampled_from([-1, 1.5, "big", True, None, 2**63, 0]))
        else:
            nbytes = data.draw(st.integers(0, 12)) * per + data.draw(st.sampled_from([0, 0, per // 2]))
        self.run({"op": "set_quota", "args": {"tier": tier, "quota_bytes": nbytes}})
        if data.draw(st.integers(0, 2)) > 0:
            self.run({"op": "drain_copy_ops"})

    def op_probe(self, data) -> None:
        args: dict = {}
        args["tokens"] = self.maybe_bad_tokens(data, self.request_tokens(data, args))
        name = data.draw(st.sampled_from(["probe_reuse", "probe_reuse_detail", "shared_candidates"]))
        if name != "shared_candidates":  # a probe with the store's answer, as an engine asks it
            hits = self.shared_hits(data, args["tokens"], args.get("scope"))
            if hits is not None:
                args["shared_hits"] = hits
        self.run({"op": name, "args": args})

    def op_probe_create(self, data) -> None:
        """What a scheduler does with a waiting request (vLLM's connector): probe it, with
        the store's hits when there is a shared tier, then create it with the same tokens,
        scope and hits.  Beyond the lockstep's checks (both sides agree): the probe
        changed nothing (snapshot), the request matched exactly the probe's
        ``num_tokens``, the pages it holds are on exactly the probe's ``block_tiers``
        before it resumes, and a probe that raised means a create that raises the same."""
        probe: dict = {}
        tokens = self.maybe_bad_tokens(data, self.request_tokens(data, probe, turn_odds=2))
        probe["tokens"] = tokens
        hits = self.shared_hits(data, tokens, probe.get("scope"))
        if hits is not None:
            probe["shared_hits"] = hits
        mgr = self.ls.managers[0]
        before = O.normalize(mgr.snapshot())
        got = self.run({"op": "probe_reuse_detail", "args": probe})
        self.check(O.normalize(mgr.snapshot()) == before, "probe_reuse_detail changed the state")
        create = {"input_tokens": tokens, **{k: v for k, v in probe.items() if k != "tokens"}}
        made = self.run({"op": "create_kv_cache", "args": create})
        if "error" in got:
            self.check(made.get("error") == got["error"], f"the probe raised {got['error']}, create gave {made}")
            return
        if "error" in made:  # only the shut-down manager refuses what its probe answered
            self.check(made["error"] == "InvalidStateError", f"the probe answered, create raised {made['error']}")
            return
        base = next((b for b in self.bases if b[: len(tokens)] == tokens), tokens)
        self.plans.append(tokens + base[len(tokens):])
        self.scopes.append(probe.get("scope"))
        m, _mbs, tiers = got["result"]
        kv = self.caches[0][made["result"]]
        self.check(kv.num_committed_tokens == m, f"probe said {m}, create matched {kv.num_committed_tokens}")
        held = held_block_tiers(mgr.snapshot(), self.B)
        self.check(tuple(tiers) == held, f"probe said tiers {tiers}, the request holds pages on {held}")

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
