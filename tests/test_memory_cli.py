import argparse
import subprocess
import sys

import pytest

from radixcache.cli import main as cli_main
from radixcache.memory import human, main, parse_size

LLAMA8B = ["memory", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"]


def test_llama_shape_per_token_and_per_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*LLAMA8B, "--tokens", "4000"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token: 131072 (128.0 KiB)" in out
    assert "  = 2 x 32 layers x 8 kv heads x 128 dims x bf16" in out  # how the number is made
    assert "one sequence of 4000 tokens: 524288000 bytes (500.0 MiB)" in out
    assert main([*LLAMA8B, "--tokens", "3", "--page-size", "2"]) == 0
    assert "one sequence of 3 tokens in 2 pages of 2:" in capsys.readouterr().out
    assert "budget" not in out


def test_budget_counts_whole_sequences(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*LLAMA8B, "--tokens", "4096", "--budget", "16GiB", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "in 256 pages of 16: 536870912 bytes (512.0 MiB)" in out
    assert "budget 16.0 GiB: 32 such sequences fit (8192 pages, 131072 tokens)" in out


def test_pages_round_a_sequence_up(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["memory", "--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--dtype", "fp32", "--tokens", "17"]
    main(tiny)
    assert "one sequence of 17 tokens: 136 bytes (136 B)" in capsys.readouterr().out  # 8 bytes per token
    main([*tiny, "--page-size", "16"])
    assert "17 tokens in 2 pages of 16: 256 bytes" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "0"], "must be >= 1"),
        (["--kv-heads", "x"], "not an integer"),
        (["--dtype", "int3"], "invalid choice"),
        (["--budget", "16 parsecs"], "not a size"),
        (["--budget", "0GiB"], "at least 1 byte"),
        (["--page-size", "-4"], "must be >= 1"),
    ],
)
def test_bad_values_are_clear_argparse_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = dict(zip(LLAMA8B[1::2], LLAMA8B[2::2], strict=True))
    base.update(zip(args[::2], args[1::2], strict=True))
    with pytest.raises(SystemExit) as exc:
        main(["memory", *[x for kv in base.items() for x in kv]])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("usage: radixcache memory")  # names the command the user typed


def test_missing_shape_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["memory", "--tokens", "10"])
    assert "--layers" in capsys.readouterr().err


