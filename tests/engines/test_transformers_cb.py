"""kvcm as the block manager of transformers' continuous batching (issue 23).

Random-weight tiny models built from configs (no hub).  Greedy tokens with kvcm must equal
transformers' own continuous batching and ``model.generate()`` per prompt, on a multi-turn
workload whose later turns reuse earlier ones.  Skipped only when transformers is absent
outside CI (with CI=true a missing transformers fails).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

if os.environ.get("CI") == "true":
    import transformers  # noqa: F401  (CI installs it: a missing one must fail, not skip)
else:
    pytest.importorskip("transformers")

import torch
from kvcm.integrations.transformers import PINS, KvcmContinuousBatching, check_pinned_internals, interface_pins
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

MAX_NEW = 5


def build(kind: str):
    """A random-weight tiny model: ``llama`` / ``qwen3`` (full attention, GQA 4/2), ``qwen3_swa_mix``
    (Qwen3 with ``layer_types`` sliding/full/sliding, window 12), ``gemma3_mix`` (Gemma-3 text:
    sliding, sliding, full; window 12; untied embeddings: with Gemma-3's tied ones the random
    model's tokens do not depend on the earlier tokens' KV, so a wrong reuse would go unseen)."""
    torch.manual_seed(0)
    kw = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 512}
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

    kw["head_dim"] = 16
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
    kw.update(num_hidden_layers=3, sliding_window=12)
    if kind == "qwen3_swa_mix":
        return Qwen3ForCausalLM(Qwen3Config(**kw, use_sliding_window=True, max_window_layers=0, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention"])).eval()
    if kind == "gemma3_mix":
        return Gemma3ForCausalLM(Gemma3TextConfig(**kw, tie_word_embeddings=False, layer_types=[
            "sliding_attention", "sliding_attention", "full_attention"])).eval()
    raise ValueError(kind)


def gen_config(n: int = 1) -> GenerationConfig:
    if n > 1:  # transformers refuses greedy with n > 1: sampling with top_k=1 is the argmax (deterministic)
        return GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0,
                                num_return_sequences=n)
    return GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(num_blocks: int = 64) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=8, num_blocks=num_blocks, max_batch_tokens=64, return_logprobs=True)


def conversations(n: int = 3) -> list[list[int]]:
    """n chats sharing a 16-token system prompt, each with its own first question."""
    system = [(5 * j + 3) % 500 + 1 for j in range(16)]
    return [system + [100 + 7 * i + j for j in range(6)] for i in range(n)]


def run_turns(model, turns: int, num_blocks: int, kc: KvcmContinuousBatching | None = None,
              n: int = 3) -> list[dict]:
    """The multi-turn workload: each turn's prompt is the last prompt, its answer and a new
    question.  Per turn: the prompts, the greedy tokens and their log-probabilities."""
    hist = conversations(n)
    outs = []
    for turn in range(turns):
        out = model.generate_batch(hist, generation_config=gen_config(), continuous_batching_config=cb_config(num_blocks),
                                   progress_bar=False)
        res = [out[f"req_{i}"] for i in range(len(hist))]
        outs.append({"prompts": [list(h) for h in hist], "tokens": [r.generated_tokens for r in res],
                     "logprobs": [r.logprobs for r in res]})
        hist = [h + r.generated_tokens + [200 + 3 * turn + i, 201, 202] for i, (h, r) in enumerate(zip(hist, res))]
    return outs


def reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """``model.generate()`` alone: greedy tokens and the log-probability of each."""
    with torch.no_grad():
        gc = gen_config()
        gc.output_logits = gc.return_dict_in_generate = True
        g = model.generate(torch.tensor([prompt]), generation_config=gc)
    tokens = g.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(g.logits, tokens)]
    return tokens, logprobs


def check_exact(model, outs: list[dict], n: int = 3) -> None:
    """Tokens equal ``generate()``'s; log-probabilities within float32 round-off."""
    for turn in outs:
        for p, toks, lps in zip(turn["prompts"], turn["tokens"], turn["logprobs"]):
            ref_toks, ref_lps = reference(model, p)
            assert toks == ref_toks, f"prompt of {len(p)} tokens"
            assert len(lps) == len(ref_lps)
            assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-5, (lps, ref_lps)  # measured: 4.8e-7


