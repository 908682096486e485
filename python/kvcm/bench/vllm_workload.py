"""Workloads through a real vLLM engine, with or without kvcm (the tests and ``python -m kvcm
bench vllm`` share them): a multi-turn chat, or (``kind: long``) long documents asked several
questions each.  Per phase: the greedy outputs, each request's TTFT and decode seconds per
output token (vLLM's request metrics) and prefill tokens computed, the whole-block prefill
floor (:class:`PrefillFloor`), wall seconds, the 1-minute load average before and after.
No hub: the model is a random-weight Llama saved from a transformers config, prompts are
token ids (``skip_tokenizer_init``).

Run as ``python -m kvcm.bench.vllm_workload SPEC.json OUT.json``: one engine (one
process, vLLM spawns its engine core), several phases, each a workload, optionally after a
``reset_prefix_cache`` (vLLM's cache and kvcm's local tiers) or with a fault mode written to
a control file (the tests' fault store reads it).  A phase with ``abort`` drives the engine
step by step and aborts some requests shortly after adding them (their loads or saves in
flight).  With the connector's ``stats_file``, each phase ends once the connector reports
nothing in flight (its saves finish after the outputs are returned), so the phase's stats
are final; a phase with ``settle_s`` then waits that long (store calls the connector gave up
on at their deadline may still be running on their threads: a hung store's).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from typing import Any

MODEL_DEFAULTS = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                  "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                  "initializer_range": 0.2}


def make_model(path: str, seed: int = 20261201, kind: str = "llama", dtype: str = "float32", **overrides: Any) -> str:
    """A random-weight model saved under ``path`` (reused when it is there already), its
    weights in ``dtype`` (``bfloat16``: what vLLM's ``auto`` runs, loaded without a cast):
    ``llama`` (full attention), ``gemma3`` (sliding-window layers then a full-attention one,
    Gemma-3's text model; pass ``tie_word_embeddings=False``, else a random model only echoes
    the prompt's last token and an exactness check on it cannot fail) or ``mistral`` (every
    layer a sliding window of 64 tokens)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    torch.manual_seed(seed)
    args = {**MODEL_DEFAULTS, **overrides}
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**args, torch_dtype="float32"))
    elif kind == "gemma3":
        args.update(head_dim=args["hidden_size"] // args["num_attention_heads"], sliding_window=64,
                    layer_types=["sliding_attention"] * (args["num_hidden_layers"] - 1) + ["full_attention"])
        args.setdefault("query_pre_attn_scalar", args["head_dim"])
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**args, torch_dtype="float32"))
    elif kind == "mistral":
        args.setdefault("sliding_window", 64)
        args.setdefault("head_dim", args["hidden_size"] // args["num_attention_heads"])
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**args, torch_dtype="float32"))
    else:
        raise ValueError(f"unknown model kind {kind!r}: llama, gemma3 or mistral")
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
    model.save_pretrained(path)
    return path


