"""worker/model/row_tiles.py: a token's projection is the same bits whatever rows share its step, on this CPU's
kernels and under every instruction-set cap the CPU supports (issue 36: on an AMX Xeon, bf16 rows of 33+ row steps
and float32 MKL rows of 1-15 row steps differed in their last bit from the same rows computed alone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixcache.worker.model import row_tiles
from radixcache.worker.model.llama import Linear
from radixcache.worker.model.packed import PackedLinear
from radixcache.worker.model.quant import Int8Linear, int8_kernel
from radixcache.worker.model.row_tiles import by_row_tiles, row_tile

# The row counts a step can have: a decode, a batch, a verify chunk, around every tile edge, long prefill chunks.
STEP_ROWS = (1, 2, 3, 5, 11, 15, 16, 17, 31, 32, 33, 48, 74, 120, 300)
# Contraction sizes seen to change kernels (688: the default model's MLP; 1024+ take AMX's other order).
SHAPES = ((256, 768), (688, 256), (1024, 512))


def test_every_product_gets_exactly_one_tile_of_rows():
    seen: list[int] = []

    def product(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x * 2

    x = torch.randn(75, 3)
    for rows in (1, 7, 8, 9, 16, 75):
        seen.clear()
        out = by_row_tiles(x[:rows], product, 8)
        assert torch.equal(out, x[:rows] * 2)
        assert seen and set(seen) == {8}, (rows, seen)
        assert len(seen) == -(-rows // 8)


def projections(dtype: torch.dtype, k: int, n: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(k + n)
    linear = Linear(k, n, bias=False)
    if dtype == torch.float32:
        made = {"float32 MKL (a tied lm_head)": linear, "float32 packed": PackedLinear(linear.weight, None)}
        made["int8 " + int8_kernel()] = Int8Linear(linear.weight, None)
        return made
    return {str(dtype): linear.to(dtype)}


def available_dtypes() -> list[torch.dtype]:
    dtypes = [torch.float32, torch.bfloat16]
    try:
        torch.nn.functional.linear(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16))
        dtypes.append(torch.float16)
    except RuntimeError:  # a CPU build without half-precision products
        pass
    return dtypes


@pytest.mark.parametrize("dtype", available_dtypes(), ids=str)
def test_a_rows_projection_is_the_same_bits_alone_and_in_any_step(dtype):
    for k, n in SHAPES:
        for name, layer in projections(dtype, k, n).items():
            x = torch.randn(max(STEP_ROWS), k).to(dtype)
            with torch.inference_mode():
                alone = torch.cat([layer(x[i : i + 1]) for i in range(max(STEP_ROWS))])
                for rows in STEP_ROWS:
                    step = layer(x[:rows])
                    differ = [i for i in range(rows) if not torch.equal(step[i], alone[i])]
                    assert not differ, f"{name} {k}x{n}: rows {differ[:5]} of a {rows}-row step differ from alone"


def test_the_tiles_are_what_the_tables_say():
    assert row_tile(torch.bfloat16) == row_tiles.ROW_TILES[torch.bfloat16] == 32
    assert row_tile(torch.float32) == 16
    assert row_tile(torch.int8) == 16  # a dtype not in the table gets a tile too, never a free shape


def isa_caps() -> list[dict[str, str]]:
    """Instruction-set caps this CPU can run under: each makes torch's own kernels, oneDNN's and MKL's take the
    code paths of an older CPU, so one machine's run also speaks for AVX2-only and AVX-512-without-bf16 machines."""
    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    caps = [{"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}]
    if "avx512f" in flags:
        caps.append({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    if "avx512_bf16" in flags and "amx_bf16" not in flags:
        caps.append({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    # No cap at or above AVX512_CORE_BF16 on an AMX CPU. There the uncapped run is the AMX path, and oneDNN's
    # bf16 kernels under such a cap were not reproducible run to run: in two CI runs, once on the AMX Xeon at
    # AVX512_CORE_AMX and once at AVX512_CORE_BF16 (that run's CPU is not on record), the same prefill step computed
    # twice in one process gave different bits (no way of forming a step was involved; test_model_rows.py no
    # longer repeats a step). A CPU whose own top ISA is avx512_bf16 (an EPYC Zen 4) runs that path uncapped and
    # repeated it bit for bit (200 identical prefills at each cap: the issue 36 note).
    return caps


@pytest.mark.skipif(os.environ.get("RADIXCACHE_ISA_CAP") == "1", reason="already running under a cap")
@pytest.mark.parametrize("cap", isa_caps(), ids=lambda cap: "+".join(f"{k}={v}" for k, v in cap.items()))
def test_rows_are_exact_under_each_instruction_set_cap(cap):
    env = {**os.environ, **cap, "RADIXCACHE_ISA_CAP": "1"}
    tests = [f"{__file__}::test_a_rows_projection_is_the_same_bits_alone_and_in_any_step"]
    tests.append(str(Path(__file__).with_name("test_model_rows.py")))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
