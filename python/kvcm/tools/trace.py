"""Request traces for replays and benchmarks.

The package ships one workload: the synthetic trace of the Mooncake FAST'25 trace release
(``kvcache-ai/Mooncake``, ``FAST25-release/traces/synthetic_trace.jsonl``, Apache-2.0; see
``kvcm/data/LICENSE-mooncake-trace.md``), stored gzipped as
``kvcm/data/mooncake_synthetic_trace.jsonl.gz``.  3,993 requests, ~61.2M prompt tokens.

Trace format (one JSON object per line): ``timestamp`` (ms, a finite number, optional),
``input_length`` (prompt tokens, an integer >= 0), ``output_length`` (generated tokens, an
integer >= 0, optional), ``hash_ids`` (a list of integers >= 0, one per 512-token prompt
block, covering ``input_length``; equal ids at equal positions mean a shared prefix).
Anything else (``5.7`` or ``true`` as a length, a string of hash ids, a truncated
``.gz``) is rejected by :func:`load_trace` with a ValueError naming file, line and field.

Token expansion (the rule of the trace's README, so every block size sees the same sharing):

* **prompt**: hash id ``h`` expands to 512 tokens, token ``j`` being ``(h * 512 + j) % 2**31``;
  the expansions of a request's hash ids are concatenated and cut to ``input_length``.
  Two prompts share exactly the token prefix their hash ids share (different ids differ at
  their first token as long as ids are below ``2**22``).
* **outputs**: output token ``k`` of the request at index ``i`` (its 0-based line number) is
  ``2**30 + (i * 4096 + k) % 2**30``.  The first output token, ``2**30 + i * 4096`` (for
  ``i < 2**18``), is unique per request, so outputs never create false sharing between
  requests; and outputs live in ``[2**30, 2**31)`` while prompt tokens of hash ids below
  ``2**21`` (the shipped trace's largest id is 43,923) live in ``[0, 2**30)``, so an output
  token never continues another request's prompt either.

Requests are kept as metadata only (hash ids, lengths); token lists are built lazily, one
request at a time, so replaying the whole trace never holds all prompts in memory.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources

HASH_BLOCK_TOKENS = 512
TOKEN_SPACE = 2**31
OUTPUT_BASE = 2**30
OUTPUT_SPAN = 2**30
OUTPUT_STRIDE = 4096

SHIPPED_TRACE = "mooncake_synthetic_trace.jsonl.gz"


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (metadata only; see :func:`expand_prompt`)."""

    index: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def num_prompt_blocks(self, tokens_per_block: int) -> int:
        """Blocks of ``tokens_per_block`` the prompt spans (the last one partial)."""
        return -(-self.input_length // tokens_per_block)


def shipped_trace_path() -> str:
    """Filesystem path of the shipped trace (inside the installed package)."""
    return str(resources.files("kvcm").joinpath("data", SHIPPED_TRACE))


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _lines(f: Iterable[str], source: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a text stream; a stream that cannot be read to its end
    (a truncated or corrupt ``.gz``, bytes that are not UTF-8) raises ValueError naming
    the file and the line where reading stopped."""
    lineno = 0
    it = iter(f)
    while True:
        try:
            line = next(it)
        except StopIteration:
            return
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise ValueError(f"{source}:{lineno + 1}: truncated or corrupt gzip data ({e})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}:{lineno + 1}: not UTF-8 text ({e.reason})") from None
        lineno += 1
        yield lineno, line


def _count(obj: dict, name: str, where: str, default: int | None = None) -> int:
    """A length field: a JSON integer >= 0 (not a bool, not a float such as 5.7 or 1e400)."""
    if name not in obj and default is not None:
        return default
    if name not in obj:
        raise ValueError(f"{where}: {name}: missing")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {name}: must be an integer >= 0, got {json.dumps(v)}")  # noqa: TRY004 - a malformed trace is a ValueError
    if v < 0:
        raise ValueError(f"{where}: {name}: must be an integer >= 0, got {v}")
    return v


def _record(obj: object, where: str) -> tuple[tuple[int, ...], int, int, float]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a trace record (a JSON object), got {json.dumps(obj)[:40]}")  # noqa: TRY004 - a malformed trace is a ValueError
    if "hash_ids" not in obj:
        raise ValueError(f"{where}: hash_ids: missing")
    raw = obj["hash_ids"]
    if not isinstance(raw, list):
        raise ValueError(f"{where}: hash_ids: must be a list of integers >= 0, got {json.dumps(raw)[:40]}")  # noqa: TRY004 - a malformed trace is a ValueError
    for i, h in enumerate(raw):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"{where}: hash_ids[{i}]: must be an integer >= 0, got {json.dumps(h)[:40]}")
    input_length = _count(obj, "input_length", where)
    output_length = _count(obj, "output_length", where, default=0)
    ts = obj.get("timestamp", 0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError(f"{where}: timestamp: must be a finite number, got {json.dumps(ts)[:40]}")
    return tuple(raw), input_length, output_length, float(ts)


def _parse(lines: Iterable[str], source: str) -> list[TraceRequest]:
    """Records of a trace; the first malformed one raises ValueError with one line naming
    the file, the line and the field (``trace.jsonl:3: input_length: must be an integer
    >= 0, got 5.7``)."""
    out: list[TraceRequest] = []
    for lineno, line in _lines(lines, source):
        line = line.strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{where}: JSON nested too deeply") from None
        except ValueError as e:  # e.g. an integer literal past Python's digit limit
            raise ValueError(f"{where}: not a trace record ({e})") from None
        hash_ids, input_length, output_length, timestamp = _record(obj, where)
        if len(hash_ids) * HASH_BLOCK_TOKENS < input_length:
            raise ValueError(
                f"{where}: input_length: {len(hash_ids)} hash ids cover only "
                f"{len(hash_ids) * HASH_BLOCK_TOKENS} of {input_length} input tokens"
            )
        out.append(TraceRequest(len(out), timestamp, input_length, output_length, hash_ids))
    return out


def load_trace(path: str | os.PathLike | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace: the shipped Mooncake synthetic trace when ``path`` is None, else a
    ``.jsonl`` or ``.jsonl.gz`` file.  ``limit`` keeps only the first ``limit`` requests."""
    if path is None:
        ref = resources.files("kvcm").joinpath("data", SHIPPED_TRACE)
        with ref.open("rb") as raw, io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8") as f:
            reqs = _parse(f, SHIPPED_TRACE)
    else:
        path = os.fspath(path)
        with _open_text(path) as f:
            reqs = _parse(f, path)
    return reqs if limit is None else reqs[: max(0, limit)]


def expand_prompt(req: TraceRequest | dict) -> list[int]:
    """The prompt tokens of ``req``: hash id ``h`` → ``(h*512 + j) % 2**31`` for
    ``j`` in 0..511, concatenated and cut to ``input_length``."""
    if isinstance(req, dict):
        hash_ids, n = req["hash_ids"], int(req["input_length"])
    else:
        hash_ids, n = req.hash_ids, req.input_length
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= n:
            break
        start = h * HASH_BLOCK_TOKENS
        if 0 <= start and start + HASH_BLOCK_TOKENS <= TOKEN_SPACE:
            out.extend(range(start, start + HASH_BLOCK_TOKENS))  # the common case: no wrap
        else:
            out.extend((start + j) % TOKEN_SPACE for j in range(HASH_BLOCK_TOKENS))
    del out[n:]
    return out


def expand_outputs(index: int, n: int) -> list[int]:
    """``n`` output tokens of the request at trace index ``index`` (see module doc)."""
    base = index * OUTPUT_STRIDE
    return [OUTPUT_BASE + (base + k) % OUTPUT_SPAN for k in range(n)]


def iter_prompts(trace: Sequence[TraceRequest]) -> Iterator[tuple[TraceRequest, list[int]]]:
    """``(request, prompt tokens)`` pairs, each prompt built only when reached."""
    for req in trace:
        yield req, expand_prompt(req)


# ---------------------------------------------------------------------------------------
# Figures computed from hash ids alone (no manager involved): the independent reference
# a replay is checked against, and the block counts used to size quotas.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceFigures:
    """Reuse figures computed from the trace alone (no manager): the yardstick a replay must
    match to the token."""

    prompt_tokens: int
    reused_tokens_partial: int  # longest prefix shared with any earlier prompt, in tokens
    reused_tokens_whole_blocks: int  # the same, counted in whole blocks of ``tokens_per_block``
    hash_blocks: int
    reusable_hash_blocks: int
    tokens_per_block: int = HASH_BLOCK_TOKENS

    @property
    def hit_rate_partial(self) -> float:
        """Reused tokens (longest shared prefix) / prompt tokens."""
        return self.reused_tokens_partial / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate_whole_blocks(self) -> float:
        """Reused tokens in whole blocks / prompt tokens."""
        return self.reused_tokens_whole_blocks / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def reusable_block_rate(self) -> float:
        """Hash blocks seen before / hash blocks."""
        return self.reusable_hash_blocks / self.hash_blocks if self.hash_blocks else 0.0


def reference_figures(trace: Sequence[TraceRequest], tokens_per_block: int = HASH_BLOCK_TOKENS) -> ReferenceFigures:
    """Reuse a sequential, unbounded, prompt-only replay must report, from hash ids alone.

    A prompt reuses the longest token prefix (LCP) it shares with any earlier prompt: walk
    the trie of earlier hash-id paths; each node remembers the longest length of its
    512-token block seen so far (a prompt's last block may be partial).  With partial reuse
    on that LCP is the reuse at any block size; with it off only whole blocks of
    ``tokens_per_block`` match: ``LCP // B * B`` (a full block is in the tree exactly when
    some earlier prompt shares all its tokens)."""
    B = tokens_per_block
    root: dict = {}
    total = reused = whole = blocks = reusable = 0
    for req in trace:
        n = req.input_length
        nblocks = -(-n // HASH_BLOCK_TOKENS)
        hashes = req.hash_ids[:nblocks]
        node, lcp = root, 0
        for i, h in enumerate(hashes):
            blen = min(HASH_BLOCK_TOKENS, n - i * HASH_BLOCK_TOKENS)
            child = node.get(h)
            if child is None:
                break
            seen = child[0]
            if seen < blen:
                lcp += seen
                break
            lcp += blen
            reusable += 1
            node = child[1]
        total += n
        reused += lcp
        whole += lcp // B * B
        blocks += nblocks
        node = root
        for i, h in enumerate(hashes):
            blen = min(HASH_BLOCK_TOKENS, n - i * HASH_BLOCK_TOKENS)
            child = node.get(h)
            if child is None:
                child = node[h] = [blen, {}]
            elif child[0] < blen:
                child[0] = blen
            node = child[1]
    return ReferenceFigures(total, reused, whole, blocks, reusable, B)


def unique_blocks(trace: Sequence[TraceRequest], tokens_per_block: int) -> int:
    """Number of distinct block keys (full and partial) the prompts of ``trace`` produce at
    ``tokens_per_block``: a block ending at token ``e`` is identified by ``e`` and the
    hash-id path up to the hash block holding token ``e - 1``.  Used to size quotas."""
    B = tokens_per_block
    node_ids: dict[tuple[int, int], int] = {}  # (parent node id, hash id) -> node id
    seen: set[tuple[int, int]] = set()
    for req in trace:
        n = req.input_length
        path: list[int] = []
        parent = 0
        for h in req.hash_ids[: -(-n // HASH_BLOCK_TOKENS)]:
            nid = node_ids.get((parent, h))
            if nid is None:
                nid = node_ids[(parent, h)] = len(node_ids) + 1
            path.append(nid)
            parent = nid
        for e in range(B, n + B, B):
            e = min(e, n)
            seen.add((path[(e - 1) // HASH_BLOCK_TOKENS], e))
    return len(seen)


def total_blocks(trace: Sequence[TraceRequest], tokens_per_block: int, with_outputs: bool = False) -> int:
    """Sum over requests of their blocks (prompt, or prompt + outputs)."""
    B = tokens_per_block
    if with_outputs:
        return sum(-(-(r.input_length + r.output_length) // B) for r in trace)
    return sum(-(-r.input_length // B) for r in trace)


__all__ = [
    "HASH_BLOCK_TOKENS",
    "ReferenceFigures",
    "TraceRequest",
    "expand_outputs",
    "expand_prompt",
    "iter_prompts",
    "load_trace",
    "reference_figures",
    "shipped_trace_path",
    "total_blocks",
    "unique_blocks",
]
