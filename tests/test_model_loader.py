"""Checkpoint loading, config validation, tokenizer and incremental detokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from jinja2.exceptions import TemplateError
from model_fixtures import build_checkpoint, build_tokenizer_files, hf_config

from radixcache.worker.model import (
    IncrementalDetokenizer,
    ModelConfig,
    Tokenizer,
    load_checkpoint,
    random_model,
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_checkpoint(folder, "LlamaForCausalLM")
    return folder


def test_config_from_hf_reads_every_architecture() -> None:
    llama = ModelConfig.from_hf_config(hf_config("LlamaForCausalLM").to_dict())
    assert llama.tie_word_embeddings and llama.qkv_bias and llama.o_bias
    assert llama.rope_theta == 50000.0 and llama.rope_scaling["rope_type"] == "llama3"
    assert (llama.bos_token_id, llama.eos_token_ids) == (0, (1,))
    mistral = ModelConfig.from_hf_config(hf_config("MistralForCausalLM").to_dict())
    assert mistral.head_dim == 32 and not mistral.qkv_bias and mistral.rope_scaling is None
    qwen = ModelConfig.from_hf_config(hf_config("Qwen2ForCausalLM").to_dict())
    assert qwen.qkv_bias and not qwen.o_bias and qwen.num_kv_heads == 1


def test_config_legacy_rope_fields_and_a_window_that_does_not_cap_the_context() -> None:
    hf = hf_config("MistralForCausalLM").to_dict()
    hf.pop("rope_parameters")
    hf.update(rope_theta=1234.0, sliding_window=128, max_position_embeddings=512)
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.rope_theta == 1234.0
    assert cfg.max_position_embeddings == 512  # Mistral gets its whole context, every layer its window
    assert cfg.layer_windows == (128, 128)


def test_config_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        ModelConfig(
            vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
            rope_scaling={"rope_type": "yarn", "factor": 4.0},
        )  # fmt: skip


def test_load_checkpoint_matches_saved_weights(llama_dir: Path) -> None:
    loaded = load_checkpoint(llama_dir)
    assert loaded.path == llama_dir and loaded.config.architecture == "LlamaForCausalLM"
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert next(model.parameters()).dtype == torch.float32
    half = load_checkpoint(llama_dir, dtype="bf16")
    assert next(half.model.parameters()).dtype == torch.bfloat16


def test_load_sharded_checkpoint(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "src", "Qwen2ForCausalLM")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "src" / f, tmp_path / "sharded" / f)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_checkpoint(tmp_path / "src"), load_checkpoint(tmp_path / "sharded")
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_missing_files_are_named(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_checkpoint(tmp_path)
    partial = tmp_path / "no_weights"
    partial.mkdir()
    shutil.copy(llama_dir / "config.json", partial)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(partial)
    shutil.copy(llama_dir / "model.safetensors", partial)
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        load_checkpoint(partial)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_checkpoint(partial)


def test_random_model_is_seeded() -> None:
    cfg = tiny_config(vocab_size=50)
    a, b, c = random_model(cfg, seed=3), random_model(cfg, seed=3), random_model(cfg, seed=4)
    pa, pb, pc = (m.model.model.layers[0].self_attn.qkv_proj.dense_weight() for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_tokenizer_encode_decode_chat(tmp_path: Path) -> None:
    build_tokenizer_files(tmp_path)
    tok = Tokenizer.from_dir(tmp_path, extra_eos_ids=[7])
    ids = tok.encode("the quick brown fox")
    assert ids[0] == tok.bos_token_id == tok.token_to_id("<s>")
    assert tok.encode("the quick brown fox", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "the quick brown fox"
    assert tok.eos_token_ids == {tok.token_to_id("</s>"), 7}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>hi</s><|assistant|>"
    assert not tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False).endswith(
        "<|assistant|>"
    )
    with pytest.raises(TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    build_tokenizer_files(tmp_path, with_chat_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_incremental_detokenizer_never_splits_characters(tmp_path: Path) -> None:
    build_tokenizer_files(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    text = "héllo wörld 日本語のテキスト 🙂 zz🙂"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens were held back mid-character


def test_incremental_detokenizer_flush_emits_a_dangling_partial(tmp_path: Path) -> None:
    build_tokenizer_files(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("a🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(i) for i in ids[:-1])
    assert out == "a"
    assert detok.flush().endswith("\ufffd")


def test_a_model_refuses_a_backend_created_for_other_attention() -> None:
    """A sliding-window model run through a backend built without its windows would attend globally, silently."""
    from radixcache.pool import KVPool, KVShape
    from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
    from radixcache.worker.model.llama import attention_options

    cfg = ModelConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        layer_kinds=("sliding", "global"), sliding_window=4,
    )  # fmt: skip
    loaded = random_model(cfg)
    pool = KVPool(KVShape(2, 2, 8), page_size=4, num_pages=4)
    layout = BatchLayout.build([SequenceSlice([0, 1], 0, 6)], 4)
    ids = torch.arange(6)
    with pytest.raises(ValueError, match="needs AttentionOptions.*windows=\\(4, None\\)"):
        loaded.model(ids, layout, pool, create_backend("torch"))
    logits = loaded.model(ids, layout, pool, create_backend("torch", attention=attention_options(cfg)))
    assert logits.shape == (1, 50)
