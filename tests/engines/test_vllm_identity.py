"""The vLLM connector's model identity (kvcm.integrations.vllm.identity), without vLLM: the
fingerprint of a model's weights and configuration that keeps two models of one shape from
sharing an object, and what it reads.  The real engine's side: tests/engines/test_vllm_connector.py
(two random-weight models of one shape on one store and namespace)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvcm.api import ReuseScope
from kvcm.integrations.vllm.identity import (
    TENSOR_WINDOWS,
    WINDOW,
    IdentityError,
    ModelSource,
    model_identity,
    request_problem,
    request_scope,
    weight_files,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "rope_theta": 10000.0,
          "_name_or_path": "/somewhere", "transformers_version": "5.19.0"}


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """A safetensors file of F32 tensors (the format: an 8-byte header length, a JSON
    header naming each tensor's dtype, shape and data offsets, then the data)."""
    header, off = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [off, off + len(data)]}
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for data in tensors.values():
            f.write(data)


def tensors(seed: int, sizes: dict[str, int]) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {name: rng.randbytes(n) for name, n in sizes.items()}


SIZES = {"model.embed_tokens.weight": 64 << 10, "model.layers.0.mlp.weight": 200 << 10, "lm_head.weight": 4 << 10}


def model_dir(root: Path, name: str, seed: int = 1, config: dict | None = None, shards: int = 1,
              sizes: dict[str, int] = SIZES) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config or CONFIG))
    ts = tensors(seed, sizes)
    names = list(ts)
    for i in range(shards):
        part = {n: ts[n] for n in names[i::shards]}
        write_safetensors(d / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", part)
    return d


def ident(path: Path, mode: str = "sampled", **kw) -> str:
    return model_identity(ModelSource(str(path), **kw), mode).digest


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_equal_shapes_different_weights_differ_and_copies_agree(tmp_path: Path, mode: str) -> None:
    a, b = model_dir(tmp_path, "a", seed=1), model_dir(tmp_path, "b", seed=2)
    copy = tmp_path / "elsewhere" / "a-copy"
    shutil.copytree(a, copy)  # another host's copy: other path, other times
    os.utime(copy / "model-00001-of-00001.safetensors", (1, 1))
    assert ident(a, mode) != ident(b, mode)
    assert ident(a, mode) == ident(copy, mode)
    assert ident(a, "sampled") != ident(a, "full")  # the mode is part of the identity


def test_config_counts_except_where_it_came_from(tmp_path: Path) -> None:
    base = ident(model_dir(tmp_path, "a"))
    moved = ident(model_dir(tmp_path, "b", config={**CONFIG, "_name_or_path": "/other", "transformers_version": "9"}))
    rope = ident(model_dir(tmp_path, "c", config={**CONFIG, "rope_theta": 500000.0}))
    assert moved == base and rope != base


def test_vllm_settings_count(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "a")
    fp32 = ident(d, settings=(("dtype", "float32"), ("quantization", "None")))
    bf16 = ident(d, settings=(("dtype", "bfloat16"), ("quantization", "None")))
    assert fp32 != bf16


def test_sampled_reads_windows_per_tensor_not_the_weights(tmp_path: Path) -> None:
    sizes = {f"layer.{i}.weight": (1 << 20) + 4 * i for i in range(12)}  # 12 MiB of weights
    d = model_dir(tmp_path, "big", sizes=sizes, shards=3)
    got = model_identity(ModelSource(str(d)), "sampled")
    header = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in weight_files(d))
    assert got.files == 3 and got.weight_bytes == sum(os.path.getsize(p) for p in weight_files(d))
    assert got.bytes_read == header + 12 * TENSOR_WINDOWS * WINDOW
    assert got.reads == 3 + 12 * TENSOR_WINDOWS
    full = model_identity(ModelSource(str(d)), "full")
    assert full.bytes_read == got.weight_bytes