def save_tokenizer(path: str, vocab_size: int = MODEL_DEFAULTS["vocab_size"]) -> str:
    """A word-level tokenizer saved beside a random-weight model, so a server that needs one
    (vLLM's OpenAI server) starts on it: token ``i`` is the word ``t<i>`` (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
    return path


def conversations(n: int, system_len: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(system_len)]
    return [list(system) for _ in range(n)]


class PrefillFloor:
    """The whole-block prefill floor of a workload: what a cache that forgets nothing leaves.

    A prompt can reuse its leading whole blocks that some earlier request computed (its prompt
    and its output but the last token, which is sampled, never fed back), at most the blocks
    of ``len - 1`` tokens (vLLM computes a prompt's last token in any case).  Requests are
    counted in submission order, a request's prompt blocks visible to the requests submitted
    after it in the same batch (vLLM registers a block's hash when it schedules it), so the
    floor is a lower bound for every order the engine may pick."""

    def __init__(self, block_size: int) -> None:
        self.block = block_size
        self.seen: set[bytes] = set()
        self.tokens = 0  # prefill tokens at the floor so far
        # below the whole-block floor (partial_tail): a hit may end inside a block, on the
        # longest common leading run with a block (full, or a sequence's partial tail) some
        # earlier sequence has at that place; ``partial_tokens`` is that floor's prefill
        self.partial_tokens = 0
        self.next: dict[bytes, set[tuple[int, ...]]] = {}  # the key of i blocks -> blocks i seen after it

    def _keys(self, tokens: list[int]) -> list[bytes]:
        keys, h = [], hashlib.blake2b(digest_size=16)
        for i in range(len(tokens) // self.block):
            h.update(b"".join(t.to_bytes(4, "little") for t in tokens[i * self.block:(i + 1) * self.block]))
            keys.append(h.copy().digest())  # a chain: a block's key names its whole prefix
        return keys

    def submit(self, prompt: list[int]) -> None:
        keys = self._keys(prompt)
        hit = 0
        for k in keys[:(len(prompt) - 1) // self.block]:
            if k not in self.seen:
                break
            hit += 1
        self.tokens += len(prompt) - hit * self.block
        B, start = self.block, hit * self.block
        rest = prompt[start:min(start + B, len(prompt) - 1)]
        run = 0
        for seen in self.next.get(keys[hit - 1] if hit else b"", ()):
            n = next((i for i, (a, b) in enumerate(zip(rest, seen)) if a != b), min(len(rest), len(seen)))
            run = max(run, n)
        self.partial_tokens += len(prompt) - start - run
        self._add(prompt, keys)

    def finish(self, prompt: list[int], output: list[int]) -> None:
        seq = prompt + output[:-1]
        keys = self._keys(seq)
        self.seen.update(keys)
        self._add(seq, keys)

    def _add(self, tokens: list[int], keys: list[bytes]) -> None:
        self.seen.update(keys)
        B = self.block
        for i in range(-(-len(tokens) // B)):
            self.next.setdefault(keys[i - 1] if i else b"", set()).add(tuple(tokens[i * B:(i + 1) * B]))


def _request_metrics(r: Any, submitted: float) -> tuple[float, float | None]:
    """TTFT (seconds from arrival: vLLM's ``first_token_latency``; the time since the batch was
    submitted where vLLM gave none) and decode seconds per output token after the first
    (engine-core timestamps of the first and last token; None for a single-token output)."""
    m = getattr(r, "metrics", None)
    ft = getattr(m, "first_token_latency", None)
    n = getattr(m, "num_generation_tokens", 0)
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    decode = (last - first) / (n - 1) if n > 1 and last > first else None
    return (ft if ft else time.perf_counter() - submitted), decode


class _Recorder:
    """What a workload measures, request by request, in submission order (the prompts too)."""

    def __init__(self, block_size: int) -> None:
        self.ttft: list[float] = []
        self.decode: list[float] = []
        self.prefill: list[int] = []
        self.prompts: list[list[int]] = []
        self.cached = self.prompt_tokens = 0
        self.floor = PrefillFloor(block_size)
        self.load_before = os.getloadavg()

    def generate(self, llm: Any, prompts: list[list[int]], sampling: Any) -> list[list[int]]:
        from vllm.inputs import TokensPrompt

        for p in prompts:
            self.floor.submit(p)
            self.prompts.append(list(p))
        s = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False)
        outs = []
        for p, r in zip(prompts, res, strict=True):
            ttft, decode = _request_metrics(r, s)
            self.ttft.append(ttft)
            if decode is not None:
                self.decode.append(decode)
            cached = r.num_cached_tokens or 0
            self.cached += cached
            self.prompt_tokens += len(r.prompt_token_ids)
            self.prefill.append(len(r.prompt_token_ids) - cached)
            out = list(r.outputs[0].token_ids)
            self.floor.finish(p, out)
            outs.append(out)
        return outs

    def figures(self) -> dict:
        return {"ttft": self.ttft, "decode": self.decode, "prefill": self.prefill, "cached_tokens": self.cached,
                "prompt_tokens": self.prompt_tokens, "floor_prefill_tokens": self.floor.tokens,
                "partial_floor_prefill_tokens": self.floor.partial_tokens,
                "loadavg_before": self.load_before, "loadavg_after": os.getloadavg(), "prompts": self.prompts}


def run_documents(llm: Any, spec: dict, sampling: Any) -> dict:
    """Long context: ``documents`` documents of ``doc_len`` tokens, ``questions`` questions of
    ``question_len`` tokens each; a prompt is its document followed by one question (no
    history).  Round ``q`` asks every document its ``q``-th question, so a document comes back
    after all the others: a cache smaller than the documents forgets it in between (LRU).
    ``batch`` prompts of a round are submitted together (default: the whole round)."""
    vocab = spec.get("vocab", MODEL_DEFAULTS["vocab_size"])
    rng = random.Random(spec.get("seed", 0))
    docs = [[rng.randrange(1, vocab) for _ in range(spec["doc_len"])] for _ in range(spec["documents"])]
    rec = _Recorder(spec.get("block_size", 32))
    batch = spec.get("batch") or len(docs)
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for _ in range(spec["questions"]):
        prompts = [d + [rng.randrange(1, vocab) for _ in range(spec["question_len"])] for d in docs]
        for i in range(0, len(prompts), batch):
            outputs += rec.generate(llm, prompts[i:i + batch], sampling)
    return {"outputs": outputs, **rec.figures(), "seconds": time.perf_counter() - t0}


def run_turns(llm: Any, spec: dict, sampling: Any) -> dict:
    """The phase's workload: ``kind: long`` is :func:`run_documents`; a chat (the default) is
    ``turns`` rounds over ``conversations`` chats: each round every chat gets a new user
    message, the whole history is the prompt, the reply is appended.  ``batch`` prompts of a
    round are submitted together (default: the whole round)."""
    if spec.get("kind", "chat") == "long":
        return run_documents(llm, spec, sampling)
    vocab = spec.get("vocab", MODEL_DEFAULTS["vocab_size"])
    rng = random.Random(spec.get("seed", 0) + 1)
    chats = conversations(spec["conversations"], spec["system_len"], spec.get("seed", 0), vocab)
    rec = _Recorder(spec.get("block_size", 32))
    batch = spec.get("batch") or len(chats)
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for _ in range(spec["turns"]):
        for c in chats:
            c += [rng.randrange(1, vocab) for _ in range(spec["user_len"])]
        turn: list[list[int]] = []
        for i in range(0, len(chats), batch):
            turn += rec.generate(llm, chats[i:i + batch], sampling)
        for c, out in zip(chats, turn, strict=True):
            outputs.append(out)
            c += out
    return {"outputs": outputs, **rec.figures(),
            "seconds": time.perf_counter() - t0}


def run_aborts(llm: Any, spec: dict, sampling: Any, abort: dict) -> dict:
    """One turn of ``spec``'s chats through the engine directly: every request added, then
    after ``abort["after_steps"]`` engine steps the requests ``abort["ids"]`` (indexes) are
    aborted.  The other requests' outputs are returned in order (the aborted ones as None),
    with ``aborted_done_first``: how many of the aborted requests had finished before the abort
    (a test of aborts with transfers in flight wants 0: each abort landed on a live request).

    ``abort["anchor"]`` (a number of tokens to decode): an unrelated request is added first and
    stepped until it decodes, so the chats arrive at a busy engine — every step has a forward
    (nothing waits for loads in a step) and kvcm's ``auto`` load mode makes every load
    asynchronous.  Without it, whether the chats arrive in the engine core's first schedule
    together or one by one decides which loads are synchronous and how long that step waits."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = spec.get("vocab", MODEL_DEFAULTS["vocab_size"])
    rng = random.Random(spec.get("seed", 0) + 1)
    chats = conversations(spec["conversations"], spec["system_len"], spec.get("seed", 0), vocab)
    for c in chats:
        c += [rng.randrange(1, vocab) for _ in range(spec["user_len"])]
    engine = llm.llm_engine
    ids = [f"abort-{i}" for i in range(len(chats))]
    t0 = time.perf_counter()
    if abort.get("anchor"):  # a prompt of less than a block: no lookup, no load
        anchor = [rng.randrange(1, vocab) for _ in range(8)]
        engine.add_request("abort-anchor", TokensPrompt(prompt_token_ids=anchor),
                           SamplingParams(temperature=0.0, max_tokens=abort["anchor"], ignore_eos=True))
        while not any(r.request_id == "abort-anchor" and r.outputs[0].token_ids for r in engine.step()):
            pass
    for rid, c in zip(ids, chats, strict=True):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(c)), sampling)
    out: dict[str, list[int]] = {}
    steps = 0
    done_first = len(abort["ids"])  # none aborted yet
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished and r.request_id in ids:
                out[r.request_id] = list(r.outputs[0].token_ids)
        steps += 1
        if steps == abort.get("after_steps", 1):
            done_first = sum(ids[i] in out for i in abort["ids"])
            engine.abort_request([ids[i] for i in abort["ids"]])
    aborted = {ids[i] for i in abort["ids"]}
    return {"outputs": [None if rid in aborted else out.get(rid) for rid in ids], "ttft": [], "cached_tokens": 0,
            "prompt_tokens": 0, "seconds": time.perf_counter() - t0, "aborted_done_first": done_first}


