"""What the differential (parity/test_differential.py) draws: its Hypothesis profile, the
configs (models, tiers, quotas, the shared tier, copy settlement), the arguments (good and
bad), the base sequences prompts share prefixes of, and the counters test_differential
checks were driven."""

from __future__ import annotations

import importlib.util
import os
import tempfile

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer, Tier
from kvcm.config import resolve_config

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
