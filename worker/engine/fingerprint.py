"""The fingerprint of everything that changes a page's K/V: what names a disk store's folder (radixcache.store).

Two workers may read each other's pages only when every part agrees:
- the weights: BLAKE2b of every weight file's bytes (a checkpoint: names, sizes, contents of its *.safetensors), or
  the recipe of a random model (seed, scale, dtype); the projections' format (full, or int8 with its kernel);
- the architecture and its config (every ModelConfig field), the model's dtype, the KV pool's precision (kv_dtype:
  a quantized page's scales are part of the page) and the page size;
- for an MLA model, how its latent pages lay a latent out (LATENT_LAYOUT, radixcache/pool.py: "token", token-
  contiguous): a disk tier written before that layout holds the same bytes meaning something else. Only MLA
  models carry this part, so no other model's fingerprint changed with it;
- the tokenizer (its JSON, special tokens and chat template): the same text must map to the same ids;
- where the K/V are computed (device type and attention backend): their last bits may differ, and greedy output
  must equal what this worker computes itself;
- STORE_FORMAT, bumped whenever the file layout or the PageData format changes.
So a model update (#26792 in SGLang) or another model on the same directory (#24758) reads nothing.

Hashing the weight files reads them once (about 1 s per GB on one core): the engine does it in the background after
it starts listening; the disk tier opens when it is done (worker/engine/tiers.py). The digest is remembered in
`DIR/weight-digests.json` by each file's path, size, mtime and inode, so a restart over unchanged files does not
read them again (a file rewritten in place with its old mtime would not be noticed: replace weights, never patch).
"""

from __future__ import annotations

import dataclasses
import json
from hashlib import blake2b
from pathlib import Path
from typing import Any

from radixcache.pool import KVPool
from radixcache.worker.model.loader import LoadedModel

STORE_FORMAT = 1
LATENT_LAYOUT = "token"  # latent pages: each token's latent D contiguous values (radixcache/pool.py)
DIGESTS_FILE = "weight-digests.json"
MAX_MEMO = 64  # checkpoints remembered
_CHUNK = 8 << 20


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's files that hold weights (and the shard index), sorted."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    return files + ([index] if index.is_file() else [])


def weights_digest(loaded: LoadedModel, remember_in: str | Path | None = None) -> str:
    """BLAKE2b-128 of the weights `loaded` came from (see the module docstring). Reads every weight file, unless
    `remember_in` (a folder) remembers the digest of these very files (path, size, mtime, inode)."""
    h = blake2b(digest_size=16)
    if loaded.path is None:
        h.update(str(loaded.weights_id or "unnamed weights").encode("utf-8"))
        return "recipe:" + h.hexdigest()
    files = weight_files(Path(loaded.path))
    identity = "|".join(f"{f.resolve()}:{(st := f.stat()).st_size}:{st.st_mtime_ns}:{st.st_ino}" for f in files)
    memo = Path(remember_in) / DIGESTS_FILE if remember_in is not None else None
    known = _read_memo(memo)
    if identity in known:
        return known[identity]
    for file in files:
        h.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    digest = "files:" + h.hexdigest()
    if memo is not None:
        from radixcache.tiering import write_json

        known[identity] = digest
        try:
            write_json(memo, dict(list(known.items())[-MAX_MEMO:]))
        except OSError:
            pass  # remembering is an optimisation
    return digest


def _read_memo(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return (
        {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}
    )


def fingerprint_parts(
    loaded: LoadedModel, *, pool: KVPool, page_size: int, device: str, backend: str
) -> dict[str, Any]:
    """Everything but the weights digest (cheap), as plain JSON values."""
    config = loaded.config
    params = next(loaded.model.parameters())
    weights = loaded.weights
    if weights == "int8":
        from radixcache.worker.model.quant import int8_kernel

        weights = f"int8/{int8_kernel() if str(device).startswith('cpu') else 'weight-only'}"
    tokenizer = loaded.tokenizer
    latent = {"latent_layout": LATENT_LAYOUT} if config.is_mla else {}
    return {
        **latent,
        "store_format": STORE_FORMAT,
        "config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "weights_format": weights,
        "dtype": str(params.dtype).removeprefix("torch."),
        "kv_dtype": pool.kv_dtype,
        "page_size": int(page_size),
        "tokenizer": tokenizer.digest() if tokenizer is not None else None,
        "device": str(device).split(":")[0],
        "backend": backend,
    }


def fingerprint(parts: dict[str, Any], weights: str) -> str:
    """The folder name of a disk store: 'kv-' + BLAKE2b-128 of the parts and the weights digest."""
    canonical = json.dumps({**parts, "weights": weights}, sort_keys=True, separators=(",", ":"))
    return "kv-" + blake2b(canonical.encode("utf-8"), digest_size=16).hexdigest()


def store_folder(root: str | Path, parts: dict[str, Any], weights: str) -> Path:
    """root/<fingerprint>, created, with FINGERPRINT.json (what it was computed from, for people) inside."""
    folder = Path(root) / fingerprint(parts, weights)
    folder.mkdir(parents=True, exist_ok=True)
    about = folder / "FINGERPRINT.json"
    if not about.is_file():
        from radixcache.tiering import write_json

        write_json(about, {**parts, "weights": weights})
    return folder
