"""The flashinfer path on the CPU: backend selection, the backend's calls into FlashInfer 0.6.x and the start-up
warm-up, with CUDA and flashinfer faked (tests/fake_flashinfer.py) so the first GPU run finds a working path."""

from __future__ import annotations

import itertools
import logging
import random
import sys
import types

import pytest
import torch
from engine_fixtures import tiny_model
from fake_flashinfer import install_fake_cuda

import radixcache.worker.attention.base as base
import radixcache.worker.attention.flashinfer_backend as fb
from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
from radixcache.worker.attention.base import AttentionOptions, BackendUnavailableError
from radixcache.worker.attention.torch_backend import TorchAttentionBackend
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams

GEOMETRY = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": torch.bfloat16}  # the default model's


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    return install_fake_cuda(monkeypatch)


# --- defects 1, 2, 6: auto picks flashinfer only where it can run; an explicit choice says why it cannot ----------
def test_auto_picks_torch_for_a_cpu_device_on_a_cuda_machine(fake_cuda: types.SimpleNamespace) -> None:
    assert create_backend("auto", "cpu", **GEOMETRY).name == "torch"  # `serve --device cpu`, default bf16 model
    assert create_backend("auto", "cuda", **GEOMETRY).name == "flashinfer"


def test_auto_with_dtype_or_geometry_unset_picks_torch(fake_cuda: types.SimpleNamespace) -> None:
    assert create_backend("auto", "cuda").name == "torch"
    assert create_backend("auto", "cuda", **{**GEOMETRY, "dtype": None}).name == "torch"


@pytest.mark.parametrize("head_dim", [16, 32, 96])
def test_auto_picks_torch_for_a_head_dim_without_prefill_kernels(fake_cuda, head_dim: int) -> None:  # noqa: ANN001
    assert create_backend("auto", "cuda", **{**GEOMETRY, "head_dim": head_dim}).name == "torch"
    with pytest.raises(BackendUnavailableError, match=f"head_dim {head_dim} has no FlashInfer prefill kernel"):
        create_backend("flashinfer", "cuda", **{**GEOMETRY, "head_dim": head_dim})


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_auto_picks_flashinfer_for_supported_head_dims(fake_cuda, head_dim: int) -> None:  # noqa: ANN001
    heads = {"num_heads": 8, "num_kv_heads": 8, "head_dim": head_dim, "dtype": torch.float16}
    assert create_backend("auto", "cuda:0", **heads).name == "flashinfer"


@pytest.mark.parametrize(
    ("device", "options", "reason"),
    [
        ("cpu", GEOMETRY, "needs a CUDA device, and the model is on cpu"),
        ("cuda", {**GEOMETRY, "dtype": torch.float32}, "float16/bfloat16, and the model is float32"),
        ("cuda", {**GEOMETRY, "dtype": None}, "dtype to plan, and it is unset"),
    ],
)
def test_explicit_flashinfer_says_why_it_cannot_run(fake_cuda, device: str, options: dict, reason: str) -> None:  # noqa: ANN001
    assert create_backend("auto", device, **options).name == "torch"
    with pytest.raises(BackendUnavailableError, match=reason):
        create_backend("flashinfer", device, **options)


