"""Whose KV a block holds: the model's identity, derived from what vLLM loaded.

kvcm names a shared-tier object by its block key (the tokens) and a layout fingerprint (the
block size, the page layout, the namespace).  Two models of one shape -- a base model and its
fine-tune, two random seeds -- have one layout and write different KV for the same tokens, so
the connector puts **the model's identity** into the namespace: a SHA-256 over

* the model's configuration: ``config.json`` of its weights (the keys that only say where
  it came from, ``_name_or_path``, ``transformers_version`` and other ``_``-keys, left out)
  and vLLM's settings that change the values a forward writes: the compute ``dtype``,
  ``quantization``, ``hf_overrides``;
* every weight file vLLM would load (``*.safetensors``, else ``*.bin``, else ``*.pt`` /
  ``*.pth``, or the one ``.gguf`` file; sorted by name): its name and size, and

  - ``"sampled"`` (the default): a safetensors file's whole header (every tensor's name,
    dtype, shape and offsets) and, of every tensor, up to three 4 KiB windows of its bytes
    (start, middle, end; all of a tensor of at most 12 KiB); any other file: its first
    1 MiB and its last 4 KiB, and 4 KiB at most 1,024 evenly spaced offsets;
  - ``"full"``: every byte.

What ``sampled`` reads is bounded by the number of tensors, not their size (a 16 GB
checkpoint of 291 tensors: about 3.4 MiB in under 900 reads).  It tells apart any two
checkpoints that differ in a tensor's name, dtype or shape, or in the bytes of a window;
a fine-tune, a merged LoRA, another seed rewrite every window of the tensors they change.
Two checkpoints that differ only inside unsampled bytes of a tensor (a few rows edited by
hand) read as one: ``"full"`` tells them apart, at the price of reading every byte.
DECISIONS.md "vLLM connector: model identity" has the measured costs.

The identity depends on the bytes only, never on paths, times or the process: instances
on other hosts with copies of the same files compute the same one, so they share.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("sampled", "full", "off")
WINDOW = 4096  # bytes per sampled window
TENSOR_WINDOWS = 3  # windows per tensor (start, middle, end)
FILE_HEAD = 1 << 20  # a non-safetensors file: its first MiB (its header / index) ...
FILE_WINDOWS = 1024  # ... and at most this many windows spread over the rest
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one
CHUNK = 8 << 20  # the read size of "full"
# the weight files vLLM loads, by preference: the first group with a file in the directory
WEIGHT_GROUPS: tuple[tuple[str, ...], ...] = ((".safetensors",), (".bin",), (".pt", ".pth"))
DOMAIN = b"kvcm-model-identity-v1"


class IdentityError(ValueError):
    """The model's identity cannot be derived (no weight files, an unreadable one)."""


@dataclass(frozen=True)
class ModelSource:
    """What identifies a model's KV, as plain values (``from_vllm`` reads them from vLLM's
    config; the tests build one directly)."""

    model: str  # a directory, a weights file (GGUF) or a Hugging Face hub name
    revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    settings: tuple[tuple[str, str], ...] = ()  # vLLM's settings that change the values, sorted

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ModelSource:
        mc, lc = vllm_config.model_config, vllm_config.load_config
        overrides = mc.hf_overrides
        if callable(overrides):  # a function: its name (its repr holds an address)
            overrides = f"{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}"
        settings = {"dtype": str(mc.dtype).removeprefix("torch."), "quantization": str(mc.quantization),
                    "hf_overrides": json.dumps(overrides, sort_keys=True, default=str)}
        return cls(str(mc.model), mc.revision, lc.download_dir, str(lc.load_format), tuple(sorted(settings.items())))


@dataclass(frozen=True)
class ModelIdentity:
    digest: str  # SHA-256, hex
    mode: str
    files: int  # weight files read
    weight_bytes: int  # their total size
    bytes_read: int  # what the digest read of them (config files not counted)
    reads: int
    seconds: float  # reporting only

    @property
    def tag(self) -> str:
        """What goes into the shared namespace (128 bits of the digest)."""
        return f"model:{self.digest[:32]}"

    def describe(self) -> str:
        return (f"{self.tag} ({self.mode}: {self.files} weight files, {size_text(self.weight_bytes)}; read "
                f"{size_text(self.bytes_read)} in {self.reads} reads, {self.seconds:.2f} s)")


