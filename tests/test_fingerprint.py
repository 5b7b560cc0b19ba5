"""worker/engine/fingerprint.py: every part that changes K/V changes the fingerprint; nothing else does."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_fixtures import tiny_model

from radixcache.pool import KVPool, KVShape
from radixcache.worker.engine.fingerprint import fingerprint, fingerprint_parts, store_folder, weights_digest
from radixcache.worker.model.loader import random_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def pool_for(model, dtype: str = "float32") -> KVPool:
    c = model.config
    return KVPool(KVShape(c.num_layers, c.num_kv_heads, c.head_dim), page_size=4, num_pages=2, dtype=dtype)


def fp(model, *, pool=None, page_size: int = 4, device: str = "cpu", backend: str = "torch") -> str:
    parts = fingerprint_parts(model, pool=pool or pool_for(model), page_size=page_size, device=device, backend=backend)
    return fingerprint(parts, weights_digest(model))


def test_the_same_model_gives_the_same_fingerprint(model) -> None:
    assert fp(model) == fp(model) == fp(tiny_model())
    assert fp(model, device="cpu") == fp(model, device="cpu:0")


def test_each_part_that_changes_kv_changes_it(model) -> None:
    base = fp(model)
    bf16 = random_model(model.config, std=0.3, dtype="bfloat16")
    bf16.tokenizer = model.tokenizer
    other_tokenizer = tiny_model()
    other_tokenizer.tokenizer = SimpleNamespace(digest=lambda: "another tokenizer")
    int8 = tiny_model()
    int8.weights = "int8"
    quantized_pool = pool_for(model)
    quantized_pool.kv_dtype = "int8"  # the page format of another precision
    variants = {
        "weights": fp(tiny_model(seed=1)),
        "dtype": fp(bf16, pool=pool_for(bf16, "bfloat16")),
        "kv_dtype": fp(model, pool=quantized_pool),
        "page_size": fp(model, page_size=8),
        "tokenizer": fp(other_tokenizer),
        "weights_format": fp(int8),
        "device": fp(model, device="cuda:0"),
        "backend": fp(model, backend="flashinfer"),
        "config": fp(tiny_model(context=2048)),
    }
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants), variants


def test_a_checkpoint_digest_reads_every_weight_byte(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(bytes(1000) + b"\x01")
    (tmp_path / "config.json").write_text("{}")
    loaded = SimpleNamespace(path=tmp_path)
    first = weights_digest(loaded)
    (tmp_path / "config.json").write_text('{"not": "weights"}')
    assert weights_digest(loaded) == first
    (tmp_path / "model.safetensors").write_bytes(bytes(1000) + b"\x02")  # one byte of one weight changed
    assert weights_digest(loaded) != first
    assert first.startswith("files:")


def test_the_digest_is_remembered_by_file_identity(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    ckpt, root = tmp_path / "ckpt", tmp_path / "kv"
    ckpt.mkdir()
    root.mkdir()
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"w" * 100)
    loaded = SimpleNamespace(path=ckpt)
    first = weights_digest(loaded, remember_in=root)
    assert (root / "weight-digests.json").is_file()
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: reads.append(str(f)) or real_open(f, *a, **k))
    assert weights_digest(loaded, remember_in=root) == first and str(weights) not in reads  # not read again
    monkeypatch.undo()
    weights.write_bytes(b"v" * 100)  # replaced: a new mtime (and content)
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert weights_digest(loaded, remember_in=root) != first


def test_the_store_folder_is_named_by_it_and_says_what_it_is(model, tmp_path: Path) -> None:
    parts = fingerprint_parts(model, pool=pool_for(model), page_size=4, device="cpu", backend="torch")
    folder = store_folder(tmp_path, parts, weights_digest(model))
    assert folder.parent == tmp_path and folder.name == fingerprint(parts, weights_digest(model))
    about = json.loads((folder / "FINGERPRINT.json").read_text())
    assert about["page_size"] == 4 and about["kv_dtype"] == "fp32" and about["weights"].startswith("recipe:")


def test_an_mla_models_fingerprint_names_its_latent_page_layout(model) -> None:
    """Latent pages became token-contiguous: an MLA model's fingerprint says so (an old disk tier's latent pages,
    the same bytes laid out otherwise, are not read), and no other model's fingerprint carries the part."""
    from model_fixtures import hf_config

    from radixcache.worker.model import ModelConfig

    mla = random_model(ModelConfig.from_hf_config(hf_config("DeepseekV3ForCausalLM").to_dict()))
    mc = mla.config
    pool = KVPool(KVShape(mc.num_layers, *mc.kv_cache_dims), page_size=4, num_pages=2, latent=True)
    parts = fingerprint_parts(mla, pool=pool, page_size=4, device="cpu", backend="torch")
    assert parts["latent_layout"] == "token"
    without = {k: v for k, v in parts.items() if k != "latent_layout"}
    assert fingerprint(parts, "w") != fingerprint(without, "w")
    plain = fingerprint_parts(model, pool=pool_for(model), page_size=4, device="cpu", backend="torch")
    assert "latent_layout" not in plain