def same_tokens(a: list[dict], b: list[dict]) -> bool:
    return [t["tokens"] for t in a] == [t["tokens"] for t in b]


@pytest.fixture(scope="module")
def built_cache():
    """A paged cache transformers built inside the context (sliding + full groups), for the pins about one."""
    model = build("qwen3_swa_mix")
    with KvcmContinuousBatching(model) as kc:
        model.generate_batch(conversations(1), generation_config=gen_config(), continuous_batching_config=cb_config(),
                             progress_bar=False)
        yield kc._cache


@pytest.mark.parametrize("pin", PINS + interface_pins(), ids=lambda pin: pin.name)
def test_pin_holds(pin, request):
    """Each pin (an internal of transformers with no public alternative, its reason in
    ``pin.why``) and each method of the cache interface kvcm implements, by name: fails
    naming what moved when transformers changes it."""
    assert pin.why
    cache = request.getfixturevalue("built_cache") if pin.built else None
    assert pin.check(cache) is None


def test_block_rows_are_where_transformers_writes(built_cache):
    """The pin ``PagedAttentionCache.cache_tensor``: row ``b`` of ``cache_tensor.view(-1,
    bytes_per_block)`` (what kvcm's data plane copies as block ``b``) is exactly where
    transformers' attention writes the tokens of block ``b``, in every group."""
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    cache = built_cache
    for a in cache.cache_allocators.values():
        rows = cache.cache_tensor.view(-1, a.bytes_per_block)
        b = rows.shape[0] // 2
        a.block_table["pin-probe"] = [b]
        try:
            page = a.tokens_per_page
            # the linear places (a sliding group's too: the pin FullAttentionCacheAllocator.get_write_indices)
            write = torch.tensor(FullAttentionCacheAllocator.get_write_indices(a, "pin-probe", 0, page))
            before = rows.clone()
            kv_heads, head_dim = a.num_key_value_heads, a.head_dim
            for layer in a.layer_indices:
                k = torch.randn(page, kv_heads, head_dim, dtype=a.cache_dtype)
                a.update(k, -k, layer, torch.empty(0, dtype=torch.long), write)
            changed = (rows != before).any(dim=1).nonzero().flatten().tolist()
            assert changed == [b], changed
        finally:
            del a.block_table["pin-probe"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_swa_mix"])
def test_build_batch_processor_mirrors_transformers_factory(kind):
    """The pin ``ContinuousBatchingManager._create_batch_processor`` is a digest of the
    factory ``build_batch_processor`` mirrors; this holds the mirror itself: with
    transformers' own cache class, both build the same parts with the same settings."""
    from kvcm.integrations.transformers import build_batch_processor
    from transformers.generation.continuous_batching import PagedAttentionCache

    model = build(kind)
    theirs, ours = (model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config())
                    for _ in range(2))
    try:
        a, b = theirs._create_batch_processor(), build_batch_processor(ours, PagedAttentionCache)

        def parts(mgr, bp) -> dict:
            sched = bp.scheduler
            return {"cache": type(bp.cache), "scheduler": type(sched), "margin": sched.safety_margin,
                    "max_requests": sched.max_requests_per_batch, "same_cache": sched.cache is bp.cache,
                    "cb": vars(mgr.continuous_batching_config), "prefix_sharing": mgr._use_prefix_sharing,
                    "queues": (bp.input_queue is mgr.input_queue, bp.cancel_queue is mgr.cancel_queue),
                    "router": bp.output_router is mgr.output_router, "status": bp.background_thread_status is
                    mgr.background_thread_status, "async": bp.use_async_batching, "tokens": bp.max_batch_tokens,
                    "geometry": (bp.cache.num_blocks, bp.cache.num_sectors, list(bp.cache.cache_allocators))}

        assert parts(theirs, a) == parts(ours, b)
        ours.batch_processor = b  # as the manager registers it (a persistent manager keeps it) ...
        assert build_batch_processor(ours, PagedAttentionCache) is b  # ... it is reset and kept, as transformers'
    finally:
        theirs.destroy()
        ours.destroy()