def test_flashinfer_that_does_not_import_is_never_picked(fake_cuda, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    assert create_backend("auto", "cuda", **GEOMETRY).name == "torch"
    with pytest.raises(BackendUnavailableError, match="flashinfer does not import"):
        create_backend("flashinfer", "cuda", **GEOMETRY)


# --- defects 4, 5: the plan-race event and the workspaces ----------------------------------------------------------
def test_plan_event_is_recorded_on_the_backend_devices_stream(fake_cuda: types.SimpleNamespace) -> None:
    backend = create_backend("flashinfer", "cuda:1", **GEOMETRY)
    layout = BatchLayout.build([SequenceSlice([3, 5], 0, 20)], 16)
    backend.begin_step(layout)
    backend.begin_step(layout)  # a re-plan of the same wrapper waits on the event recorded after the previous one
    events = fake_cuda.torch.events
    assert len(events) == 2
    assert [s.device for s in events[0].recorded_on] == [torch.device("cuda:1")]
    assert [s.device for s in events[1].recorded_on] == [torch.device("cuda:1")]
    first, second = events[0].recorded_on[0], events[1].recorded_on[0]
    assert fake_cuda.torch.log == [("record", first), ("synchronize", events[0]), ("record", second)]


def test_workspaces_are_zeroed(fake_cuda: types.SimpleNamespace) -> None:
    create_backend("flashinfer", "cuda", **GEOMETRY)
    kinds = {type(w).kind: w.workspace for w in fake_cuda.lib.wrappers}
    assert set(kinds) == {"prefill", "decode"}
    for kind, workspace in kinds.items():  # fresh device memory holds garbage: the decode kernels need zeros
        assert workspace.numel() == fb.WORKSPACE_BYTES and not bool(workspace.any()), kind


# --- what the backend asks FlashInfer for computes the same attention as the torch backend ------------------------
def _random_step(rng: random.Random, kinds: str, page_size: int, num_pages: int) -> list[SequenceSlice]:
    free = list(range(num_pages))
    rng.shuffle(free)
    slices = []
    for kind in kinds:
        cached, new = (
            (rng.choice([0, rng.randint(1, 40)]), rng.randint(2, 30)) if kind == "p" else (rng.randint(1, 60), 1)
        )
        slices.append(SequenceSlice([free.pop() for _ in range(-(-(cached + new) // page_size))], cached, new))
    return slices


def _compare_with_torch(page_size: int, heads: int, kv_heads: int, attention: AttentionOptions) -> None:
    """Prefill, decode and mixed steps, re-planned on one backend, two layers each: the fake kernels (FlashInfer's
    documented semantics) over the backend's plan() arguments agree with the torch backend. A sliding layer's pages
    that its window has left hold NaN: neither backend may read them."""
    rng = random.Random(page_size * 100 + heads)
    dim, num_pages, layers = 64, 200, 2
    shape = KVShape(layers, kv_heads, dim)
    pool = KVPool(shape, page_size=page_size, num_pages=num_pages, dtype=torch.bfloat16)
    ref_pool = KVPool(shape, page_size=page_size, num_pages=num_pages, dtype=torch.float32)
    geometry = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": dim, "attention": attention}
    backend = create_backend("flashinfer", "cuda", dtype=torch.bfloat16, **geometry)
    reference = create_backend("torch", "cpu", **geometry)
    for kinds in ("pp", "dddd", "pdpd", "d", "pdd"):
        slices = _random_step(rng, kinds, page_size, num_pages)
        layout = BatchLayout.build(slices, page_size)
        pool.kv.normal_()  # the cached prefixes: whatever the pool holds
        ref_pool.kv.copy_(pool.kv.float())
        for layer in range(layers):
            window = attention.window(layer)
            for s in slices if window is not None else ():
                gone = s.pages[: max(0, s.num_cached - window + 1) // page_size]
                pool.kv[layer, gone] = float("nan")
                ref_pool.kv[layer, gone] = float("nan")
        backend.begin_step(layout)
        reference.begin_step(layout)
        for layer in range(layers):
            q = torch.randn(layout.num_tokens, heads, dim).bfloat16()
            k, v = torch.randn(2, layout.num_tokens, kv_heads, dim).bfloat16()
            got = backend.forward(layer, q, k, v, pool.layer(layer), layout)
            want = reference.forward(layer, q.float(), k.float(), v.float(), ref_pool.layer(layer), layout)
            assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got).all())
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
            # K/V written to the same slots
            assert torch.equal(pool.layer(layer).float().nan_to_num(), ref_pool.layer(layer).nan_to_num())


@pytest.mark.parametrize(
    ("page_size", "heads", "kv_heads"), [(16, 4, 2), (1, 4, 2), (16, 8, 8), (16, 12, 2)]
)  # the default model's group 2 (both page sizes); group 1; group 6 takes the tensor-core decode
def test_flashinfer_backend_calls_mean_the_same_attention_as_torch(
    fake_cuda, page_size: int, heads: int, kv_heads: int
) -> None:  # noqa: ANN001, E501
    _compare_with_torch(page_size, heads, kv_heads, AttentionOptions())
    plans = [c for c in fake_cuda.lib.calls if c[1] == "plan"]
    assert [c[0] for c in plans] == ["prefill", "decode", "prefill", "decode", "prefill"]
    assert all(p.causal and p.sm_scale == pytest.approx(64**-0.5) for kind, _, p in plans if kind == "prefill")
    assert all(p.window_left == -1 and p.logits_soft_cap is None for _, _, p in plans)
    decode = next(w for w in fake_cuda.lib.wrappers if type(w).kind == "decode")
    assert decode.use_tensor_cores == (heads // kv_heads not in (1, 2, 3, 4, 8))


@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_and_soft_capped_layers_plan_their_window_and_agree_with_torch(fake_cuda, page_size: int) -> None:  # noqa: ANN001
    """Gemma 2's shape: a sliding layer (window 6) and a global one, a query_pre_attn_scalar scale, a soft cap."""
    attention = AttentionOptions(scale=0.1, soft_cap=3.0, windows=(6, None))
    _compare_with_torch(page_size, 4, 2, attention)
    plans = [(kind, p) for kind, call, p in fake_cuda.lib.calls if call == "plan"]
    assert [kind for kind, _ in plans] == [
        k for k in ("prefill", "decode", "prefill", "decode", "prefill") for _ in "gs"
    ]
    assert [p.window_left for _, p in plans] == [-1, 5] * 5  # one plan per window per step: global, then sliding
    assert all(p.logits_soft_cap == 3.0 and p.sm_scale == 0.1 for _, p in plans)
    assert len(fake_cuda.lib.wrappers) == 4  # a prefill and a decode wrapper per window
    assert len({id(w.workspace) for w in fake_cuda.lib.wrappers}) == 2  # each kind's windows share a workspace


# --- defect 3: the warm-up runs a prefill, a decode and a mixed batch; under auto a failure falls back to torch ------
class PrefillFailsBackend(TorchAttentionBackend):
    """Like FlashInfer on Hopper with a head_dim FA3 lacks: decode works, every prefill plan fails."""

    name = "flashinfer"
    steps: list[str] = []

    def begin_step(self, layout: BatchLayout) -> None:
        kind = "decode" if layout.is_decode else "mixed" if 1 in layout.num_new else "prefill"
        type(self).steps.append(kind)
        if kind != "decode":
            raise RuntimeError("FA3 prefill module failed to compile")
        super().begin_step(layout)


@pytest.fixture
def failing_flashinfer(monkeypatch: pytest.MonkeyPatch) -> type[PrefillFailsBackend]:
    monkeypatch.setattr(base, "flashinfer_unsupported_reason", lambda *a, **k: None)
    monkeypatch.setitem(base._REGISTRY, "flashinfer", PrefillFailsBackend)
    monkeypatch.setattr(PrefillFailsBackend, "steps", [])
    return PrefillFailsBackend


def test_warm_up_runs_prefill_decode_and_mixed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[list[int], list[int]]] = []

    class Recording(TorchAttentionBackend):
        def begin_step(self, layout: BatchLayout) -> None:
            seen.append((layout.num_new, [s - n for s, n in zip(layout.seq_lens, layout.num_new, strict=True)]))
            super().begin_step(layout)

    monkeypatch.setitem(base._REGISTRY, "torch", Recording)
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=64, backend="torch"))
    engine.start()
    try:
        assert seen[:3] == [([6], [0]), ([1], [6]), ([1, 6], [7, 0])]  # a prefill across pages; decodes start mid-page
        # then the row check (worker/engine/row_check.py): 3 prefills, 4 decodes alone, 4 in pairs, a verify, a chunk
        assert [len(new) for new, _ in seen[3:]] == [3] + [1] * 4 + [2] * 4 + [2, 2]
        engine.cache.check(idle=True)
        assert engine.cache.stats().pages_in_use == 0  # nothing of the warm-up is kept or served
    finally:
        engine.shutdown()


def test_auto_falls_back_to_torch_when_the_warm_up_fails(failing_flashinfer, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=64, backend="auto"))
    assert engine.backend.name == "flashinfer"
    with caplog.at_level(logging.WARNING, logger="radixcache.engine"):
        engine.start()
    try:
        assert failing_flashinfer.steps == ["prefill"]  # the decode-only warm-up never reached the failing kind
        assert engine.backend.name == "torch"
        assert any(
            "failed its start-up warm-up" in r.getMessage() and "torch" in r.getMessage() for r in caplog.records
        )
        done = []
        engine.submit(Request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3)), done.append)
        engine.shutdown(drain=True, timeout=30)
        assert done[-1].finished and done[-1].error is None
        assert sum(len(o.token_ids) for o in done) == 3
    finally:
        engine.shutdown(drain=False)


