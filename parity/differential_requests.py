"""The differential machine's ops (parity/test_differential.py): the request life cycle: create (with the
store's hits), resume, suspend, resize, commit, the engine-like step and its preemption,
stop_committing, close, page_indices. A mixin of
``DifferentialMachine``."""

from __future__ import annotations

from hypothesis import strategies as st
from kvcm.keys import block_keys_py
from kvcm.oplog import ops as O

from parity.differential_draws import (
    BAD_PRIORITIES,
    PRIORITIES,
    token_st,
)


class RequestOps:
    """Ops of ``DifferentialMachine`` (a mixin; ``self`` is the machine)."""

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
        elif data.draw(st.integers(0, 2)) == 0:  # a range of ordinals (in, at and past the ends)
            a = data.draw(st.sampled_from([0, 0, 1, 2, -1, "0"]))
            b = data.draw(st.sampled_from([None, None, 1, 2, 3, 0, 10**6, 1.0]))
            self.run({"op": "page_indices", "cache": h, "args": {"lc": lc, "start": a, "stop": b}})
        else:
            self.run({"op": "page_indices", "cache": h, "args": {"lc": lc}})