def test_a_moved_internal_is_named_and_refused(monkeypatch):
    """The check names the change, and the context refuses to start on it: a cache method's
    parameters, and transformers' processor factory (which build_batch_processor mirrors)."""
    from transformers.generation.continuous_batching import cache as tf_cache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    def search_prefix_match(self, request_id, prompt_ids, scope):  # a new parameter upstream
        return 0

    monkeypatch.setattr(tf_cache.PagedAttentionCache, "search_prefix_match", search_prefix_match)
    problems = check_pinned_internals()
    moved = ("PagedAttentionCache.search_prefix_match takes ('self', 'request_id', 'prompt_ids', 'scope'), "
             "pinned ('self', 'request_id', 'prompt_ids')")
    assert problems == [moved], problems
    assert any("transformers 5.20.0 is not the pinned 5.19.x" in p for p in check_pinned_internals("5.20.0"))
    model = build("llama")
    with pytest.raises(RuntimeError, match="search_prefix_match"), KvcmContinuousBatching(model):
        pass
    assert "init_continuous_batching" not in vars(model)  # refused before the model was touched
    monkeypatch.undo()

    def _create_batch_processor(self):  # transformers' factory changed upstream
        return None

    monkeypatch.setattr(ContinuousBatchingManager, "_create_batch_processor", _create_batch_processor)
    assert len(check_pinned_internals()) == 1
    assert "ContinuousBatchingManager._create_batch_processor changed" in check_pinned_internals()[0]
    with pytest.raises(RuntimeError, match="_create_batch_processor changed"), KvcmContinuousBatching(model):
        pass


def test_a_missing_pinned_attribute_is_named(monkeypatch):
    """The pins about a built cache are checked on every cache built: an allocator without
    ``block_table`` (where kvcm's page indices go) is named."""
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    original = FullAttentionCacheAllocator.register_cache_tensor

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool):
        original(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        del self.block_table  # as if upstream renamed it

    monkeypatch.setattr(FullAttentionCacheAllocator, "register_cache_tensor", register_cache_tensor)
    model = build("llama")
    with KvcmContinuousBatching(model), pytest.raises(RuntimeError, match="internals changed: no attribute "
                                                                     "FullAttentionCacheAllocator.block_table"):
        model.generate_batch(conversations(1), generation_config=gen_config(), continuous_batching_config=cb_config(),
                             progress_bar=False)


@pytest.mark.parametrize("kw", [{"host_blocks": -1}, {"disk_blocks": 1.5}, {"shared_bytes": True},
                                {"disk_blocks": 4}, {"shared_path": ""}])
def test_bad_tier_arguments_are_refused(kw):
    with pytest.raises(ValueError):
        KvcmContinuousBatching(build("llama"), **kw)
    with pytest.raises(TypeError, match="needs a transformers model"):
        KvcmContinuousBatching(object())


@pytest.mark.parametrize("kw,match", [({"cpu_offload_space": 0.01}, "cpu_offload_space"),
                                      ({"use_async_batching": True}, "async batching")])
def test_unsupported_engine_options_are_refused(kw, match):
    model = build("llama")
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64, **kw)
    with KvcmContinuousBatching(model), pytest.raises(ValueError, match=match):
        model.generate_batch(conversations(1), generation_config=gen_config(), continuous_batching_config=cb,
                             progress_bar=False)


def test_geometry_change_in_one_context_is_refused():
    """Reusable pages live in the first cache's tensor: a second cache of another size cannot adopt it."""
    model = build("llama")
    with KvcmContinuousBatching(model):
        model.generate_batch(conversations(1), generation_config=gen_config(), continuous_batching_config=cb_config(64),
                             progress_bar=False)
        with pytest.raises(ValueError, match="geometry"):
            model.generate_batch(conversations(1), generation_config=gen_config(),
                                 continuous_batching_config=cb_config(32), progress_bar=False)


