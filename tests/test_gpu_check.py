"""scripts/gpu_check.py on the CPU, so a typo or a wrong check does not waste the first GPU run: its exit path without
CUDA, and its lifecycle run through the real flashinfer backend code over fake kernels (tests/fake_flashinfer.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from fake_flashinfer import install_fake_cuda

from radixcache.worker.attention import BatchLayout, create_backend
from radixcache.worker.attention.flashinfer_backend import FlashInferAttentionBackend
from radixcache.worker.attention.torch_backend import TorchAttentionBackend

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():  # noqa: ANN201 (the script, imported as a module)
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_without_cuda_runs_the_cpu_parts_writes_files_and_exits_0(gpu_check, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    small = gpu_check.Config("tiny", 4, 2, 64, torch.bfloat16, 16)
    monkeypatch.setattr(gpu_check, "config_matrix", lambda: [small])
    assert gpu_check.main(["--out", str(tmp_path), "--context", "48"]) == 0
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "no CUDA device" in text and "0 failed checks" in text
    summary = json.loads(text.strip().splitlines()[-1])  # the line a person pastes
    assert summary["failed_checks"] == 0 and set(summary["sections"].values()) == {"PASS"}
    assert list(summary["sections"]) == [
        "backend selection and fallbacks",
        "kernels, dry run (torch as the candidate)",
        "MLA: kernels, dry run (torch as the candidate)",
        "tiers below the pool (CPU)",
    ]
    assert "PASS: tiers below the pool (CPU)" in text
    assert "device cpu     auto -> torch      explicit flashinfer: it needs a CUDA device" in text
    assert (
        "MLA 256/64     auto -> torch      explicit flashinfer: FlashInfer's MLA kernels for latent (MLA) pages: "
        in text
    )
    records = json.loads((tmp_path / "gpu_check.json").read_text())
    # fp8's dry run too, then the MLA dry run at both page sizes
    assert [r["section"] for r in records] == ["fallbacks"] * 4 + ["kernels"] * 4 + ["tiers"]
    assert all(r["ok"] for r in records) and records[-4]["steps"] == len(gpu_check.lifecycle(48))
    assert [r["config"]["kv_dtype"] for r in records[-5:-3]] == [None, "fp8_e4m3"]
    mla = records[-3:-1]
    assert [r["config"]["page_size"] for r in mla] == [16, 1] and all(r["config"]["attention"]["latent"] for r in mla)
    assert all(r["steps"] == len(gpu_check.lifecycle(48)) for r in mla)
    assert records[-1]["host_hit_tokens"] > 0 and records[-1]["disk_hit_tokens"] > 0 and records[-1]["identical"]
    assert (tmp_path / "gpu_check.log").exists()


def test_the_config_matrix_covers_what_users_hit(gpu_check) -> None:  # noqa: ANN001
    matrix = gpu_check.config_matrix()
    seen = {(c.head_dim, c.group, c.dtype, c.page_size) for c in matrix}
    for dtype in (torch.bfloat16, torch.float16):
        for page in (1, 16):
            assert (64, 2, dtype, page) in seen  # the shipped default model's geometry
            assert {(128, g, dtype, page) for g in (1, 4, 8)} <= seen
    first = matrix[0]
    assert (first.head_dim, first.group, first.dtype, first.page_size) == (64, 2, torch.bfloat16, 16)


def test_lifecycle_runs_through_the_flashinfer_backend(gpu_check, monkeypatch) -> None:  # noqa: ANN001
    """Re-plans, alternating prefill/decode/mixed steps, a mid-page hit and the long sequence, all through the real
    backend code; the fake kernels compute FlashInfer's documented semantics, so the per-sequence check passes."""
    fake = install_fake_cuda(monkeypatch)
    config = gpu_check.Config("default model", 4, 2, 64, torch.bfloat16, 16)
    result = gpu_check.run_case(config, "cpu", lambda c: FlashInferAttentionBackend("cuda", **c.options()), context=64)
    assert result.ok, result.problems
    plans = [kind for kind, call, _ in fake.lib.calls if call == "plan"]
    assert plans == [spec.kind.replace("mixed", "prefill") for spec in gpu_check.lifecycle(64)]
    runs = [c for c in fake.lib.calls if c[1] == "run"]
    assert len(runs) == len(plans) * (gpu_check.LAYERS + 1)  # every layer, plus the NaN-buffer rerun per step


def test_sliding_lifecycle_plans_each_window_and_never_reads_the_pages_it_left(gpu_check, monkeypatch) -> None:  # noqa: ANN001
    """A Gemma-shaped stack (two layers of window 16 around a global one, a soft cap) through the same lifecycle:
    the pages no window reaches hold NaN, and every sequence still matches the torch backend."""
    fake = install_fake_cuda(monkeypatch)
    attention = gpu_check.AttentionOptions(scale=0.1, soft_cap=50.0, windows=(16, None, 16))
    config = gpu_check.Config("gemma2 sliding", 4, 2, 64, torch.bfloat16, 4, attention)
    result = gpu_check.run_case(config, "cpu", lambda c: FlashInferAttentionBackend("cuda", **c.options()), context=96)
    assert result.ok, result.problems
    plans = [p for _, call, p in fake.lib.calls if call == "plan"]
    assert [p.window_left for p in plans] == [-1, 15] * len(gpu_check.lifecycle(96))


