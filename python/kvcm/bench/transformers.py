"""``python -m kvcm bench transformers``: the multi-turn chat workload through
transformers' continuous batching alone and with kvcm, for a full-attention model (Llama) and a
sliding-window mix (Qwen3 ``layer_types``): prefill tokens computed, tokens reused by tier, wall
time and time to first token (per turn, the first token of a ``generate_batch`` call).
Random-weight tiny models (no hub); ``--plot FILE`` writes a bar chart (matplotlib)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any, Self

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import PagedAttentionCache

from kvcm.integrations.transformers import KvcmContinuousBatching, ModelCacheHook


def model(kind: str):
    torch.manual_seed(0)
    kw = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "vocab_size": 512}
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **kw)).eval()
    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=3, head_dim=16, sliding_window=12, use_sliding_window=True,
                                        max_window_layers=0,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        **kw)).eval()


class _Counting:
    """Counts the tokens transformers' own cache computes (no kvcm) for one model: its
    scheduler reports each scheduled chunk through ``count_new_complete_blocks``; its own
    prefix sharing is what it skips.  The cache class is scoped to the model
    (:class:`~kvcm.integrations.transformers.ModelCacheHook`)."""

    def __init__(self, model: Any) -> None:
        self.tokens = 0
        self.prefill = 0
        counter = self

        class Cache(PagedAttentionCache):
            def count_new_complete_blocks(self, state: Any, request_len: int) -> dict[str, int]:
                counter.tokens += request_len
                if not state.generated_tokens:
                    counter.prefill += request_len
                return super().count_new_complete_blocks(state, request_len)

        self.hook = ModelCacheHook(model, Cache)

    def __enter__(self) -> Self:
        self.hook.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hook.detach()


def workload(m, chats: int, turns: int, num_blocks: int, max_new: int) -> tuple[float, float, list]:
    """Runs the chats (one ``generate_batch`` per turn); returns wall seconds, mean time to
    first token (from the request's creation) and the outputs."""
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    system = [(5 * j + 3) % 500 + 1 for j in range(64)]
    hist = [system + [100 + 7 * i + j for j in range(16)] for i in range(chats)]
    wall, ttfts, outs = 0.0, [], []
    for turn in range(turns):
        cb = ContinuousBatchingConfig(page_size=16, num_blocks=num_blocks, max_batch_tokens=256)
        t0 = time.perf_counter()
        out = m.generate_batch(hist, generation_config=gc, continuous_batching_config=cb, progress_bar=False,
                               record_timestamps=True)
        wall += time.perf_counter() - t0
        ttfts += [o.timestamps[0] - o.created_time for o in out.values()]
        res = [out[f"req_{i}"].generated_tokens for i in range(chats)]
        outs.append(res)
        hist = [h + r + [200 + 3 * turn + i] * 8 for i, (h, r) in enumerate(zip(hist, res))]
    return wall, sum(ttfts) / len(ttfts), outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcm bench transformers", description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=16, help="the gpu cache, in whole-model blocks of 16 tokens")
    ap.add_argument("--host-blocks", type=int, default=8)
    ap.add_argument("--disk-blocks", type=int, default=256)
    ap.add_argument("--plot", default=None, help="write a bar chart here (matplotlib)")
    a = ap.parse_args(argv)
    if a.plot:  # checked before a run of minutes, not after it (README "Exit status")
        try:
            import matplotlib
        except ImportError:
            print(f"{ap.prog}: --plot needs matplotlib: pip install matplotlib (or kvcm[route])", file=sys.stderr)
            raise SystemExit(2) from None
    rows = []
    for kind in ("llama", "qwen3-sliding-mix"):
        m = model(kind)
        with _Counting(m) as c:
            wall, ttft, ref = workload(m, a.chats, a.turns, a.num_blocks, a.max_new)
        rows.append((kind, "transformers", c.prefill, "-", "-", "-", wall, ttft, "(reference)"))
        for label, tiers in (("host", {"host_blocks": a.host_blocks}), ("disk", {"disk_blocks": a.disk_blocks})):
            with tempfile.TemporaryDirectory() as d, KvcmContinuousBatching(m, **tiers, disk_path=d) as kc:
                kwall, kttft, outs = workload(m, a.chats, a.turns, a.num_blocks, a.max_new)
                s = kc.stats()
                B = kc.B
            routes = s["routes"]
            rows.append((kind, f"transformers + kvcm (gpu + {label})", s["prefill_tokens"], s["reused_tokens"],
                         routes.get("host->gpu", 0) * B, routes.get("disk->gpu", 0) * B, kwall, kttft, outs == ref))
    print("| model | engine | prefill tokens computed | prompt tokens reused | reused pages onboarded from host (× page) "
          "| from disk (× page) | wall s | mean TTFT s | same tokens as transformers |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]:.2f} | {r[7]:.3f} | {r[8]} |")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.4))
        short = {"transformers": "alone"}
        # the model on one line, the engine on the next, a long model name split: no label overlaps its neighbour
        labels = [f"{r[0].replace('-', chr(10), 1)}\n{short.get(r[1], r[1].replace('transformers + kvcm (gpu + ', '+kvcm ').rstrip(')'))}"
                  for r in rows]
        total = max(r[2] + (r[3] if isinstance(r[3], int) else 0) for r in rows)  # every prompt token
        computed = [r[2] for r in rows]
        own = [total - r[2] if not isinstance(r[3], int) else 0 for r in rows]
        reused = [r[3] if isinstance(r[3], int) else 0 for r in rows]
        ax.bar(labels, computed, label="prefill tokens computed")
        ax.bar(labels, own, bottom=computed, label="reused by transformers' own prefix sharing")
        ax.bar(labels, reused, bottom=computed, label="reused through kvcm")
        ax.set_ylabel("prompt tokens")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
