"""The differential machine's ops (parity/test_differential.py): failed copies (forget_copies), explicit
settlement (settle_copies), quotas at run time (set_quota) and the side-effect-free probes
checked against what create takes. A mixin of
``DifferentialMachine``."""

from __future__ import annotations

from hypothesis import strategies as st
from kvcm.config import resolve_config
from kvcm.oplog import ops as O

from parity.differential_draws import (
    EXPLICIT_FAILURES_SETTLED,
)
from parity.helpers import held_block_tiers


class CopyQuotaOps:
    """Ops of ``DifferentialMachine`` (a mixin; ``self`` is the machine)."""

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