def weights_location(source: ModelSource) -> Path:
    """The directory (or GGUF file) holding the weights vLLM loaded: ``model`` when it is a
    local path, else the hub snapshot vLLM downloaded (looked up in the local cache only)."""
    if source.load_format == "dummy":
        raise IdentityError("load_format 'dummy' loads random weights, no files: nothing identifies the model "
                            "(set model_identity 'off' and name the model in shared_namespace)")
    p = Path(source.model).expanduser()
    if p.exists():
        return p
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise IdentityError(f"model {source.model!r} is not a local path and huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(source.model, revision=source.revision, cache_dir=source.download_dir,
                                      local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure of the lookup means: no local copy
        raise IdentityError(f"model {source.model!r}: no local copy of its files found ({type(e).__name__}); "
                            "set model_identity 'off' and name the model in shared_namespace") from None


def weight_files(location: Path) -> list[Path]:
    """The weight files of ``location`` (a GGUF file: itself), sorted by name."""
    if location.is_file():
        return [location]
    names = sorted(os.listdir(location))
    for group in WEIGHT_GROUPS:
        found = [location / n for n in names if n.endswith(group) and (location / n).is_file()]
        if found:
            return found
    raise IdentityError(f"no weight files in {str(location)!r} (looked for "
                        f"{', '.join('*' + s for g in WEIGHT_GROUPS for s in g)})")


def model_config_json(location: Path) -> bytes:
    """``config.json`` of the weights, canonical: sorted keys, the keys that name where the
    model came from (``_name_or_path``, ``transformers_version``, ``_``-keys) left out; b""
    when there is none (a GGUF file carries its configuration inside)."""
    path = location / "config.json" if location.is_dir() else None
    if path is None or not path.is_file():
        return b""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise IdentityError(f"cannot read {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise IdentityError(f"{str(path)!r} is not a JSON object")

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if not (k.startswith("_") or k == "transformers_version")}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(data), sort_keys=True, separators=(",", ":")).encode()


class _Reader:
    """Reads windows of one file into the digest, counting what it read."""

    def __init__(self, h: Any, f: Any) -> None:
        self.h, self.f = h, f
        self.bytes = self.reads = 0

    def window(self, offset: int, n: int) -> None:
        data = os.pread(self.f.fileno(), n, offset)
        if len(data) != n:
            raise IdentityError(f"short read of {self.f.name!r} at {offset}: {len(data)} of {n} bytes")
        self.h.update(struct.pack("<QQ", offset, n))
        self.h.update(data)
        self.bytes += n
        self.reads += 1


def _windows(begin: int, end: int, count: int) -> Iterable[tuple[int, int]]:
    """``count`` windows of :data:`WINDOW` bytes spread over [begin, end): the first at
    ``begin``, the last ending at ``end``; the whole range when it is that small."""
    size = end - begin
    if size <= count * WINDOW:
        if size > 0:
            yield begin, size
        return
    if count == 1:
        yield begin, WINDOW
        return
    step = (size - WINDOW) // (count - 1)
    for i in range(count):
        yield begin + i * step, WINDOW


