"""The shipped default model (worker/default_model/): it loads, it is GQA Llama in bf16 within 10 MB, it writes
better than chance on held-out text (loss computed here, by the model), and its chat template only ever appends.

The held-out text is the validation split that scripts/train_default_model.py holds out of training: the
documents whose SHA-256(name) mod 100 < 5, rebuilt here from this Python's own standard library with the
script's own functions. On another Python version some documents differ, but a held-out name stays held out.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers

from radixcache.worker.model import loader
from radixcache.worker.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "worker" / "default_model"
SCRIPT = REPO / "scripts" / "train_default_model.py"

SEQ_LEN = 512
WINDOWS = 8  # ~4k held-out tokens: a stable estimate in about a second
# Measured on these windows: 1.476 bits/byte, 5.18 bits/token, through transformers and the project's loader alike
# (worker/default_model/README.md: 1.440 bits/byte, 5.14 bits/token on the whole held-out split).
# The bounds sit comfortably above the measured loss, yet far below chance (log2(4096) = 12 bits/token, about
# 3.4 bits/byte for the uniform model at this tokenizer's 3.5 bytes/token).
MAX_BITS_PER_BYTE = 1.9
MAX_BITS_PER_TOKEN = 7.0

SPECIAL_IDS = {
    "<|endoftext|>": 0,
    "<|bos|>": 1,
    "<|pad|>": 2,
    "<|system|>": 3,
    "<|user|>": 4,
    "<|assistant|>": 5,
    "<|end|>": 6,
}

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant that knows the Python documentation."},
    {"role": "user", "content": "What does json.dumps do?"},
    {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
    {"role": "user", "content": "And json.loads?"},
    {"role": "assistant", "content": "Deserialize s to a Python object.\n\nIt raises an error on bad input."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def documents(script):
    return script.build_documents()


@pytest.fixture(scope="module")
def heldout(script, documents):
    """(token ids of the held-out documents, UTF-8 bytes per token id)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    _, val_docs = script.split_documents(documents)
    assert len(val_docs) > 100
    ids = script.validation_token_stream(tok, val_docs)[: WINDOWS * SEQ_LEN]
    assert len(ids) == WINDOWS * SEQ_LEN
    return ids, script.token_byte_lengths(tok)


@pytest.fixture(scope="module")
def corpus_words(documents):
    words = set()
    for _, text in documents:
        words.update(w.lower() for w in re.findall(r"[A-Za-z]+", text))
    return words


def test_checkpoint_files_and_shape():
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert required in names
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert size <= 10 * 1000 * 1000, f"default model is {size} bytes"
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA, so serving exercises it
    assert cfg["tie_word_embeddings"] is True
    assert cfg["bos_token_id"] == SPECIAL_IDS["<|bos|>"] and cfg["eos_token_id"] == SPECIAL_IDS["<|endoftext|>"]
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == [SPECIAL_IDS["<|endoftext|>"], SPECIAL_IDS["<|end|>"]]


def test_special_tokens_are_single_ids():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for text, idx in SPECIAL_IDS.items():
        assert tok.token_to_id(text) == idx
        assert tok.encode(f"a{text}b", add_special_tokens=False).ids.count(idx) == 1
    # Plain text gets the BOS every training document started with; the chat template writes its own.
    bos = SPECIAL_IDS["<|bos|>"]
    assert tok.encode("hello", add_special_tokens=True).ids == [bos, *tok.encode("hello", add_special_tokens=False).ids]
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|bos|>", "<|endoftext|>", "<|pad|>")


def _assert_appends_only(render) -> None:  # noqa: ANN001
    """Turn N+1's prompt starts with turn N's prompt + the assistant's reply; plain renders are prefixes too."""
    for n in range(1, len(CONVERSATION) + 1):
        assert render(CONVERSATION[: n + 1], False).startswith(render(CONVERSATION[:n], False))
        if CONVERSATION[n - 1]["role"] == "user" and n < len(CONVERSATION):
            prompt = render(CONVERSATION[:n], True)
            assert prompt.endswith("<|assistant|>\n")
            reply = CONVERSATION[n]["content"]
            for later in range(n + 1, len(CONVERSATION) + 1):
                assert render(CONVERSATION[:later], True).startswith(prompt + reply + "<|end|>\n")
    assert render(CONVERSATION[:2], True) == (
        "<|bos|><|system|>\nYou are a helpful assistant that knows the Python documentation.<|end|>\n"
        "<|user|>\nWhat does json.dumps do?<|end|>\n<|assistant|>\n"
    )