def test_kvcm_is_scoped_to_its_model():
    """Was: a process-wide swap of transformers' cache class, which nested or concurrent
    contexts restored wrongly.  Each context hooks its own model only: nested contexts on two
    models each serve their model, a third model keeps transformers' own cache, nothing of
    transformers changes, and leaving a context restores its model."""
    from transformers.generation.continuous_batching import cache as tf_cache
    from transformers.generation.continuous_batching import continuous_api as tf_api

    a, b, plain = build("llama"), build("qwen3"), build("llama")
    prompts = conversations(2)

    def gen(model):
        out = model.generate_batch(prompts, generation_config=gen_config(), continuous_batching_config=cb_config(),
                                   progress_bar=False)
        return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]

    with KvcmContinuousBatching(a) as ka:
        with KvcmContinuousBatching(b) as kb:
            with pytest.raises(ValueError, match="already hooked"):
                KvcmContinuousBatching(a).__enter__()
            assert gen(b) == [reference(b, p)[0] for p in prompts]
            assert kb.stats()["prompt_tokens"] == sum(len(p) for p in prompts)
        assert "init_continuous_batching" not in vars(b) and kb.mgr is None  # the inner context is gone
        assert gen(a) == [reference(a, p)[0] for p in prompts]
        served = ka.stats()["prompt_tokens"]
        assert served == sum(len(p) for p in prompts)
        assert gen(plain) == gen(a)  # transformers' own cache for the third model ...
        assert ka.stats()["prompt_tokens"] == 2 * served  # ... and kvcm for a again, not for it
        assert tf_api.PagedAttentionCache is tf_cache.PagedAttentionCache
    assert "init_continuous_batching" not in vars(a)


def test_the_cache_drives_kvcm_through_the_offload_seam_only():
    """issue 36 item 2: every request-level call of the paged cache goes through the one
    offload seam (``kc.seam``, kvcm.offload.OffloadManager): no engine-loop or manager call,
    no KVCache call that changes the cache (resize, commit, close, suspend, resume, fork);
    reads of a request's own cache (status, committed tokens, page indices) stay."""
    import ast
    import inspect

    from kvcm.integrations.transformers import KvcmPagedAttentionCache

    changing = {"resize", "commit", "close", "suspend", "resume", "fork", "admit", "sync", "create_kv_cache",
                "drain_copy_runs", "forget_copies", "settle_copies", "stats", "take_events"}
    bypass, seam_calls = [], 0
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(KvcmPagedAttentionCache)))):
        if isinstance(node, ast.Attribute) and node.attr in ("loop", "mgr", "plane", "manager"):
            bypass.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            through_seam = (isinstance(owner, ast.Name) and owner.id == "seam") or (
                isinstance(owner, ast.Attribute) and owner.attr == "seam")
            seam_calls += through_seam
            if node.func.attr in changing and not through_seam:
                bypass.append(f"line {node.lineno}: .{node.func.attr}()")
    assert not bypass, bypass
    assert seam_calls >= 15, seam_calls  # lookup, prepare_load, touch, prepare_store, complete_store, release, ...


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_swa_mix", "gemma3_mix"])
def test_multi_turn_exact_and_reused(kind):
    model = build(kind)
    with KvcmContinuousBatching(model) as kc:
        outs = run_turns(model, 3, 64, kc)
        stats = kc.stats()
    check_exact(model, outs)
    assert stats["reused_tokens"] > 0
    # transformers' own continuous batching (no kvcm) gives the same tokens
    assert same_tokens(run_turns(model, 3, 64), outs)


def test_sliding_mix_shares_what_transformers_does_not():
    """transformers turns prefix sharing off with a sliding layer; through kvcm every chat
    after the first reuses the shared system prompt in the first turn already, and the
    whole conversation in the next."""
    model = build("gemma3_mix")
    with KvcmContinuousBatching(model) as kc:
        outs = run_turns(model, 2, 64, kc)
        stats = kc.stats()
    assert kc.transformers_prefix_sharing is False  # what transformers itself decided for this model
    assert stats["reused_tokens"] >= 16 * 2 + sum(len(p) - 1 for p in outs[0]["prompts"]) - 8 * 3, stats
    check_exact(model, outs)


@pytest.mark.parametrize("kind,tier", [("llama", "host"), ("qwen3_swa_mix", "disk")])
def test_eviction_and_onboarding_are_exact(kind, tier, tmp_path):
    """A gpu tier too small for the workload (12 blocks): reusable pages go to the colder
    tier and come back (onboard) through kvcm's data plane; tokens stay exact."""
    model = build(kind)
    tiers = {"host_blocks": 64} if tier == "host" else {"disk_blocks": 64, "disk_path": str(tmp_path)}
    with KvcmContinuousBatching(model, **tiers) as kc:
        outs = run_turns(model, 3, 12, kc)
        stats = kc.stats()
    check_exact(model, outs)
    routes = stats["routes"]
    assert routes.get(f"gpu->{tier}", 0) > 0 and routes.get(f"{tier}->gpu", 0) > 0, routes
    assert stats["reused_tokens"] > 0