def test_explicit_backend_that_fails_the_warm_up_stops_start_up(failing_flashinfer) -> None:  # noqa: ANN001
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=64, backend="flashinfer"))
    with pytest.raises(RuntimeError, match="'flashinfer' failed its start-up warm-up .*FA3 prefill module"):
        engine.start()


def test_serve_with_an_impossible_backend_says_why_and_exits_2():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "radixcache", "serve", "--random-model", "--device", "cpu", "--backend", "flashinfer",
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot run here" in proc.stderr and "Traceback" not in proc.stderr


def test_kv_precision_decides_whether_flashinfer_runs(fake_cuda: types.SimpleNamespace) -> None:
    """fp8_e4m3 pages go to FlashInfer; int8 / int4 pages have no FlashInfer kernel, so auto picks the torch backend
    (which dequantizes in its gather) and an explicit flashinfer says so; 16-bit pages must be the model's dtype."""
    assert create_backend("auto", "cuda", **GEOMETRY, kv_dtype="fp8_e4m3").name == "flashinfer"
    assert create_backend("auto", "cuda", **GEOMETRY, kv_dtype="bf16").name == "flashinfer"
    for kv_dtype, reason in (
        ("int8", "no kernel for int8/int4 KV pages"),
        ("int4", "no kernel for int8/int4 KV pages"),
        ("fp16", "the model's dtype or fp8_e4m3, and the KV dtype is fp16"),
        ("fp32", "the model's dtype or fp8_e4m3, and the KV dtype is fp32"),
    ):
        assert create_backend("auto", "cuda", **GEOMETRY, kv_dtype=kv_dtype).name == "torch"
        with pytest.raises(BackendUnavailableError, match=reason):
            create_backend("flashinfer", "cuda", **GEOMETRY, kv_dtype=kv_dtype)