def test_the_matrix_has_gemma_shaped_sliding_stacks(gpu_check) -> None:  # noqa: ANN001
    sliding = [c for c in gpu_check.config_matrix() if c.attention.windows]
    assert {c.attention.soft_cap for c in sliding} == {None, 50.0} and {c.page_size for c in sliding} == {1, 16}
    assert all(c.head_dim == 256 and len(c.attention.windows) == gpu_check.LAYERS for c in sliding)


class OneSequenceWrong(TorchAttentionBackend):
    """Right everywhere except the rows of the batch's last sequence in mixed steps: off by 2%."""

    def forward(self, layer_idx, q, k, v, kv_layer, layout: BatchLayout):  # noqa: ANN001, ANN201
        out = super().forward(layer_idx, q, k, v, kv_layer, layout)
        if not layout.is_decode and layout.batch_size > 1:
            start = int(layout.qo_indptr[-2])
            out[start:] = out[start:] * 1.02
        return out


def test_a_wrong_sequence_next_to_right_ones_is_named(gpu_check) -> None:  # noqa: ANN001
    config = gpu_check.Config("default model", 4, 2, 64, torch.bfloat16, 16)
    result = gpu_check.run_case(config, "cpu", lambda c: OneSequenceWrong("cpu"), context=64)
    assert result.problems[0].startswith("step 1 (prefill) layer 0: sequence C rel err")
    assert not any("sequence A" in problem for problem in result.problems)  # never last: never wrong, never named
    assert result.worst_where[0] in "BCDF"


def test_engine_check_serves_the_default_model_both_ways(gpu_check, tmp_path) -> None:  # noqa: ANN001
    """The engine section with torch standing in for flashinfer: same greedy tokens, a partial hit served."""
    report = gpu_check.Report(tmp_path)
    try:
        gpu_check.check_engine(report, "cpu", candidate="torch", max_tokens=4)
    finally:
        report.close()
    assert report.failures == 0 and report.records[-1]["identical"] == report.records[-1]["requests"] == 5
    lines = (tmp_path / "gpu_check.txt").read_text().splitlines()
    assert lines[0].startswith("engine torch      backend torch, bfloat16, kv bf16, warm-up")
    assert int(lines[0].split(", ")[-1].split()[0]) > 0  # prompt tokens served from the cache


def test_fp8_pages_run_the_lifecycle_through_the_flashinfer_backend(gpu_check, monkeypatch) -> None:  # noqa: ANN001
    """fp8 pages with k_scale 0.5 / v_scale 2.0: plan() gets kv_data_type float8_e4m3fn, every run() its scales, the
    fp8 prefill wrapper is FA2's, and the result matches the torch backend reading the same pages."""
    fake = install_fake_cuda(monkeypatch)
    [config] = [
        c for c in gpu_check.fp8_matrix() if c.page_size == 16 and c.head_dim == 64 and c.dtype == torch.bfloat16
    ]
    result = gpu_check.run_case(config, "cpu", lambda c: FlashInferAttentionBackend("cuda", **c.options()), context=64)
    assert result.ok, result.problems
    plans = [p for _, call, p in fake.lib.calls if call == "plan"]
    assert plans and all(p.kv_data_type == torch.float8_e4m3fn and p.q_data_type == torch.bfloat16 for p in plans)
    prefill = next(w for w in fake.lib.wrappers if type(w).kind == "prefill")
    assert prefill.backend == "fa2"
    assert gpu_check.FP8_SCALES != (1.0, 1.0)  # a dropped scale changes the result, so result.ok means they arrived


def test_the_rows_check_passes_on_the_torch_backend_and_counts_rows(gpu_check, tmp_path) -> None:  # noqa: ANN001
    """The row-exactness section, run here on the torch backend (which is built for it), in float32 (where a backend
    that is not row-exact differs in every row, not only now and then): every row matches."""
    report = gpu_check.Report(tmp_path)
    try:
        gpu_check.check_rows(report, "cpu", candidate="torch", prefix=20, positions=4, dtype=torch.float32)
    finally:
        report.close()
    assert report.failures == 0
    assert [r["identical"] for r in report.records] == [4, 4]
    assert "torch: 4/4 rows in a batch of decodes are the same bits as a decode alone  ok" in report.lines