def test_parallel_sampling_forks_share_the_prompt():
    model = build("llama")
    prompts = conversations(2)
    with KvcmContinuousBatching(model) as kc:
        out = model.generate_batch(prompts, generation_config=gen_config(3), continuous_batching_config=cb_config(),
                                   progress_bar=False)
        stats = kc.stats()
    assert stats["forks"] == 4  # two children per prompt
    # the children share the prompt's pages: each computes only the last prompt token, after a
    # copy-on-write of the shared partial page (22 tokens: 2 full pages of 8 and a partial one)
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts) + 4, stats
    assert stats["copies"]["cow"] == 4, stats
    assert len(out) == 6
    for rid, o in out.items():
        i = int(rid.split("_")[1].split("__")[0])
        assert o.generated_tokens == reference(model, prompts[i])[0], rid


@pytest.fixture(params=["file", "mooncake"])
def store(request, tmp_path) -> str:
    """A shared store location: a directory, or a Mooncake Store these tests start on 127.0.0.1."""
    if request.param == "file":
        return str(tmp_path / "store")
    return request.getfixturevalue("fresh_mooncake").url


def test_two_processes_share_a_store(store):
    """A second process reuses the prefixes the first one wrote to the shared store."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = {sys.path!r}
        from test_transformers_cb import build, run_turns, check_exact
        from kvcm.integrations.transformers import KvcmContinuousBatching
        model = build("llama")
        with KvcmContinuousBatching(model, shared_path={store!r}) as kc:
            outs = run_turns(model, 1, 64, kc)
            s = kc.stats()
        check_exact(model, outs)
        print(json.dumps({{"reused": s["reused_tokens"], "loads": s["routes"].get("shared->gpu", 0)}}))
    """)
    env = dict(os.environ)
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                           check=False)
        assert p.returncode == 0, p.stderr[-3000:]
        import json

        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert runs[1]["reused"] > runs[0]["reused"] and runs[1]["loads"] > 0, runs


def test_preemption_suspends_and_resumes_exactly():
    """A gpu tier of 6 blocks for 4 growing chats: transformers preempts a starved request;
    kvcm suspends it (its pages held, offloaded to host) and resumes it at re-admission."""
    model = build("llama")
    with KvcmContinuousBatching(model, host_blocks=64) as kc:
        outs = run_turns(model, 2, 6, kc, n=4)
        stats = kc.stats()
    check_exact(model, outs, n=4)
    assert stats["suspended_requests"] >= 1 and stats["resumed_requests"] >= 1, stats
    assert stats["routes"].get("host->gpu", 0) > 0


def test_persistent_manager_chat_reuses_each_turn():
    """``init_continuous_batching()`` (one engine, one cache, requests added one by one, as
    ``transformers serve`` does): each turn of a chat reuses the previous turn, exactly.  The
    model's tokens depend on the KV this test reuses (untied Gemma-3): another first token
    changes them (it reaches the last position only through the earlier positions' KV; with
    the tied Gemma-3 this test used, it did not), and a last turn after transformers' cache
    tensor was zeroed in place (the pages kvcm hands it) generates other tokens, so a reuse
    of wrong pages would fail here.  kvcm's manager counts each turn's hits."""
    model = build("gemma3_mix")
    prompt = conversations(1)[0]
    assert reference(model, [7] + prompt[1:])[0] != reference(model, prompt)[0]
    with KvcmContinuousBatching(model) as kc:
        mgr = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config())
        mgr.start()

        def turn(i: int) -> list[int]:
            rid = mgr.add_request(prompt, request_id=f"turn{i}", max_new_tokens=MAX_NEW)
            out = mgr.get_result(rid, timeout=120)
            assert out is not None and out.error is None, out
            return out.generated_tokens

        try:
            for i in range(3):
                before = kc.stats().get("kvcm", {}).get("reused_tokens", 0)
                tokens = turn(i)
                assert tokens == reference(model, prompt)[0], i
                if i:  # kvcm's manager matched the previous turn's pages (not only the integration's count)
                    assert kc.stats()["kvcm"]["reused_tokens"] - before == len(prompt) - 2 - 1, (i, kc.stats())
                prompt = prompt + tokens + [300 + i, 301]
            stats = kc.stats()
            kc._cache.cache_tensor.zero_()  # the KV of every page the next turn reuses
            corrupted = turn(3)
        finally:
            mgr.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    # turns 2 and 3 match the previous conversation up to its last generated token (never computed):
    # 22 + 4 tokens, then 29 + 4
    assert stats["reused_tokens"] == 26 + 33, stats
    assert corrupted != reference(model, prompt)[0], corrupted  # the tokens depend on the reused KV


