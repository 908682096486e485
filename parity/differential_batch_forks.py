"""The differential machine's ops (parity/test_differential.py): the batched decode step (resize_batch /
commit_batch over lists, arrays, numpy and torch containers, with bad batches), forks and
beam steps. A mixin of
``DifferentialMachine``."""

from __future__ import annotations

from hypothesis import strategies as st

from parity.differential_draws import (
    BAD_TOKENS,
    DIGESTS,
    HAVE_TORCH,
    token_st,
)


class BatchForkOps:
    """Ops of ``DifferentialMachine`` (a mixin; ``self`` is the machine)."""

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
