"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV pool, HF checkpoint loading, tokenizer."""

from radixcache.worker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from radixcache.worker.model.llama import CausalLM
from radixcache.worker.model.loader import LoadedModel, load_checkpoint, random_model
from radixcache.worker.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "load_checkpoint",
    "random_model",
]