def test_an_int8_engine_on_cuda_runs_on_the_torch_backend(fake_cuda: types.SimpleNamespace) -> None:
    model = tiny_model()
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=32, kv_dtype="int8"))
    assert engine.backend.name == "torch" and engine.kv_dtype == "int8"


# --- latent (MLA) models: FlashInfer's MLA wrapper where its kernels apply, the torch backend elsewhere ---------------
MLA_GEOMETRY = {"num_heads": 16, "num_kv_heads": 1, "head_dim": 288, "dtype": torch.bfloat16}  # DeepSeek V3's latent
DEEPSEEK = AttentionOptions(scale=0.1, latent=True, latent_dims=(512, 64))


def test_a_deepseek_shaped_model_on_cuda_gets_flashinfers_mla_kernels(fake_cuda: types.SimpleNamespace) -> None:
    from radixcache.worker.attention.flashinfer_mla_backend import FlashInferMLABackend

    for name in ("auto", "flashinfer"):
        backend = create_backend(name, "cuda", **MLA_GEOMETRY, attention=DEEPSEEK, kv_dtype="bf16")
        assert isinstance(backend, FlashInferMLABackend) and backend.name == "flashinfer_mla"
    assert create_backend("torch", "cuda", **MLA_GEOMETRY, attention=DEEPSEEK).name == "torch"
    assert create_backend("auto", "cuda", **{**MLA_GEOMETRY, "dtype": torch.float16}, attention=DEEPSEEK).name == (
        "flashinfer_mla"
    )
    (wrapper, *others) = [w for w in fake_cuda.lib.wrappers if type(w).kind == "mla"]
    assert wrapper.backend == "auto" and not bool(wrapper.workspace.any())  # zeroed: fresh device memory is garbage


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"attention": AttentionOptions(latent=True, latent_dims=(32, 8))},
         "built for kv_lora_rank 512 with a rope dim of 64, and the model's are 32 and 8"),
        ({"attention": AttentionOptions(latent=True, latent_dims=(512, 32))}, "the model's are 512 and 32"),
        ({"attention": AttentionOptions(latent=True, latent_dims=(256, 64))}, "the model's are 256 and 64"),
        ({"attention": AttentionOptions(latent=True)}, "the latent's split \\(kv_lora_rank, rope dim\\) to plan"),
        ({"dtype": torch.float32}, "MLA kernels run float16/bfloat16, and the model is float32"),
        ({"dtype": None}, "model dtype to plan, and it is unset"),
        ({"num_heads": None}, "num_heads to plan"),
        ({"kv_dtype": "int8"}, "no MLA kernel for int8/int4 latent pages"),
        ({"kv_dtype": "int4"}, "no MLA kernel for int8/int4 latent pages"),
        ({"kv_dtype": "fp8_e4m3", "dtype": torch.float16}, "fp8 MLA kernels take bfloat16 queries only"),
        ({"kv_dtype": "fp16"}, "latent pages in the model's dtype or fp8_e4m3, and the KV dtype is fp16"),
    ],
)  # fmt: skip
def test_where_flashinfers_mla_kernels_do_not_apply_auto_picks_torch_and_flashinfer_says_why(
    fake_cuda, change: dict, reason: str
) -> None:  # noqa: ANN001
    options = {**MLA_GEOMETRY, "attention": DEEPSEEK, "kv_dtype": "bf16", **change}
    assert create_backend("auto", "cuda", **options).name == "torch"
    with pytest.raises(BackendUnavailableError, match=f"MLA kernels for latent \\(MLA\\) pages: .*{reason}"):
        create_backend("flashinfer", "cuda", **options)
    assert not [w for w in fake_cuda.lib.wrappers if type(w).kind == "mla"]


