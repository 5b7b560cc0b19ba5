"""`radixcache memory`: how much KV cache a model needs, per token, per sequence and per budget.

    radixcache memory --layers 32 --kv-heads 8 --head-dim 128 --kv-dtype int8 --tokens 4000 --budget 16GiB

Bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element + the precision's scale per
token and head: 2 bytes for int8 and int4, none at full precision or for fp8's per-layer scales). A sequence occupies
whole pages, so with --page-size P it holds ceil(tokens / P) x P token slots.

Sliding-window layers (--sliding-layers N --window W, e.g. Gemma 3: 5 of every 6 layers, W 1024): with window paging
(the worker's default for such models) a sequence holds those layers' values for the pages of its last W tokens
only; the figures are given per layer kind.

Latent pages (multi-head latent attention, DeepSeek V2 / V3: --kv-lora-rank R --rope-dim P, no --kv-heads /
--head-dim): one latent of R + P values per token and layer, laid out as the pool lays it out (radixcache/pool.py,
latent pages: the R + P values of a token contiguous, in two half-rows of (R + P) / 2, the tensors of a pool of one
"head" of (R + P) / 2), so bytes per token = layers x (R + P) x bytes per element (+ 2 x 2 bytes for int8's two fp16
scales, one per half-row; fp8's one per-layer scale costs nothing per token). int4 is refused for latent pages, as the
worker refuses it (worker/engine/step.py, check_latent_pages).
"""

from __future__ import annotations

import argparse
import re

