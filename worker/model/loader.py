"""Load a local Hugging Face checkpoint folder, or build a model with seeded random weights.

A checkpoint folder holds config.json, the weights (model.safetensors, or shards listed in
model.safetensors.index.json), tokenizer.json and optionally tokenizer_config.json / generation_config.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from radixcache.pool import parse_dtype
from radixcache.worker.model.config import ModelConfig
from radixcache.worker.model.llama import CausalLM
from radixcache.worker.model.packed import pack_linears, packing_available
from radixcache.worker.model.quant import WEIGHT_FORMATS, quantize_int8
from radixcache.worker.model.tokenizer import Tokenizer

PROGRESS_BAR_BYTES = 256 * 1024 * 1024  # show a progress bar when the weights are at least this large


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None  # None only for random_model
    path: Path | None
    weights: str = "full"  # the projections' format (WEIGHT_FORMATS): part of what the K/V depend on
    weights_id: str | None = None  # names the weights where no file does: random_model's recipe


def _empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Allocate parameters without initialising them (initialisation of a 7B model on CPU takes minutes)."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.keep_float32_routers()
    model.tie_weights()
    model.init_rotations(device)
    return model.eval().requires_grad_(False)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing in {path}: {', '.join(missing)}")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors or model.safetensors.index.json with its shards "
        "(.bin / .pt checkpoints are not supported; convert them to safetensors)"
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _check_weights(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")


def _finish(model: CausalLM, device: torch.device, weights: str) -> None:
    """The layout the kernels want: int8 projections (weights="int8"); on a CPU, float32 projections packed for
    oneDNN (worker/model/packed.py) and other dtypes' stored input-major."""
    if weights == "int8":
        quantize_int8(model)
    elif packing_available(device, model.model.embed_tokens.weight.dtype):
        tied = model.lm_head if model.config.tie_word_embeddings else None
        pack_linears(model, skip=tied)  # a tied LM head is the embedding table: it stays as it is
    elif device.type == "cpu":
        model.store_linear_weights_input_major()


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    weights: str = "full",
) -> LoadedModel:
    """Load config, weights and tokenizer from a local checkpoint folder.

    dtype None uses the checkpoint's own dtype (config.json "dtype"/"torch_dtype"), float32 when unstated.
    weights "int8" stores every projection as int8 (worker/model/quant.py); "full" keeps `dtype`.
    Raises FileNotFoundError naming the missing file and folder, ValueError for an unsupported architecture or
    a checkpoint whose tensors do not match the config (naming the tensors).
    """
    _check_weights(weights)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"config.json is missing in {path}")
    hf = json.loads(config_file.read_text(encoding="utf-8"))
    config = ModelConfig.from_hf_config(hf)
    files = _weight_files(path)
    generation = _read_json(path / "generation_config.json")
    gen_eos = generation.get("eos_token_id")
    extra_eos = set(config.eos_token_ids) | set(
        gen_eos if isinstance(gen_eos, list) else [gen_eos] * (gen_eos is not None)
    )
    tokenizer = Tokenizer.from_dir(path, extra_eos_ids=extra_eos, bos_token_id=config.bos_token_id)

    device = torch.device(device)
    dtype = parse_dtype(dtype or hf.get("dtype") or hf.get("torch_dtype") or torch.float32)
    model = _empty_model(config, device, dtype)
    total = sum(f.stat().st_size for f in files)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < PROGRESS_BAR_BYTES
        ) as bar:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        tensor = f.get_tensor(name)
                        bar.update(tensor.numel() * tensor.element_size())
                        yield name, tensor

    filled = model.load_weights(tensors())
    missing = model.expected_weights() - filled
    if missing:
        shown = ", ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors the config needs: {shown}")
    _finish(model, device, weights)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=path, weights=weights)


def random_model(
    config: ModelConfig,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    std: float = 0.02,
    weights: str = "full",
) -> LoadedModel:
    """A model with seeded random weights (normal(0, std) matrices, unit norm scales, zero biases) for tests and
    benchmarks; the same seed gives the same weights on every device. No tokenizer. `weights` as in
    load_checkpoint."""
    _check_weights(weights)
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    model = _empty_model(config, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(0.0 if config.norm_plus_one else 1.0)  # a scale of 1 either way
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    _finish(model, device, weights)
    recipe = f"random_model seed={seed} std={std!r} dtype={dtype}"
    return LoadedModel(model=model, config=config, tokenizer=None, path=None, weights=weights, weights_id=recipe)