def test_a_flashinfer_without_the_mla_wrapper_or_that_does_not_import_is_never_picked(
    fake_cuda, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    monkeypatch.delattr(fake_cuda.lib, "BatchMLAPagedAttentionWrapper")
    assert create_backend("auto", "cuda", **MLA_GEOMETRY, attention=DEEPSEEK).name == "torch"
    with pytest.raises(BackendUnavailableError, match="has no BatchMLAPagedAttentionWrapper"):
        create_backend("flashinfer", "cuda", **MLA_GEOMETRY, attention=DEEPSEEK)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert create_backend("auto", "cuda", **MLA_GEOMETRY, attention=DEEPSEEK).name == "torch"
    with pytest.raises(BackendUnavailableError, match="flashinfer does not import"):
        create_backend("flashinfer", "cuda", **MLA_GEOMETRY, attention=DEEPSEEK)


def test_the_mla_plan_waits_for_the_previous_one_and_records_on_the_devices_stream(
    fake_cuda: types.SimpleNamespace,
) -> None:
    backend = create_backend("flashinfer", "cuda:1", **MLA_GEOMETRY, attention=DEEPSEEK)
    layout = BatchLayout.build([SequenceSlice([3, 5], 0, 20), SequenceSlice([7], 4, 1)], 16)
    backend.begin_step(layout)
    backend.begin_step(layout)
    events = fake_cuda.torch.events
    assert len(events) == 2 and [s.device for e in events for s in e.recorded_on] == [torch.device("cuda:1")] * 2
    assert fake_cuda.torch.log == [("record", events[0].recorded_on[0]), ("synchronize", events[0]),
                                   ("record", events[1].recorded_on[0])]  # fmt: skip
    plan = fake_cuda.lib.calls[0][2]
    assert (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_len) == (
        [0, 20, 21],
        [0, 2, 3],
        [3, 5, 7],
        [20, 5],
    )
    assert (plan.num_heads, plan.head_dim_ckv, plan.head_dim_kpe, plan.page_size) == (16, 512, 64, 16)
    assert plan.causal is True and plan.sm_scale == 0.1
    assert plan.q_data_type == plan.kv_data_type == torch.bfloat16


def _mla_reference(q: torch.Tensor, tokens: torch.Tensor, layout: BatchLayout, scale: float, rank: int) -> torch.Tensor:
    """MLA attention straight from its definition over the pool's latents [pages, page_size, D] (float32): every
    position's key the whole latent, its value the first `rank` values, causal within each sequence."""
    out = torch.empty(q.shape[0], q.shape[1], rank)
    bounds, ps = layout.qo_indptr.tolist(), layout.page_size
    starts = [0, *itertools.accumulate(-(-n // ps) for n in layout.seq_lens)]
    for b, total in enumerate(layout.seq_lens):
        lat = tokens[layout.kv_indices[starts[b] : starts[b + 1]].long()].reshape(-1, tokens.shape[-1])[:total].float()
        rows = slice(bounds[b], bounds[b + 1])
        qb = q[rows].float()
        n = qb.shape[0]
        scores = torch.einsum("nhd,ld->hnl", qb, lat) * scale
        hidden = torch.arange(total)[None, :] > (total - n + torch.arange(n))[:, None]
        out[rows] = torch.einsum("hnl,lr->nhr", scores.masked_fill(hidden, float("-inf")).softmax(-1), lat[:, :rank])
    return out


@pytest.mark.parametrize(("page_size", "heads"), [(16, 16), (1, 16), (4, 3)])
def test_the_mla_backends_calls_compute_mla_over_the_latent_pages_it_wrote(
    fake_cuda, page_size: int, heads: int
) -> None:  # noqa: ANN001
    """Prefill, decode and mixed steps (cached prefixes ending mid-page among them), re-planned on one backend: each
    step's latents land whole at their (page, slot) of the token-contiguous pool, as the torch backend writes them,
    and the fake MLA kernel over the backend's plan() / run() arguments (ckv / kpe as column views of
    latent_tokens(), q split at R) gives the torch backend's output (its first R dimensions) on the same pages, and
    MLA attention straight from its definition."""
    rank, rope = DEEPSEEK.latent_dims  # type: ignore[misc]
    half, layers = (rank + rope) // 2, 2
    rng = random.Random(page_size * 7 + heads)
    pool = KVPool(KVShape(layers, 1, half), page_size=page_size, num_pages=400, dtype=torch.bfloat16, latent=True)
    pool.kv.normal_()  # stale latents everywhere: only the block tables' positions may be read
    ref_pool = KVPool(KVShape(layers, 1, half), page_size=page_size, num_pages=400, dtype=torch.float32, latent=True)
    ref_pool.kv.copy_(pool.kv.float())
    backend = create_backend("flashinfer", "cuda", **{**MLA_GEOMETRY, "num_heads": heads}, attention=DEEPSEEK)
    reference = create_backend("torch", "cpu", attention=DEEPSEEK)
    for kinds in ("pp", "dddd", "pdpd", "d", "pdd"):
        slices = _random_step(rng, kinds, page_size, 400)
        layout = BatchLayout.build(slices, page_size)
        backend.begin_step(layout)
        reference.begin_step(layout)
        for layer in range(layers):
            q = torch.randn(layout.num_tokens, heads, rank + rope).bfloat16()
            latent = torch.randn(layout.num_tokens, 1, rank + rope).bfloat16()
            got = backend.forward(layer, q, latent[..., :half], latent[..., half:], pool.kv_layer(layer), layout)
            k, v = latent.float()[..., :half], latent.float()[..., half:]
            want = reference.forward(layer, q.float(), k, v, ref_pool.kv_layer(layer), layout)[..., :rank]
            tokens = pool.kv_layer(layer).latent_tokens()
            assert torch.equal(tokens[layout.write_pages, layout.write_slots], latent[:, 0])  # written whole
            assert torch.equal(tokens.float(), ref_pool.kv_layer(layer).latent_tokens())  # where torch writes them
            assert got.shape == (layout.num_tokens, heads, rank) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
            direct = _mla_reference(q, tokens, layout, DEEPSEEK.scale, rank)  # type: ignore[arg-type]
            torch.testing.assert_close(got.float(), direct, atol=2e-2, rtol=2e-2)
    runs = [c[2] for c in fake_cuda.lib.calls if c[:2] == ("mla", "run")]
    assert len(runs) == 5 * layers
    row = page_size * (rank + rope)
    assert all(ckv == (row, rank + rope, 1) and kpe == (row, rank + rope, 1) for _, ckv, kpe in runs)  # views, no copy


def test_a_deepseek_model_on_flashinfers_mla_kernels_gives_the_torch_backends_logits(fake_cuda) -> None:  # noqa: ANN001
    """worker/model/mla.py end to end over the flashinfer_mla backend (fake kernels) and over the torch backend: a
    DeepSeek V3 of tests/model_fixtures.py's fixture with FlashInfer's 512 / 64 latent and 16 heads, bf16, a prefill
    then a mixed step (a decode beside a prefill on a cached prefix ending mid-page): the same logits within bf16
    rounding, and the same latent pages."""
    from model_fixtures import deepseek_config_json

    from radixcache.worker.model import ModelConfig, random_model
    from radixcache.worker.model.llama import attention_options

    fields = dict(
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64, hidden_size=128,
        num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=2, first_k_dense_replace=2,
    )  # fmt: skip
    config = ModelConfig.from_hf_config(deepseek_config_json("DeepseekV3ForCausalLM", **fields))
    model = random_model(config, seed=1, dtype=torch.bfloat16, std=0.1).model
    options = dict(
        num_heads=config.num_heads, num_kv_heads=1, head_dim=288, dtype=torch.bfloat16,
        attention=attention_options(config), kv_dtype="bf16",
    )  # fmt: skip
    ps, g = 16, torch.Generator().manual_seed(0)
    tokens = torch.randint(3, config.vocab_size, (2, 64), generator=g)
    steps = [
        [SequenceSlice([0, 1, 2], 0, 21)],
        [SequenceSlice([0, 1, 2], 21, 1), SequenceSlice([4, 5, 6], 0, 30)],
    ]
    logits, pools = {}, {}
    for name in ("flashinfer", "torch"):
        backend = create_backend(name, "cuda" if name == "flashinfer" else "cpu", **options)
        pool = KVPool(KVShape(2, 1, 288), page_size=ps, num_pages=8, dtype=torch.bfloat16, latent=True)
        out = []
        with torch.inference_mode():
            for step in steps:
                ids = torch.cat([tokens[int(s.pages[0] > 0), s.num_cached : s.total] for s in step])
                out.append(model(ids, BatchLayout.build(step, ps), pool, backend, all_logits=True).float())
        logits[backend.name], pools[backend.name] = torch.cat(out), pool
    assert set(logits) == {"flashinfer_mla", "torch"}
    torch.testing.assert_close(logits["flashinfer_mla"], logits["torch"], atol=0.1, rtol=0)  # logits std ~1.1
    for layer in range(2):
        mla_pages = pools["flashinfer_mla"].kv_layer(layer).latent_tokens().float()
        torch_pages = pools["torch"].kv_layer(layer).latent_tokens().float()
        torch.testing.assert_close(mla_pages, torch_pages, atol=0.05, rtol=0.05)
    assert len([c for c in fake_cuda.lib.calls if c[:2] == ("mla", "run")]) == 2 * 2  # every layer of each step


def test_fp8_latent_pages_need_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer's fp8 MLA plan() needs an SM90 device: elsewhere auto picks torch and flashinfer says why."""
    install_fake_cuda(monkeypatch, hopper=False)
    options = {**MLA_GEOMETRY, "attention": DEEPSEEK, "kv_dtype": "fp8_e4m3"}
    assert create_backend("auto", "cuda", **options).name == "torch"
    with pytest.raises(
        BackendUnavailableError, match="fp8 MLA kernels run on SM90 \\(Hopper\\) only, and the device is SM80"
    ):
        create_backend("flashinfer", "cuda", **options)
    assert create_backend("auto", "cuda", **{**options, "kv_dtype": "bf16"}).name == "flashinfer_mla"  # 16-bit: any GPU


@pytest.mark.parametrize("page_size", [16, 1])
def test_fp8_latent_pages_run_on_flashinfers_fp8_mla_path_and_agree_with_torch(fake_cuda, page_size: int) -> None:  # noqa: ANN001
    """fp8_e4m3 latent pages (a bf16 model on Hopper): plan(kv_data_type=float8_e4m3fn), run(ckv_scale=, kpe_scale=)
    with the layer's one latent scale (0.5 here, so a dropped scale shows), the latents written byte-identical to
    the torch backend's and the output its (dequantizing the same pages in float32) within bf16 rounding."""
    rank, rope = DEEPSEEK.latent_dims  # type: ignore[misc]
    half, layers, heads = (rank + rope) // 2, 2, 16
    rng = random.Random(page_size)
    scales = torch.tensor([[0.5, 2.0], [0.25, 4.0]])  # a latent arena keeps the K scale for the whole latent
    pools = [
        KVPool(KVShape(layers, 1, half), page_size=page_size, num_pages=400, dtype="fp8_e4m3", latent=True,
               kv_scales=scales)
        for _ in range(2)
    ]  # fmt: skip
    pools[0].kv.copy_(torch.randn(pools[0].kv.shape).to(torch.float8_e4m3fn))
    pools[1].kv.copy_(pools[0].kv)
    backend = create_backend("flashinfer", "cuda", **MLA_GEOMETRY, attention=DEEPSEEK, kv_dtype="fp8_e4m3")
    reference = create_backend("torch", "cpu", attention=DEEPSEEK)
    for kinds in ("pp", "dddd", "pdpd"):
        layout = BatchLayout.build(_random_step(rng, kinds, page_size, 400), page_size)
        backend.begin_step(layout)
        reference.begin_step(layout)
        for layer in range(layers):
            q = torch.randn(layout.num_tokens, heads, rank + rope).bfloat16()
            latent = torch.randn(layout.num_tokens, 1, rank + rope).bfloat16()
            k, v = latent[..., :half], latent[..., half:]
            got = backend.forward(layer, q, k, v, pools[0].kv_layer(layer), layout)
            want = reference.forward(layer, q.float(), k.float(), v.float(), pools[1].kv_layer(layer), layout)
            assert torch.equal(pools[0].kv.view(torch.uint8), pools[1].kv.view(torch.uint8))  # the same fp8 bytes
            torch.testing.assert_close(got.float(), want[..., :rank], atol=2e-2, rtol=2e-2)
    plans = [c[2] for c in fake_cuda.lib.calls if c[:2] == ("mla", "plan")]
    assert plans and all(p.kv_data_type == torch.float8_e4m3fn and p.q_data_type == torch.bfloat16 for p in plans)
    assert [k for k, _ in scales.tolist()] == [pools[0].kv_layer(i).k_scale for i in range(layers)]


def test_fp8_latent_pages_need_a_flashinfer_whose_mla_run_takes_the_scales(fake_cuda, monkeypatch) -> None:  # noqa: ANN001
    """An older flashinfer's MLA run() without ckv_scale / kpe_scale: fp8 latent pages go to torch, 16-bit ones stay."""

    def old_run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):  # noqa: ANN001, ANN202
        raise AssertionError("never run")

    monkeypatch.setattr(fake_cuda.lib.BatchMLAPagedAttentionWrapper, "run", old_run)
    options = {**MLA_GEOMETRY, "attention": DEEPSEEK, "kv_dtype": "fp8_e4m3"}
    assert create_backend("auto", "cuda", **options).name == "torch"
    with pytest.raises(BackendUnavailableError, match="MLA run\\(\\) takes no ckv_scale / kpe_scale"):
        create_backend("flashinfer", "cuda", **options)
    assert create_backend("auto", "cuda", **{**options, "kv_dtype": "bf16"}).name == "flashinfer_mla"
