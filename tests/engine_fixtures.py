"""A tiny model with a real byte-level tokenizer, for engine and server tests.

Random weights with a large init scale: logits are far from uniform, so greedy choices have a clear margin and a
last-bit difference between batch compositions cannot flip a token.
"""

from __future__ import annotations

import functools

from helpers import tiny_config
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from radixcache.worker.model.loader import LoadedModel, random_model
from radixcache.worker.model.tokenizer import Tokenizer

EOS = "<|eos|>"
CORPUS = [
    "the cache keeps keys and values of every token so that each step is incremental",
    "pages of sixteen tokens are shared between requests with the same prefix",
    "a radix tree maps token prefixes to pages and evicts the least recently used leaves",
] * 20


@functools.lru_cache(maxsize=1)
def byte_tokenizer() -> Tokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return Tokenizer(tok, eos_token=EOS)


# A Gemma-shaped tiny decoder: a sliding layer of window 8 beside a global one, with every switch Gemma 2/3 set.
SLIDING = dict(
    layer_kinds=("sliding", "global"), sliding_window=8, qk_norm=True, norm_plus_one=True, sandwich_norms=True,
    embedding_scale=8.0, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24.0, attn_logit_softcap=20.0,
    rope_local_theta=1e4,
)  # fmt: skip


def tiny_model(seed: int = 0, *, with_eos: bool = True, context: int = 4096, **fields: object) -> LoadedModel:
    """`fields`: further ModelConfig fields (SLIDING: a sliding-window model)."""
    tokenizer = byte_tokenizer()
    config = tiny_config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=context,
        eos_token_ids=(tokenizer.token_to_id(EOS),) if with_eos else (),
        **fields,
    )
    loaded = random_model(config, seed=seed, std=0.3)
    loaded.tokenizer = tokenizer
    return loaded