def test_sizes_and_units() -> None:
    assert parse_size("16GiB") == 16 * 2**30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("512mib") == 512 * 2**20
    assert parse_size("1000") == 1000
    assert human(131072) == "128.0 KiB"
    assert human(3 * 2**40) == "3.0 TiB"
    assert (human(1023), human(1024), human(2**20 - 1), human(2**20)) == ("1023 B", "1.0 KiB", "1024.0 KiB", "1.0 MiB")
    assert human(2**60) == "1048576.0 TiB"  # the largest unit is the last
    assert parse_size("1") == 1
    for bad in ("0", "0.5", "12 parsecs", "GiB", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_dispatcher_and_module_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([*LLAMA8B, "--tokens", "4000"]) == 0
    assert "131072" in capsys.readouterr().out
    run = subprocess.run(
        [sys.executable, "-m", "radixcache", *LLAMA8B, "--tokens", "4000", "--budget", "16GiB"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "131072" in run.stdout and "32 such sequences fit" in run.stdout


def test_quantized_kv_dtypes_count_their_scales(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["memory", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "4096"]
    assert main([*shape, "--kv-dtype", "int8", "--budget", "16GiB", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token: 66560 (65.0 KiB)" in out  # 2 x 32 x 8 x (128 + 2 bytes of fp16 scale)
    assert "(128 dims x 1 byte + a 2-byte scale) in int8" in out and "0.508x the bytes of fp16" in out
    assert "budget 16.0 GiB: 63 such sequences fit (16131 pages" in out  # vs 32 at bf16: the pages it buys
    assert main([*shape, "--kv-dtype", "int4"]) == 0
    assert "KV bytes per token: 33792" in capsys.readouterr().out  # 2 x 32 x 8 x (64 + 2)
    assert main([*shape, "--kv-dtype", "fp8_e4m3"]) == 0
    assert "KV bytes per token: 65536" in capsys.readouterr().out  # its scales are per layer, not per token


def test_a_model_with_sliding_layers_holds_its_window_of_them(capsys: pytest.CaptureFixture[str]) -> None:
    # Gemma 3 1B's shape: 26 layers, 5 global, window 512, one KV head of 256
    gemma = ["memory", "--layers", "26", "--sliding-layers", "21", "--window", "512", "--kv-heads", "1"]
    assert main([*gemma, "--head-dim", "256", "--tokens", "32768", "--page-size", "16", "--budget", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token, 5 global layers: 5120 (5.0 KiB)" in out
    assert "KV bytes per token, 21 sliding layers: 21504 (21.0 KiB)" in out
    # the next token's window (positions 32257..32768) spans pages 2016..2047: 32 pages of the sliding layers
    assert "global 160.0 MiB + sliding 10.5 MiB (32 pages); every layer kept: 832.0 MiB (0.205x)" in out
    assert "budget 8.0 GiB: 48 such sequences fit (9 without)" in out
    with pytest.raises(SystemExit):
        main([*gemma[:5], "--kv-heads", "1", "--head-dim", "8"])  # --sliding-layers without --window


def _printed_bytes_per_token(out: str) -> int:
    line = next(x for x in out.splitlines() if x.startswith("KV bytes per token: "))
    return int(line.split()[4])


@pytest.mark.parametrize(
    ("name", "hf_overrides"),
    [
        ("v3", {}),  # DeepSeek V3's defaults: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64
        ("v2_lite", {"num_hidden_layers": 27, "q_lora_rank": None}),
    ],
)
def test_latent_pages_per_token_agree_with_the_pool_the_worker_builds(
    name: str, hf_overrides: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    """`radixcache memory --kv-lora-rank R --rope-dim P` prints what the worker's pool of that model holds per token
    (its shape from ModelConfig.kv_cache_dims, as worker/engine/step.py builds it), and a budget's page count."""
    import torch
    from transformers import DeepseekV3Config

    from radixcache.pool import KVPool, KVShape
    from radixcache.worker.model import ModelConfig

    hf = {**DeepseekV3Config().to_dict(), **hf_overrides}
    mc = ModelConfig.from_hf_config(hf)
    kv_heads, head_dim = mc.kv_cache_dims
    shape = KVShape(layers=mc.num_layers, kv_heads=kv_heads, head_dim=head_dim)
    pool = KVPool.from_budget(shape, page_size=16, budget_bytes=8 * 2**20, dtype=torch.bfloat16, latent=True)
    layers, rank, rope = str(mc.num_layers), str(mc.kv_lora_rank), str(mc.qk_rope_head_dim)
    args = ["memory", "--layers", layers, "--kv-lora-rank", rank, "--rope-dim", rope, "--dtype", "bf16"]
    assert main([*args, "--page-size", "16", "--budget", "8MiB"]) == 0
    out = capsys.readouterr().out
    assert _printed_bytes_per_token(out) == pool.bytes_per_token == mc.num_layers * 576 * 2
    assert f"({pool.num_pages} pages, {pool.num_pages * 16} tokens)" in out
    assert f"  = {layers} layers x (512 + 64) latent dims x bf16" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-lora-rank", "512"], "--kv-lora-rank and --rope-dim go together"),
        (["--kv-lora-rank", "512", "--rope-dim", "64", "--kv-heads", "8"], "replace --kv-heads / --head-dim"),
        (["--kv-lora-rank", "511", "--rope-dim", "64"], "must be even"),
        (["--kv-lora-rank", "512", "--rope-dim", "64", "--dtype", "int4"], "--kv-dtype int4: latent (MLA) pages"),
        ([], "give --kv-heads and --head-dim"),
    ],
)
def test_latent_options_are_checked_naming_the_option(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--layers", "61", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