def _safetensors(r: _Reader, size: int, mode: str) -> None:
    head = os.pread(r.f.fileno(), 8, 0)
    if len(head) != 8:
        raise IdentityError(f"{r.f.name!r}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", head)
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        raise IdentityError(f"{r.f.name!r}: not a safetensors file (header length {n})")
    r.window(0, 8 + n)
    try:
        header = json.loads(os.pread(r.f.fileno(), n, 8))
    except ValueError as e:
        raise IdentityError(f"{r.f.name!r}: not a safetensors file (header: {e})") from None
    if mode == "full":
        _whole(r, 8 + n, size)
        return
    base = 8 + n
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = (int(x) for x in t["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise IdentityError(f"{r.f.name!r}: tensor {name!r} has no data_offsets") from None
        if not 0 <= a <= b <= size - base:
            raise IdentityError(f"{r.f.name!r}: tensor {name!r} lies outside the file")
        spans.append((a, b))
    for a, b in sorted(spans):
        for off, k in _windows(base + a, base + b, TENSOR_WINDOWS):
            r.window(off, k)


def _generic(r: _Reader, size: int, mode: str) -> None:
    if mode == "full":
        _whole(r, 0, size)
        return
    head = min(size, FILE_HEAD)
    if head:
        r.window(0, head)
    rest = size - head
    if rest > 0:
        count = min(FILE_WINDOWS, max(1, rest // WINDOW))
        for off, k in _windows(head, size, count):
            r.window(off, k)


def _whole(r: _Reader, begin: int, end: int) -> None:
    off = begin
    while off < end:
        r.window(off, min(CHUNK, end - off))
        off += CHUNK


def model_identity(source: ModelSource, mode: str = "sampled",
                   clock: Callable[[], float] = time.perf_counter) -> ModelIdentity:
    """The identity of the model ``source`` names (module docstring); IdentityError when it
    cannot be derived.  ``mode``: ``"sampled"`` or ``"full"``."""
    if mode not in ("sampled", "full"):
        raise ValueError(f"model identity mode must be 'sampled' or 'full', got {mode!r}")
    t0 = clock()
    location = weights_location(source)
    files = weight_files(location)
    h = hashlib.sha256(DOMAIN)
    settings = json.dumps(sorted(source.settings), separators=(",", ":")).encode()
    config = model_config_json(location)
    h.update(struct.pack("<QQ", len(settings), len(config)) + settings + config)
    total = read = reads = 0
    for path in files:
        name = path.name.encode()
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(struct.pack("<QQ", len(name), size) + name)
                r = _Reader(h, f)
                (_safetensors if path.suffix == ".safetensors" else _generic)(r, size, mode)
        except OSError as e:
            raise IdentityError(f"cannot read weight file {str(path)!r}: {e.strerror or e}") from None
        total += size
        read += r.bytes
        reads += r.reads
    return ModelIdentity(h.hexdigest(), mode, len(files), total, read, reads, clock() - t0)


_MEMO: dict[tuple[ModelSource, str], ModelIdentity] = {}


def cached_identity(source: ModelSource, mode: str) -> ModelIdentity:
    """:func:`model_identity`, once per process and model (vLLM's CPU build runs the
    scheduler's and the worker's connector in one process)."""
    key = (source, mode)
    if key not in _MEMO:
        _MEMO[key] = model_identity(source, mode)
    return _MEMO[key]


def request_problem(request: Any) -> str | None:
    """Why kvcm must not match or save this vLLM request, or None: its KV depends on more
    than its token ids -- a LoRA adapter (another model's weights for the same tokens) or
    multimodal inputs (an image's placeholder tokens are the same for every image)."""
    if getattr(request, "lora_request", None) is not None:
        return "lora"
    if getattr(request, "mm_features", None):
        return "multimodal"
    return None


def request_scope(request: Any) -> Any:
    """The kvcm reuse scope of a vLLM request: its ``cache_salt`` (vLLM's tenant isolation of
    the prefix cache) as ``ReuseScope(salt=...)``, so salted requests share blocks -- in kvcm's
    tiers and in the shared store -- only with requests of the same salt; None without one."""
    salt = getattr(request, "cache_salt", None)
    if not salt:
        return None
    from kvcm.api import ReuseScope

    digest = hashlib.sha256(b"kvcm-vllm-cache-salt-v1\0" + str(salt).encode()).digest()
    return ReuseScope(salt=int.from_bytes(digest[:8], "little"))


def size_text(n: int) -> str:
    """``n`` bytes for a person: ``1.5 GiB``, ``24.0 MiB``, ``8 B``."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


__all__ = ["MODES", "IdentityError", "ModelIdentity", "ModelSource", "cached_identity", "model_identity",
           "request_problem", "request_scope", "size_text", "weight_files", "weights_location"]