# --- section 7: MLA (latent pages) ----------------------------------------------------------------------------------
def test_the_mla_matrix_is_flashinfers_split_at_both_page_sizes_and_dtypes(gpu_check) -> None:  # noqa: ANN001
    matrix = gpu_check.mla_matrix()
    assert all(c.attention.latent and c.attention.latent_dims == (512, 64) for c in matrix)
    assert all((c.kv_heads, c.head_dim, c.rank) == (1, 288, 512) for c in matrix)  # a latent page: 2 x 288
    assert {(c.dtype, c.page_size) for c in matrix} >= {(torch.bfloat16, 16), (torch.bfloat16, 1), (torch.float16, 16)}
    assert [(c.dtype, c.kv_dtype) for c in matrix if c.kv_dtype] == [(torch.bfloat16, "fp8_e4m3")]  # fp8: bf16 q only
    assert {c.heads for c in matrix} == {16, 128} and matrix[0].heads == 16
    assert gpu_check.MLA.scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)  # V3's, yarn mscale


@pytest.mark.parametrize("index", [0, 1, 3])  # page sizes 16 and 1, fp8_e4m3 latent pages
def test_mla_lifecycle_runs_through_the_flashinfer_mla_backend(gpu_check, monkeypatch, index: int) -> None:  # noqa: ANN001
    """The section 3 lifecycle on latent pages through the real flashinfer_mla backend over the fake MLA wrapper:
    one plan per step (prefill, decode and mixed alike), every layer run plus the NaN-buffer rerun, each sequence's
    first 512 output dimensions within tolerance of the torch backend, the latents written to the same slots (fp8:
    the same bytes, read with the layer's scale 0.5)."""
    fake = install_fake_cuda(monkeypatch)
    config = gpu_check.mla_matrix()[index]
    assert (config.kv_dtype == "fp8_e4m3") == (index == 3)
    result = gpu_check.run_case(
        config, "cpu", lambda c: create_backend("flashinfer", "cuda", **c.options()), context=64
    )
    assert result.ok, result.problems
    plans = [p for kind, call, p in fake.lib.calls if (kind, call) == ("mla", "plan")]
    assert len(plans) == len(gpu_check.lifecycle(64)) and all(p.causal for p in plans)
    assert all(p.sm_scale == gpu_check.MLA_SCALE and p.page_size == config.page_size for p in plans)
    kv = torch.float8_e4m3fn if config.kv_dtype else config.dtype
    assert all(p.kv_data_type == kv and p.q_data_type == config.dtype for p in plans)
    runs = [c for c in fake.lib.calls if c[:2] == ("mla", "run")]
    assert len(runs) == len(plans) * (gpu_check.LAYERS + 1)


def test_a_wrong_mla_candidate_is_caught(gpu_check) -> None:  # noqa: ANN001
    """A latent candidate with its softmax scale 3% off fails on the compared first 512 output dimensions."""
    wrong = gpu_check.AttentionOptions(scale=1.03 * gpu_check.MLA_SCALE, latent=True, latent_dims=(512, 64))
    config = gpu_check.mla_matrix()[0]
    result = gpu_check.run_case(config, "cpu", lambda c: TorchAttentionBackend("cpu", attention=wrong), context=64)
    assert not result.ok and "rel err" in result.problems[0]


def test_the_mla_engine_check_serves_a_deepseek_model_both_ways(gpu_check, tmp_path) -> None:  # noqa: ANN001
    """Section 7's engine check with torch standing in for flashinfer: same greedy tokens, a mid-page hit served."""
    report = gpu_check.Report(tmp_path)
    try:
        gpu_check.check_mla_engine(report, "cpu", candidate="torch", max_tokens=3, page_sizes=(16,))
    finally:
        report.close()
    record = report.records[-1]
    assert report.failures == 0 and record["identical"] == record["requests"] == 4 and record["page_size"] == 16
    lines = (tmp_path / "gpu_check.txt").read_text().splitlines()
    assert lines[0].startswith("mla engine torch      page 16: backend torch, kv bf16, warm-up")
    assert int(lines[0].split(", ")[-1].split()[0]) == 3 * 29  # each later prompt hits the 29 shared tokens


def test_the_mla_model_is_the_deepseek_fixture_with_flashinfers_split(gpu_check) -> None:  # noqa: ANN001
    """The model section 7 serves is tests/model_fixtures.py's DeepSeek V3 fixture (what test_mla.py checks against
    transformers) with 512 / 64: its config.json, built without transformers, reads as transformers' own does."""
    from model_fixtures import deepseek_config_json, hf_config

    from radixcache.worker.model import ModelConfig
    from radixcache.worker.model.llama import attention_options

    ours = ModelConfig.from_hf_config(deepseek_config_json("DeepseekV3ForCausalLM", **gpu_check.MLA_MODEL))
    theirs = ModelConfig.from_hf_config(hf_config("DeepseekV3ForCausalLM", **gpu_check.MLA_MODEL).to_dict())
    assert ours == theirs
    assert attention_options(ours).latent_dims == (512, 64) and ours.num_heads == 16
    assert ours.mlp_kinds == ("dense", "dense")