def test_a_changed_window_changes_it_an_unsampled_byte_only_in_full(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "a")
    before = {m: ident(d, m) for m in ("sampled", "full")}
    f = d / "model-00001-of-00001.safetensors"
    n = 8 + struct.unpack("<Q", f.read_bytes()[:8])[0]
    start = n + SIZES["model.embed_tokens.weight"]  # the second tensor: 200 KiB, windows at its start/middle/end

    def flip(offset: int) -> None:
        data = bytearray(f.read_bytes())
        data[offset] ^= 0xFF
        f.write_bytes(bytes(data))

    size = SIZES["model.layers.0.mlp.weight"]
    flip(start + (size - WINDOW) // 2 + 5)  # inside the middle window
    mid = {m: ident(d, m) for m in ("sampled", "full")}
    assert mid["sampled"] != before["sampled"] and mid["full"] != before["full"]
    flip(start + size // 4)  # between windows: a limit of sampling, documented
    assert ident(d, "sampled") == mid["sampled"] and ident(d, "full") != mid["full"]


def test_bin_and_gguf_files_are_sampled_too(tmp_path: Path) -> None:
    d = tmp_path / "bin"
    d.mkdir()
    rng = random.Random(3)
    (d / "pytorch_model.bin").write_bytes(rng.randbytes(12 << 20))
    (d / "training_args.txt").write_text("not weights")
    got = model_identity(ModelSource(str(d)), "sampled")
    assert got.files == 1 and got.bytes_read == (1 << 20) + 1024 * WINDOW  # its first MiB, 1,024 windows
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(rng.randbytes(2 << 20))
    g = model_identity(ModelSource(str(gguf)), "sampled")
    assert g.files == 1 and g.digest != got.digest


def test_safetensors_preferred_over_bin(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "a")
    (d / "pytorch_model.bin").write_bytes(b"x" * 100)
    assert [p.name for p in weight_files(d)] == ["model-00001-of-00001.safetensors"]


@pytest.mark.parametrize(("make", "match"), [
    (lambda d: None, "no weight files"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 16), "not a safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 20) + b'{"t": {"dtype": 1}}  '), "data_offsets"),
    (lambda d: write_safetensors(d / "m.safetensors", {"w": b"\0" * 64}) or (d / "config.json").write_text("[1,"),
     "cannot read"),
])
def test_unusable_models_are_a_clear_error(tmp_path: Path, make, match: str) -> None:
    d = tmp_path / "m"
    d.mkdir()
    make(d)
    with pytest.raises(IdentityError, match=match):
        model_identity(ModelSource(str(d)))


def test_dummy_weights_and_uncached_hub_names_have_no_identity(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(IdentityError, match="dummy"):
        model_identity(ModelSource(str(model_dir(tmp_path, "a")), load_format="dummy"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(IdentityError, match="no local copy|not installed"):
        model_identity(ModelSource("some-org/some-model-that-is-not-cached", download_dir=str(tmp_path / "hf")))


def test_from_vllm_reads_the_settings_that_change_the_values() -> None:
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(model="/m", revision=None, dtype="torch.bfloat16", quantization=None,
                                     hf_overrides={"rope_theta": 1.0}),
        load_config=SimpleNamespace(download_dir=None, load_format="auto"))
    src = ModelSource.from_vllm(cfg)
    assert dict(src.settings) == {"dtype": "bfloat16", "quantization": "None", "hf_overrides": '{"rope_theta": 1.0}'}
    cfg.model_config.hf_overrides = test_from_vllm_reads_the_settings_that_change_the_values  # a callable
    assert "test_vllm_identity.test_from_vllm" in dict(ModelSource.from_vllm(cfg).settings)["hf_overrides"]
    hash(src)  # the per-process memo's key


def test_random_weight_models_of_one_shape(tmp_path: Path) -> None:
    """The models the vLLM tests run: workload.make_model with two seeds."""
    pytest.importorskip("transformers")
    from kvcm.bench.vllm_workload import make_model

    a = make_model(str(tmp_path / "a"), seed=1)
    b = make_model(str(tmp_path / "b"), seed=2)
    a2 = make_model(str(tmp_path / "a2"), seed=1)
    assert ident(Path(a)) != ident(Path(b))
    assert ident(Path(a)) == ident(Path(a2))


def test_requests_whose_kv_depends_on_more_than_tokens() -> None:
    assert request_problem(SimpleNamespace(lora_request=None, mm_features=[])) is None
    assert request_problem(SimpleNamespace(lora_request=object(), mm_features=None)) == "lora"
    assert request_problem(SimpleNamespace(lora_request=None, mm_features=[object()])) == "multimodal"
    assert request_scope(SimpleNamespace(cache_salt=None)) is None
    s1, s2 = request_scope(SimpleNamespace(cache_salt="tenant-1")), request_scope(SimpleNamespace(cache_salt="tenant-2"))
    assert isinstance(s1, ReuseScope) and s1 != s2
    assert s1 == request_scope(SimpleNamespace(cache_salt="tenant-1"))  # stable: no hash seed
    assert s1.salt == int.from_bytes(__import__("hashlib").sha256(b"kvcm-vllm-cache-salt-v1\0tenant-1").digest()[:8],
                                     "little")