def _wait_idle(path: str | None, timeout_s: float = 60.0) -> None:
    """Until the connector's stats file shows nothing open or in flight (or ``timeout_s``)."""
    if path is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = _read(path)
        pending = (data or {}).get("pending")
        if pending is not None and not any(pending.values()):
            return
        time.sleep(0.05)


def _reset(llm: Any, timeout_s: float = 60.0, connector: bool = True) -> None:
    """``reset_prefix_cache`` succeeds once no request holds blocks (a finished request's
    blocks are held while its saves are in flight): retried until then.  ``connector``:
    kvcm drops what it holds too (else only vLLM's cache empties: every hit is kvcm's)."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache(reset_connector=connector):
        if time.monotonic() > deadline:
            raise RuntimeError("reset_prefix_cache kept failing: blocks still held")
        time.sleep(0.05)


def _prometheus() -> list[str]:
    """The ``kvcm:`` lines of this process's Prometheus registry (vLLM's metrics)."""
    try:
        import prometheus_client
    except ImportError:
        return []
    text = prometheus_client.generate_latest().decode()
    return [line for line in text.splitlines() if line.startswith("kvcm:")]


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {"model": spec["model"], "skip_tokenizer_init": True, "dtype": "float32",
                          "block_size": spec.get("block_size", 32), "num_gpu_blocks_override": spec["gpu_blocks"],
                          "max_model_len": spec.get("max_model_len") or (spec["gpu_blocks"] - 1) * spec.get("block_size", 32), "enforce_eager": True,
                          "max_num_seqs": spec.get("max_num_seqs", 4), "seed": 0,
                          "disable_log_stats": False,  # RequestOutput.metrics: TTFT
                          "max_num_batched_tokens": spec.get("max_num_batched_tokens", 2048),
                          "kv_cache_memory_bytes": spec.get("kv_cache_memory_bytes", 64 << 20)}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = spec["connector"]
    kw.update(spec.get("llm", {}))  # more engine arguments (e.g. disable_hybrid_kv_cache_manager)
    if kw["num_gpu_blocks_override"] is None:  # vLLM's cache sized by kv_cache_memory_bytes alone
        del kw["num_gpu_blocks_override"]
    if spec.get("tensor_parallel_size", 1) > 1:
        kw["tensor_parallel_size"] = spec["tensor_parallel_size"]
    if spec.get("kv_events") is not None:  # vLLM's own KV-event publisher (kvcm's tier events ride on it)
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    t = time.perf_counter()
    llm = LLM(**kw)
    result: dict[str, Any] = {"start_seconds": time.perf_counter() - t, "phases": []}
    sampling = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    stats_file = (spec.get("connector") or {}).get("kv_connector_extra_config", {}).get("stats_file")
    for phase in spec["phases"]:
        if phase.get("reset"):  # True: vLLM's cache and kvcm's; "vllm": vLLM's only
            _reset(llm, connector=phase["reset"] != "vllm")
        if spec.get("fault_file"):
            with open(spec["fault_file"], "w") as f:
                f.write(phase.get("fault", ""))
        for path in phase.get("truncate", []):  # a disk fault: kvcm's disk pool files cut short
            for name in os.listdir(path):
                if name.startswith("kvcm-pool-"):
                    os.truncate(os.path.join(path, name), 0)
        before = _read(stats_file)
        work = {**spec["workload"], **phase.get("workload", {})}
        sp = sampling if "max_tokens" not in phase else SamplingParams(temperature=0.0, max_tokens=phase["max_tokens"],
                                                                      ignore_eos=True)
        r = run_aborts(llm, work, sp, phase["abort"]) if phase.get("abort") else run_turns(llm, work, sp)
        _wait_idle(stats_file)
        time.sleep(phase.get("settle_s", 0))
        r["name"] = phase["name"]
        r["stats_before"], r["stats"] = before, _read(stats_file)
        result["phases"].append(r)
        with open(out_path, "w") as f:  # after every phase: a crash later keeps what ran
            json.dump(result, f)
    if stats_file is not None:
        # a last one-token request: vLLM hands the frontend the scheduler's stats with a step's
        # outputs, and the steps that drained kvcm's transfers had none (its gauges' last value)
        from vllm.inputs import TokensPrompt

        llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
    result["prometheus"] = _prometheus()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def _read(path: str | None) -> Any:
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