def test_chat_template_only_appends_transformers(hf_tokenizer):
    tok = hf_tokenizer
    _assert_appends_only(lambda msgs, gen: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))


def test_chat_template_only_appends_project_tokenizer():
    tok = Tokenizer.from_dir(MODEL_DIR)
    _assert_appends_only(lambda msgs, gen: tok.apply_chat_template(msgs, add_generation_prompt=gen))


def _loss_from_logits(batches, byte_lengths) -> dict:  # noqa: ANN001
    """batches: [(ids [T], float logits [T, vocab])] of whole windows; every token after the first is predicted."""
    nll, n_tok, n_bytes = 0.0, 0, 0
    blen = torch.tensor(byte_lengths)
    for ids, logits in batches:
        target = ids[1:]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        nll += -logp.gather(-1, target[:, None]).sum().item()
        n_tok += target.numel()
        n_bytes += int(blen[target].sum())
    return {"bits_per_token": nll / n_tok / math.log(2), "bits_per_byte": nll / n_bytes / math.log(2)}


def _assert_below_bounds(m: dict) -> None:
    assert m["bits_per_byte"] < MAX_BITS_PER_BYTE, m
    assert m["bits_per_token"] < MAX_BITS_PER_TOKEN, m


def _windows(ids: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(ids[i : i + SEQ_LEN]) for i in range(0, len(ids), SEQ_LEN)]


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def transformers_loss(heldout, hf_model):
    ids, byte_lengths = heldout
    with torch.no_grad():
        logits = hf_model(input_ids=torch.stack(_windows(ids))).logits
    return _loss_from_logits(list(zip(_windows(ids), logits, strict=True)), byte_lengths)


def test_heldout_loss_transformers(transformers_loss):
    print(f"transformers: {transformers_loss}")
    _assert_below_bounds(transformers_loss)


def project_heldout_loss(loaded, ids: list[int], byte_lengths) -> dict:  # noqa: ANN001
    """Loss of a model loaded by the project's loader on the held-out windows: one prefill step of every window
    through the paged KV pool and the torch backend, logits at every position."""
    from radixcache.pool import KVPool, KVShape
    from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend

    cfg = loaded.config
    page = 16
    windows = _windows(ids)
    pages_per_seq = SEQ_LEN // page
    pool = KVPool(
        KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
        page_size=page,
        num_pages=pages_per_seq * len(windows),
        dtype=torch.float32,
    )
    backend = create_backend("torch", "cpu")
    seqs = [
        SequenceSlice(pages=list(range(b * pages_per_seq, (b + 1) * pages_per_seq)), num_cached=0, num_new=SEQ_LEN)
        for b in range(len(windows))
    ]
    layout = BatchLayout.build(seqs, page)
    with torch.no_grad():
        logits = loaded.model(torch.cat(windows), layout, pool, backend, all_logits=True)
    return _loss_from_logits(list(zip(windows, logits.split(SEQ_LEN), strict=True)), byte_lengths)


def test_heldout_loss_project_loader(heldout, transformers_loss):
    ids, byte_lengths = heldout
    loaded = loader.load_checkpoint(MODEL_DIR, dtype="float32")
    assert loaded.tokenizer.bos_token_id == SPECIAL_IDS["<|bos|>"]
    assert {SPECIAL_IDS["<|endoftext|>"], SPECIAL_IDS["<|end|>"]} <= set(loaded.tokenizer.eos_token_ids)
    m = project_heldout_loss(loaded, ids, byte_lengths)
    print(f"project loader: {m}")
    _assert_below_bounds(m)
    assert abs(m["bits_per_token"] - transformers_loss["bits_per_token"]) < 0.01


def test_greedy_continuation_is_words(hf_model, hf_tokenizer, corpus_words):
    tok, model = hf_tokenizer, hf_model
    x = tok("<|bos|>This module provides", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        y = model.generate(x, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(y[0, x.shape[1] :], skip_special_tokens=True)
    words = [w.strip(".,;:()'\"`") for w in text.split()]
    words = [w for w in words if w]
    # Real words, not BPE soup: most whitespace-separated pieces are words the documentation itself uses.
    known = [w for w in words if w.lower() in corpus_words]
    assert len(known) >= 8 and len(known) >= 0.8 * len(words), text