from radixcache.kv_codec import CODECS, codec_of
from radixcache.pool import DTYPES, kv_bytes_per_token
from radixcache.window_parts import first_needed_page

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """'16GiB' / '512 MiB' / '1.5GB' / '1000000' -> bytes. Raises argparse.ArgumentTypeError on anything else."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 16GiB, 512MiB, 80GB, 1000000)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"the budget must be at least 1 byte, got {text!r}")
    return size


def human(num_bytes: float) -> str:
    """Bytes in binary units: 131072 -> '128.0 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixcache memory", description="KV-cache memory calculator (bytes per token, per sequence, per budget)"
    )
    parser.add_argument("--layers", type=_positive, required=True, help="decoder layers")
    parser.add_argument("--kv-heads", type=_positive, help="key/value heads (GQA groups)")
    parser.add_argument("--head-dim", type=_positive, help="dimension of one head")
    parser.add_argument("--kv-lora-rank", type=_positive, help="MLA: the latent's rank (512 for DeepSeek V2 / V3)")
    parser.add_argument("--rope-dim", type=_positive, help="MLA: qk_rope_head_dim, the latent's RoPE part (64)")
    parser.add_argument(
        "--kv-dtype",
        "--dtype",
        dest="kv_dtype",
        default="bf16",
        choices=sorted(set(DTYPES) | set(CODECS)),
        help="KV precision: fp32, bf16, fp16, int8, fp8_e4m3, int4 (default bf16)",
    )
    parser.add_argument("--tokens", type=_positive, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--budget", type=parse_size, help="KV memory budget, e.g. 16GiB: how many sequences fit")
    parser.add_argument("--page-size", type=_positive, default=1, help="tokens per KV page (default 1)")
    parser.add_argument("--sliding-layers", type=int, default=0, help="of --layers, how many slide (default 0)")
    parser.add_argument("--window", type=_positive, help="the sliding layers' window in tokens")
    return parser


def latent_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill args.kv_heads / args.head_dim: given, or the latent page's (1, (R + P) / 2); parser.error naming the
    option when the two ways are mixed, half given, odd, or asked for at a quantized precision."""
    latent = (args.kv_lora_rank, args.rope_dim)
    if latent == (None, None):
        if args.kv_heads is None or args.head_dim is None:
            parser.error("give --kv-heads and --head-dim (or --kv-lora-rank and --rope-dim for an MLA model)")
        return
    if None in latent:
        parser.error("--kv-lora-rank and --rope-dim go together")
    if args.kv_heads is not None or args.head_dim is not None:
        parser.error("--kv-lora-rank / --rope-dim (latent pages) replace --kv-heads / --head-dim")
    width = args.kv_lora_rank + args.rope_dim
    if width % 2:
        parser.error(f"--kv-lora-rank + --rope-dim must be even (a latent is two half-rows), got {width}")
    if codec_of(args.kv_dtype).rotate_keys:
        parser.error(f"--kv-dtype {args.kv_dtype}: latent (MLA) pages cannot be held at int4 (use int8 or fp8_e4m3)")
    args.kv_heads, args.head_dim = 1, width // 2


def formula(layers: int, kv_heads: int, head_dim: int, kv_dtype: str, latent: tuple[int, int] | None = None) -> str:
    """How bytes per token is made, in words: '2 x 32 layers x 8 kv heads x 128 dims x bf16', or for latent pages
    (kv_lora_rank, rope_dim) '32 layers x (512 + 64) latent dims x bf16'."""
    if latent is not None:
        scales = f" + {layers} layers x 2 fp16 scales (one per latent half)" if codec_of(kv_dtype).token_scales else ""
        return f"{layers} layers x ({latent[0]} + {latent[1]}) latent dims x {kv_dtype}{scales} (one latent, no per-head K/V)"
    codec = codec_of(kv_dtype)
    head = f"2 x {layers} layers x {kv_heads} kv heads x "
    if not codec.quantized:
        return head + f"{head_dim} dims x {kv_dtype}"
    element = {1: "1 byte", 2: "half a byte"}[codec.pack]
    if codec.token_scales:
        return head + f"({head_dim} dims x {element} + a 2-byte scale) in {codec.name}"
    return head + f"{head_dim} dims x {element} in {codec.name} (one scale per layer, not per token)"


def main(argv: list[str] | None = None) -> int:
    """argv[0] is the subcommand name ("memory"), as the `radixcache` dispatcher passes it."""
    parser = build_parser()
    args = parser.parse_args(list(argv or [])[1:])
    if not 0 <= args.sliding_layers <= args.layers:
        parser.error(f"--sliding-layers must be in [0, --layers {args.layers}], got {args.sliding_layers}")
    if bool(args.sliding_layers) != (args.window is not None):
        parser.error("--sliding-layers and --window go together")
    latent_shape(parser, args)
    latent = None if args.kv_lora_rank is None else (args.kv_lora_rank, args.rope_dim)
    if args.sliding_layers:
        return by_layer_kind(args)
    per_token = kv_bytes_per_token(args.layers, args.kv_heads, args.head_dim, args.kv_dtype)
    pages = -(-args.tokens // args.page_size)
    per_sequence = pages * args.page_size * per_token
    print(f"KV bytes per token: {per_token} ({human(per_token)})")
    print("  = " + formula(args.layers, args.kv_heads, args.head_dim, args.kv_dtype, latent))
    codec = codec_of(args.kv_dtype)
    if codec.quantized:
        fp16 = kv_bytes_per_token(args.layers, args.kv_heads, args.head_dim, "fp16")
        print(f"  {per_token / fp16:.3f}x the bytes of fp16 ({fp16} per token), scales included")
    paging = f" in {pages} pages of {args.page_size}" if args.page_size > 1 else ""
    print(f"one sequence of {args.tokens} tokens{paging}: {per_sequence} bytes ({human(per_sequence)})")
    if args.budget is not None:
        fit = args.budget // per_sequence
        pages_in_budget = args.budget // (args.page_size * per_token)
        print(
            f"budget {human(args.budget)}: {fit} such sequences fit "
            f"({pages_in_budget} pages, {pages_in_budget * args.page_size} tokens)"
        )
    return 0


def by_layer_kind(args: argparse.Namespace) -> int:
    """The figures of a model with sliding layers: per kind, and one sequence with window paging vs without."""
    ps, sliding = args.page_size, args.sliding_layers
    kinds = {"global": args.layers - sliding, "sliding": sliding}
    per_token = {
        k: kv_bytes_per_token(n, args.kv_heads, args.head_dim, args.kv_dtype) if n else 0 for k, n in kinds.items()
    }
    pages = -(-args.tokens // ps)
    window_pages = pages - first_needed_page(args.tokens, args.window, ps)  # what the next token's window reads
    held = {"global": pages * ps * per_token["global"], "sliding": window_pages * ps * per_token["sliding"]}
    every = pages * ps * (per_token["global"] + per_token["sliding"])
    for kind, n in kinds.items():
        print(f"KV bytes per token, {n} {kind} layers: {per_token[kind]} ({human(per_token[kind])})")
        if n:
            latent = None if args.kv_lora_rank is None else (args.kv_lora_rank, args.rope_dim)
            print("  = " + formula(n, args.kv_heads, args.head_dim, args.kv_dtype, latent))
    total = held["global"] + held["sliding"]
    print(
        f"one sequence of {args.tokens} tokens, window {args.window}: {total} bytes ({human(total)}): global "
        f"{human(held['global'])} + sliding {human(held['sliding'])} ({window_pages} pages); every layer kept: "
        f"{human(every)} ({total / every:.3f}x)"
    )
    if args.budget is not None:
        print(
            f"budget {human(args.budget)}: {args.budget // total} such sequences fit ({args.budget // every} without)"
        )
    return 0