# ---------------------------------------------------------------------------------------
# Failed copies become recomputes (issue 30); the host + disk "drops" explained
# ---------------------------------------------------------------------------------------


class FailOps:
    """A data-plane fault hook (``DataPlane.fault``): the ops ``pick`` selects fail as a disk
    I/O error would (``pick(op, k)``: ``k`` counts the ops of that reason seen so far)."""

    def __init__(self, pick) -> None:
        self.pick = pick
        self.seen: dict[str, int] = {}
        self.failed: list = []

    def __call__(self, op) -> None:
        k = self.seen.get(op.reason, 0)
        self.seen[op.reason] = k + 1
        if self.pick(op, k):
            self.failed.append(op)
            raise OSError(errno.EIO, f"injected failure of {op.reason} op {k}")


@pytest.fixture
def faulty_plane(monkeypatch):
    """Every data plane the integration builds gets the fault hook set here (``holder[0]``)."""
    from kvcm.dataplane import DataPlane
    from kvcm.integrations.transformers import cache as kvcm_tf

    holder: list = [None]

    class FaultyPlane(DataPlane):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fault = holder[0]

    monkeypatch.setattr(kvcm_tf, "DataPlane", FaultyPlane)
    return holder


def test_failed_onboards_and_offloads_are_recomputed_exactly(faulty_plane):
    """Was: a CopyError propagated into transformers' step and failed the batch.  Every other
    onboard (host -> gpu) and every third offload fails: the manager forgets those pages,
    rolls back the requests that used them (being admitted: admitted again from the shorter
    match; preempted: resumed from it at re-admission), and every generated token equals
    transformers without kvcm and ``generate()``."""
    model = build("llama")
    faulty_plane[0] = inj = FailOps(lambda op, k: (op.reason == "onboard" and k % 2 == 0)
                                    or (op.reason == "offload" and k % 3 == 1))
    with KvcmContinuousBatching(model, host_blocks=64) as kc:
        outs = run_turns(model, 3, 6, kc, n=4)
        stats = kc.stats()
    assert {op.reason for op in inj.failed} == {"onboard", "offload"}, inj.seen
    assert stats["copy_failures"] >= 2 and stats["rollbacks"] >= 1, stats
    check_exact(model, outs, n=4)
    assert same_tokens(run_turns(model, 3, 6, n=4), outs)


def test_a_failed_copy_on_write_at_a_fork_hands_the_child_back(faulty_plane):
    """Parallel sampling: forking copies the parent's partial last page for each child
    (``cow``); those copies fail for the first prompt's two children, which the manager rolls
    back to the prompt's last full block.  The fork gives transformers no child of that
    prompt, so it queues them as new requests; each is admitted again by resuming its kvcm
    request (16 of 22 prompt tokens) and recomputes the rest: every sequence equals
    ``generate()``."""
    model = build("llama")
    prompts = conversations(2)
    faulty_plane[0] = inj = FailOps(lambda op, k: op.reason == "cow" and k < 2)
    with KvcmContinuousBatching(model) as kc:
        out = model.generate_batch(prompts, generation_config=gen_config(3), continuous_batching_config=cb_config(),
                                   progress_bar=False)
        stats = kc.stats()
    assert len(inj.failed) == 2 and stats["copy_failures"] == 1 and stats["rollbacks"] == 2, (inj.seen, stats)
    assert stats["resumed_requests"] == 2 and stats["forks"] == 4, stats
    # two prompts, then the two children handed back recompute 22 - 16 tokens each
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts) + 2 + 2 * (22 - 16), stats
    assert len(out) == 6
    for rid, o in out.items():
        assert o.error is None, (rid, o.error)
        i = int(rid.split("_")[1].split("__")[0])
        assert o.generated_tokens == reference(model, prompts[i])[0], rid


def test_a_truncated_disk_pool_file_is_recomputed_exactly(tmp_path):
    """The disk tier's pool files are cut to nothing before the fourth turn (from outside, as
    a failing disk would leave them) while pages of the third sit on disk: their onboards are
    short reads (EIO), the requests being admitted are matched again without them and
    recompute; the sliding + full mix generates what transformers alone does."""
    model = build("qwen3_swa_mix")
    hist = conversations(3)
    outs = []
    with KvcmContinuousBatching(model, disk_blocks=64, disk_path=str(tmp_path)) as kc:
        for turn in range(4):
            if turn == 3:
                files = sorted(tmp_path.glob("kvcm-pool-*.bin"))
                assert files and kc.stats()["routes"].get("gpu->disk", 0) > 0
                for f in files:
                    os.truncate(f, 0)
            out = model.generate_batch(hist, generation_config=gen_config(), continuous_batching_config=cb_config(12),
                                       progress_bar=False)
            res = [out[f"req_{i}"] for i in range(len(hist))]
            assert all(r.error is None for r in res), [r.error for r in res]
            outs.append({"prompts": [list(h) for h in hist], "tokens": [r.generated_tokens for r in res],
                         "logprobs": [r.logprobs for r in res]})
            hist = [h + r.generated_tokens + [200 + 3 * turn + i, 201, 202] for i, (h, r) in enumerate(zip(hist, res))]
        stats = kc.stats()
        error = kc.loop.last_error
    assert stats["copy_failures"] >= 1 and stats["rollbacks"] >= 1, stats
    assert isinstance(error.cause, OSError) and {op.reason for op in error.ops} == {"onboard"}, error
    check_exact(model, outs)
    assert same_tokens(run_turns(model, 4, 12), outs)


def test_host_pages_that_vanish_with_a_disk_tier_are_replaced_partial_blocks(tmp_path):
    """Seen: with host and disk tiers, pages left the host tier without a host -> disk move.
    They are not eviction victims: each is a partial block (a finished request's tail) that
    the next turn's commit of the full block replaces (SPEC sec. 5), removed wherever it is
    and counted in ``drops``, on any tiers.  A host tier that must evict moves its victims
    to disk."""
    from kvcm.api import RemovedEvent, StoredEvent

    model = build("llama")
    seen = {}
    for host in (4, 1):
        with KvcmContinuousBatching(model, host_blocks=host, disk_blocks=64, disk_path=str(tmp_path / str(host))) as kc:
            outs = run_turns(model, 3, 12, kc)
            events = kc.seam.take_events()
            stats = kc.seam.stats()
            routes = dict(kc.plane.routes)
        check_exact(model, outs)
        partial = {(b.key, b.lc): e.partial for e in events if isinstance(e, StoredEvent) for b in e.blocks}
        removed = [(k, e.lc) for e in events if isinstance(e, RemovedEvent) for k in e.keys]
        assert stats["events_dropped"] == 0 and removed and all(partial[r] for r in removed), removed
        assert sum(lc["drops"] for lc in stats["lc"]) == len(removed), stats["lc"]
        seen[host] = (routes, len(removed))
    (four, dropped4), (one, dropped1) = seen[4], seen[1]
    assert four.get("gpu->host", 0) > 0 and "host->disk" not in four, four  # the host tier never had to evict
    assert one.get("host->disk", 0) > 0, one  # with one host page per lc its victims go to disk
    assert dropped4 == dropped1


def test_bench_plot_without_matplotlib_fails_before_the_run(tmp_path) -> None:
    """The README's bench command with ``--plot`` and no matplotlib: one line, exit 2, at once
    (it used to run the whole benchmark, then stop in a traceback)."""
    from children import child_env

    hide = ("import sys, runpy\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'matplotlib':\n"
            "            raise ImportError(name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "sys.argv = ['bench', '--plot', sys.argv[1]]\n"
            "runpy.run_module('kvcm.bench.transformers', run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", hide, str(tmp_path / "b.png")], capture_output=True, text=True,
                       env=child_env(), timeout=300, check=False)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.strip() == "python -m kvcm bench transformers: --plot needs matplotlib: pip install matplotlib (or kvcm[route])", p.stderr
