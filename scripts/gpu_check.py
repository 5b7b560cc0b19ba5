"""`make gpu-check`: the FlashInfer path checked against the torch backend on what users will run, then timings.

Runs on the machine's python3 with the package installed from the checkout (`make gpu-check` does
`pip install --no-deps -e .` first, so radixcache.worker is the installed name; no venv). Everything it prints also goes to files under --out (default
$OUT, else ./gpu-check-out), rewritten after every line so a run stopped at its time limit keeps what it did:
gpu_check.txt (the tables), gpu_check.log (logging, with tracebacks) and gpu_check.json (one record per check).

Sections (each row says ok / FAIL and each section ends with a PASS or FAIL line; the last line is one JSON object
of every section's verdict, to paste; exit status 1 if any check fails, 0 otherwise, including without CUDA):
1. environment: torch, CUDA, the GPU, nvcc, flashinfer.
2. backend selection and fallbacks: fp32, head_dim 96, a CPU device and a latent (MLA) model of a split FlashInfer's
   MLA kernels lack (256 / 64) must give the torch backend under `auto` (and run a step), while an explicit
   `flashinfer` must refuse with its reason.
3. kernels, on the configurations users hit: the default model's geometry (4 heads, 2 KV heads, head_dim 64) and
   head_dim 128 with GQA groups 1, 4 and 8; bf16 and fp16; page sizes 1 and 16; and Gemma-shaped stacks (head_dim
   256, sliding layers of windows 1024 / 4096 beside a global one, Gemma 2's soft cap 50 and a scale that is not
   1/sqrt(head_dim)), where the pages a sliding layer's window has left hold NaN. Per configuration, one backend
   lives through a scripted serving lifecycle: re-planned every step, prefill / decode / mixed steps alternating,
   3 layers per plan, a partial prefix hit starting mid-page through KVPool.copy_prefix, a chunked prefill on a
   sequence's own prefix, and a context of 8k tokens. Every step and layer is compared with the torch backend in
   float32 on the same data, error measured per sequence (a wrong short sequence cannot hide behind a long one),
   K/V written to the same slots, and once per step the kernel runs into a NaN-filled buffer (a skipped row shows).
   The first configuration's first step carries FlashInfer's JIT compilation: its time is printed.
   fp8_e4m3 KV pages (--kv-dtype fp8_e4m3: plan()'s kv_data_type float8_e4m3fn, run()'s k_scale / v_scale, here
   0.5 and 2.0 so a dropped scale shows) go through the same lifecycle against the torch backend reading the same
   fp8 pages in float32; the pages each backend writes must be byte-identical.
4. engine: the shipped default model served with flashinfer and with torch gives the same greedy tokens, with
   pages in the model's dtype and in fp8_e4m3.
5. timings: decode attention time and the KV bandwidth it reaches, next to the device's copy bandwidth (bf16 and
   fp8 pages).
6. tiers below the pool: the default model served with a host-memory tier (pinned on CUDA) over a disk tier; a
   prompt pushed out of a small pool comes back from them with the same greedy tokens; a page's copy out of the pool
   (read_page) and into it (write_page) timed. Runs on the CPU too (host memory unpinned there).
7. MLA (DeepSeek V2 / V3 latent pages through FlashInfer's BatchMLAPagedAttentionWrapper, the flashinfer_mla
   backend; run right after section 4's first checks, before the rest of section 3's matrix): the kernels on the
   section 3 lifecycle over latent pages of kv_lora_rank 512 + rope 64 (16 heads in bf16 at page sizes 16 and 1,
   fp16, fp8_e4m3 latent pages on FlashInfer's fp8 MLA path (ckv_scale = kpe_scale = the layer's latent scale, 0.5;
   byte-identical pages), then 128 heads; DeepSeek V3's softmax scale with yarn's mscale), the first 512 output
   dimensions compared with the torch backend in float32 per sequence, the latents written to the same slots, the
   NaN-buffer rerun; and
   a tiny DeepSeek-V3-shaped model (tests/model_fixtures.py's DeepSeek fixture with 512 / 64 and 16 heads, random
   weights) served with flashinfer and with torch at page size 16 (a prefix hit ending mid-page; page size 1 is left
   to the kernel cases, for time): the same greedy tokens, the candidate really being flashinfer_mla.
Sections 3, 5 and 7's kernels stop starting new work after --budget seconds, so the whole run stays under ~8
minutes. The final JSON's "sections" has one key per section title run; the MLA ones are "MLA: flashinfer_mla
kernels vs torch (float32) on latent pages" and "MLA engine: DeepSeek-V3-shaped 512/64, flashinfer vs torch,
greedy" (on the CPU: "MLA: kernels, dry run (torch as the candidate)").

Without CUDA, section 2 runs on the CPU and sections 3 and 7's kernels run as a dry run with the torch backend as
the candidate on short contexts (it checks this script's own logic), then it says there is no CUDA and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import random
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


try:
    import radixcache.worker  # noqa: F401  (the installed package: `make gpu-check` installs it editable first)
except ImportError:
    sys.exit("radixcache is not installed: run `make gpu-check`, or `pip install --no-deps -e .` first")

import torch  # noqa: E402

from radixcache.pool import KVLayer, KVPool, KVShape  # noqa: E402
from radixcache.worker.attention import AttentionBackend, BatchLayout, SequenceSlice, create_backend  # noqa: E402
from radixcache.worker.attention.base import (  # noqa: E402
    AttentionOptions,
    BackendUnavailableError,
    resolve_backend_name,
)
from radixcache.worker.attention.window import first_visible  # noqa: E402

log = logging.getLogger("radixcache.gpu_check")
LAYERS = 3
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # max |err| per sequence / max |reference| of it


# --- output: every line to stdout and to files that survive a stopped run ----------------------------------------
class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.sections: dict[str, str] = {}  # section title -> "PASS" | "FAIL", in the order they ran
        self.failures = 0
        handler = logging.FileHandler(out / "gpu_check.log", mode="w")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        self._level = root.level
        root.setLevel(logging.INFO)
        self._handler = handler

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)
        (self.out / "gpu_check.txt").write_text("\n".join(self.lines) + "\n")

    def record(self, section: str, ok: bool, **fields: Any) -> None:
        self.failures += not ok
        self.records.append({"section": section, "ok": ok, **fields})
        (self.out / "gpu_check.json").write_text(json.dumps(self.records, indent=1, default=str) + "\n")

    def close(self) -> None:
        logging.getLogger().removeHandler(self._handler)
        logging.getLogger().setLevel(self._level)
        self._handler.close()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- configurations ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    label: str
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    attention: AttentionOptions = AttentionOptions()  # per layer of the LAYERS: windows, scale, soft cap
    kv_dtype: str | None = None  # the pages' precision; None: the model's dtype

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def rank(self) -> int | None:
        """Latent (MLA) pages: kv_lora_rank, the output dimensions compared (AttentionOptions.latent); else None."""
        dims = self.attention.latent_dims
        return dims[0] if self.attention.latent and dims is not None else None

    def options(self) -> dict[str, Any]:
        return {"num_heads": self.heads, "num_kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "attention": self.attention, "kv_dtype": self.kv_dtype}  # fmt: skip


GEOMETRIES = [("default model", 4, 2, 64), ("hd128 group 4", 32, 8, 128), ("hd128 group 1", 8, 8, 128)]
GEOMETRIES += [("hd128 group 8", 64, 8, 128)]
# Gemma 2 (9B's heads, 27B's scale 144 ** -0.5, its soft cap, window 4096) and Gemma 3 (1B: window 512 here 1024).
GEMMA2 = AttentionOptions(scale=144**-0.5, soft_cap=50.0, windows=(4096, None, 4096))
GEMMA3 = AttentionOptions(windows=(1024, 1024, None))


def config_matrix() -> list[Config]:
    """Every geometry x dtype x page size, most used first (the default model in bf16, then head_dim 128), the
    Gemma-shaped sliding stacks after the bf16 page-16 ones, so the time budget cuts the rarest; each new (dtype,
    head_dim) pair JIT-compiles its own kernels."""
    configs = [
        Config(label, heads, kv_heads, dim, dtype, page)
        for dtype in (torch.bfloat16, torch.float16)
        for page in (16, 1)
        for label, heads, kv_heads, dim in GEOMETRIES
    ]
    sliding = [
        Config("gemma2 sliding", 16, 8, 256, torch.bfloat16, 16, GEMMA2),
        Config("gemma3 sliding", 4, 1, 256, torch.bfloat16, 16, GEMMA3),
        Config("gemma3 sliding", 4, 1, 256, torch.float16, 1, GEMMA3),
    ]
    return configs[: len(GEOMETRIES)] + sliding + configs[len(GEOMETRIES) :]


def fp8_matrix() -> list[Config]:
    """fp8_e4m3 pages: the default model's geometry in bf16 at both page sizes, head_dim 128 (GQA 4), and fp16 q."""
    (default, *_), (hd128, *_) = GEOMETRIES[0], GEOMETRIES[1]
    geometry = {label: (heads, kv_heads, dim) for label, heads, kv_heads, dim in GEOMETRIES}
    return [
        Config(label, *geometry[label], dtype, page, kv_dtype="fp8_e4m3")
        for label, dtype, page in [
            (default, torch.bfloat16, 16),
            (hd128, torch.bfloat16, 16),
            (default, torch.bfloat16, 1),
            (default, torch.float16, 16),
        ]
    ]


FP8_SCALES = (0.5, 2.0)  # k_scale, v_scale of every layer in the fp8 checks: not 1, so a dropped scale is seen

# DeepSeek V3's attention: a latent of kv_lora_rank 512 + rope 64 (FlashInfer's MLA kernels' split), its softmax scale
# (qk_nope 128 + rope 64) ** -0.5 times yarn's mscale ** 2 (factor 40, mscale_all_dim 1). A latent pool's shape is
# one "head" of half the latent (radixcache/pool.py, latent pages), so head_dim is 288.
MLA_SCALE = 192**-0.5 * (0.1 * math.log(40) + 1.0) ** 2
MLA = AttentionOptions(scale=MLA_SCALE, latent=True, latent_dims=(512, 64))
MLA_HALF = sum(MLA.latent_dims or ()) // 2


def mla_matrix() -> list[Config]:
    """Latent pages through FlashInfer's MLA wrapper: 16 heads (what FlashInfer's own MLA tests run; a DeepSeek V3
    shard at TP 8) in bf16 at page sizes 16 and 1, fp16, fp8_e4m3 latent pages (FlashInfer's fp8 MLA path: Hopper,
    bf16 queries; the layer's one latent scale 0.5 as ckv_scale and kpe_scale), then all 128 heads of V3 at TP 1."""
    return [
        Config("deepseek mla", 16, 1, MLA_HALF, torch.bfloat16, 16, MLA),
        Config("deepseek mla", 16, 1, MLA_HALF, torch.bfloat16, 1, MLA),
        Config("deepseek mla", 16, 1, MLA_HALF, torch.float16, 16, MLA),
        Config("deepseek mla", 16, 1, MLA_HALF, torch.bfloat16, 16, MLA, kv_dtype="fp8_e4m3"),
        Config("deepseek mla", 128, 1, MLA_HALF, torch.bfloat16, 16, MLA),
    ]


# --- one configuration through a serving lifecycle -----------------------------------------------------------------
@dataclass
class SeqState:
    pages: list[int]
    length: int = 0  # tokens whose K/V is in the pages


@dataclass
class StepSpec:
    kind: str
    # (sequence name, new tokens); a sequence seen first here starts cold, unless it appears in `hits` / `preload`
    work: list[tuple[str, int]]
    hits: dict[str, tuple[str, int]] = field(default_factory=dict)  # seq -> (source seq, cached tokens from it)
    preload: dict[str, int] = field(default_factory=dict)  # seq -> tokens already cached (written directly)


def lifecycle(context: int) -> list[StepSpec]:
    """The steps one backend lives through: prefill / decode / mixed alternating, a partial hit starting mid-page,
    a chunked prefill on its own prefix, and a sequence reaching `context` tokens (its prefix already cached)."""
    everyone = ["A", "B", "C", "D"]
    long_chunk = min(1024, context // 2)
    return [
        StepSpec("prefill", [("A", 45), ("C", 20)]),
        StepSpec("mixed", [("A", 1), ("C", 1), ("B", 18)], hits={"B": ("A", 29)}),  # 29 = mid-page for page 16
        StepSpec("decode", [("A", 1), ("B", 1), ("C", 1)]),
        StepSpec("prefill", [("D", 30)]),
        StepSpec("mixed", [("D", 20), ("A", 1), ("B", 1), ("C", 1)]),  # D: a chunk on its own cached prefix
        StepSpec("decode", [(s, 1) for s in everyone]),
        StepSpec("prefill", [("E", long_chunk)], preload={"E": context - long_chunk}),
        StepSpec("mixed", [("E", 1), ("F", 7), *[(s, 1) for s in everyone]]),
        StepSpec("decode", [("E", 1), *[(s, 1) for s in everyone]]),
    ]


@dataclass
class CaseResult:
    name: str
    steps: int = 0
    worst_error: float = 0.0
    worst_where: str = ""
    first_step_s: float = 0.0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def per_sequence_errors(got: torch.Tensor, want: torch.Tensor, layout: BatchLayout) -> list[float]:
    """max |got - want| / max |want| over each sequence's rows (inf where got is not finite)."""
    errors = []
    bounds = layout.qo_indptr.tolist()
    for b in range(layout.batch_size):
        g, w = got[bounds[b] : bounds[b + 1]].float(), want[bounds[b] : bounds[b + 1]]
        if not bool(torch.isfinite(g).all()):
            errors.append(float("inf"))
            continue
        errors.append(float((g - w).abs().max() / w.abs().max().clamp_min(1e-6)))
    return errors


def nan_buffer_check(backend: AttentionBackend, q: torch.Tensor, kv_layer: KVLayer, got: torch.Tensor) -> bool:
    """Run layer 0's planned FlashInfer kernel again into a NaN-filled buffer: every element must be written, and
    equal to what forward returned. True for backends without wrappers (nothing to check)."""
    mla = getattr(backend, "_wrapper", None)  # the flashinfer_mla backend's one wrapper: q and the pages split at R
    if mla is not None:
        rank = int(getattr(backend, "rank"))  # noqa: B009 (only the MLA backend has it)
        q, tokens = q.contiguous(), kv_layer.latent_tokens()
        out = torch.full((q.shape[0], q.shape[1], rank), float("nan"), dtype=q.dtype, device=q.device)
        fp8 = {"ckv_scale": kv_layer.k_scale, "kpe_scale": kv_layer.k_scale} if getattr(backend, "fp8", False) else {}
        mla.run(q[..., :rank], q[..., rank:], tokens[..., :rank], tokens[..., rank:], out=out, **fp8)
        return bool(torch.isfinite(out).all()) and torch.equal(out, got)
    wrappers = getattr(backend, "_decode" if getattr(backend, "_use_decode", False) else "_prefill", None)
    if wrappers is None:
        return True
    wrapper = wrappers[backend.attention.window(0)]
    out = torch.full_like(q, float("nan"))
    scales = {"k_scale": kv_layer.k_scale, "v_scale": kv_layer.v_scale} if getattr(backend, "fp8", False) else {}
    wrapper.run(q.contiguous(), kv_layer.values, out=out, **scales)
    return bool(torch.isfinite(out).all()) and torch.equal(out, got)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def poison_left_pages(pools: list[KVPool], seqs: dict[str, SeqState], attention: AttentionOptions) -> None:
    """NaN into each sliding layer's pages that no sequence's window reaches any more (every holder's next query
    sees none of it): what a window-aware cache may give back, so no backend may read them."""
    ps = pools[0].page_size
    for layer in range(LAYERS):
        window = attention.window(layer)
        if window is None:
            continue
        held = {p for seq in seqs.values() for p in seq.pages}
        needed = {p for seq in seqs.values() for p in seq.pages[first_visible(seq.length, window) // ps :]}
        dead = sorted(held - needed)
        for pool in pools:
            pool.kv[layer, dead] = float("nan")


def run_case(
    config: Config,
    device: str,
    make_candidate: Callable[[Config], AttentionBackend],
    *,
    context: int = 8192,
    seed: int = 0,
) -> CaseResult:
    """One candidate backend through lifecycle(context) against the torch backend in float32 on the same data."""
    start = time.monotonic()
    result = CaseResult(config.label)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ps = config.page_size
    num_pages = 2 * (context + 512) // ps + 64
    shape = KVShape(LAYERS, config.kv_heads, config.head_dim)
    # latent pages: q is [T, H, 2 * head_dim] (R + P), k / v the new latents' halves, the first R outputs compared
    rank, latent = config.rank, config.attention.latent
    q_dim = 2 * config.head_dim if latent else config.head_dim
    if config.kv_dtype is None:
        pool = KVPool(shape, page_size=ps, num_pages=num_pages, dtype=config.dtype, device=device, latent=latent)
        pool.kv.normal_()  # stale values everywhere: only the right slots may be read
        ref_pool = KVPool(shape, page_size=ps, num_pages=num_pages, dtype=torch.float32, device=device, latent=latent)
        ref_pool.kv.copy_(pool.kv.float())
    else:  # quantized pages: the reference reads the very same pages (the torch backend dequantizes in float32)
        scales = torch.tensor([FP8_SCALES] * LAYERS)  # (latent pages keep one scale a layer: the K one, 0.5)
        pool, ref_pool = (
            KVPool(
                shape,
                page_size=ps,
                num_pages=num_pages,
                dtype=config.kv_dtype,
                device=device,
                kv_scales=scales,
                latent=latent,
            )
            for _ in range(2)
        )  # fmt: skip
        pool.kv.copy_(torch.randn(pool.kv.shape, device=device).to(pool.kv.dtype))
        ref_pool.kv.copy_(pool.kv)
    free = list(range(num_pages))
    rng.shuffle(free)  # scattered block tables
    seqs: dict[str, SeqState] = {}

    def grow(seq: SeqState, new: int) -> None:
        while len(seq.pages) * ps < seq.length + new:
            seq.pages.append(free.pop())

    candidate = make_candidate(config)
    reference = create_backend("torch", device, attention=config.attention)
    for step_no, spec in enumerate(lifecycle(context)):
        slices, names = [], []
        for name, new in spec.work:
            if name not in seqs:
                seq = seqs[name] = SeqState([])
                if name in spec.hits:  # a partial hit: share the whole pages, copy the partial one
                    source, cached = spec.hits[name]
                    src = seqs[source]
                    seq.pages = src.pages[: cached // ps]
                    if cached % ps:
                        dst = free.pop()
                        for p in (pool, ref_pool):
                            p.copy_prefix(src.pages[cached // ps], dst, cached % ps)
                        seq.pages.append(dst)
                    seq.length = cached
                if name in spec.preload:  # a long cached prefix: K/V already in the pages
                    seq.length = spec.preload[name]
                    grow(seq, 0)
            seq = seqs[name]
            grow(seq, new)
            slices.append(SequenceSlice(list(seq.pages), seq.length, new))
            names.append(name)
        layout = BatchLayout.build(slices, ps, device)
        poison_left_pages([pool, ref_pool], seqs, config.attention)
        step_start = time.monotonic()
        candidate.begin_step(layout)
        reference.begin_step(layout)
        for layer in range(LAYERS):
            q = torch.randn(layout.num_tokens, config.heads, q_dim, device=device).to(config.dtype)
            k, v = torch.randn(2, layout.num_tokens, config.kv_heads, config.head_dim, device=device).to(config.dtype)
            out = candidate.forward(layer, q, k, v, pool.kv_layer(layer), layout)
            want = reference.forward(layer, q.float(), k.float(), v.float(), ref_pool.kv_layer(layer), layout)
            got = out if rank is None else out[..., :rank]
            want = want if rank is None else want[..., :rank]
            if layer == 0 and step_no == 0:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                result.first_step_s = time.monotonic() - step_start
            where = f"step {step_no + 1} ({spec.kind}) layer {layer}"
            for name, err in zip(names, per_sequence_errors(got, want, layout), strict=True):
                if err > result.worst_error or result.worst_where == "":
                    result.worst_error, result.worst_where = err, f"{name}@{step_no + 1}"
                if not err <= TOLERANCE.get(config.dtype, 1e-4):
                    result.problems.append(f"{where}: sequence {name} rel err {err:.2e}")
            written = pool.layer(layer)
            if config.kv_dtype is None:  # full precision: against the float32 reference, NaN-poisoned pages aside
                same = torch.equal(written.float().nan_to_num(), ref_pool.layer(layer).nan_to_num())
            else:  # the same quantized pages on both sides: byte for byte
                same = same_bytes(written, ref_pool.layer(layer))
            if not same:
                result.problems.append(f"{where}: K/V not written to the same slots")
            if layer == 0 and not nan_buffer_check(candidate, q, pool.kv_layer(layer), out):
                result.problems.append(f"{where}: the kernel left elements unwritten (NaN buffer)")
        for name, new in spec.work:
            seqs[name].length += new
        result.steps += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    result.seconds = time.monotonic() - start
    return result


def check_kernels(
    report: Report,
    configs: list[Config],
    device: str,
    make_candidate: Callable[[Config], AttentionBackend],
    *,
    context: int,
    deadline: float,
    compile_note: bool = True,
) -> None:
    report.line(f"{'configuration':<16} {'dtype':<8} {'kv':<8} {'page':>4} {'heads':>7} {'hd':>4} {'steps':>5} "
                f"{'worst seq err':>13} {'(seq@step)':<11} {'1st step s':>10} {'total s':>7}  result")  # fmt: skip
    for i, config in enumerate(configs):
        if time.monotonic() > deadline:
            report.line(f"(time budget reached: {len(configs) - i} configurations not run)")
            report.record("kernels", True, skipped=[c.label for c in configs[i:]])
            return
        heads = f"{config.heads}/{config.kv_heads}"
        kv = config.kv_dtype or "="
        prefix = (
            f"{config.label:<16} {dtype_name(config.dtype):<8} {kv:<8} {config.page_size:>4} {heads:>7} "
            f"{config.head_dim:>4}"
        )
        try:
            res = run_case(config, device, make_candidate, context=context, seed=i)
        except Exception as exc:  # a kernel that fails to compile or run is a result, not the end of the run
            log.exception("configuration %s failed", config)
            report.line(f"{prefix} FAIL: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            report.record("kernels", False, config=asdict_config(config), error=f"{type(exc).__name__}: {exc}")
            continue
        verdict = "ok" if res.ok else f"FAIL ({len(res.problems)}): {res.problems[0]}"
        report.line(
            f"{prefix} {res.steps:>5} {res.worst_error:>13.2e} {res.worst_where:<11} {res.first_step_s:>10.2f} "
            f"{res.seconds:>7.1f}  {verdict}"
        )
        report.record("kernels", res.ok, config=asdict_config(config), **asdict(res))
        if i == 0 and compile_note:
            report.line(
                f"  first configuration's first step (with flashinfer it includes the JIT compile of the prefill kernels): {res.first_step_s:.1f} s"
            )


def asdict_config(config: Config) -> dict[str, Any]:
    return {**asdict(config), "dtype": dtype_name(config.dtype)}


# --- backend selection and fallbacks -------------------------------------------------------------------------------
FALLBACKS = [
    ("float32 model", "cuda", {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": torch.float32}),
    ("head_dim 96", "cuda", {"num_heads": 4, "num_kv_heads": 2, "head_dim": 96, "dtype": torch.bfloat16}),
    ("device cpu", "cpu", {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": torch.bfloat16}),
    # a latent model whose split FlashInfer's MLA kernels are not built for (DeepSeek V2-Lite's 512 / 64 would run)
    ("MLA 256/64", "cuda", {"num_heads": 16, "num_kv_heads": 1, "head_dim": 160, "dtype": torch.bfloat16,
                            "attention": AttentionOptions(scale=0.1, latent=True, latent_dims=(256, 64))}),
]  # fmt: skip


def check_fallbacks(report: Report, cuda: bool, context: int = 256) -> None:
    """auto must pick torch and run; an explicit flashinfer must refuse with its reason."""
    for label, device, options in FALLBACKS:
        auto = resolve_backend_name("auto", device, **options)
        try:
            create_backend("flashinfer", device, **options)
            refusal = None
        except BackendUnavailableError as exc:
            refusal = str(exc).split("cannot run here: ", 1)[-1].split(". Use backend", 1)[0]
        ran = "not run (no CUDA)"
        ok = auto == "torch" and refusal is not None
        if device == "cpu" or cuda:
            config = Config(
                label, options["num_heads"], options["num_kv_heads"], options["head_dim"], options["dtype"], 16,
                options.get("attention", AttentionOptions()),
            )  # fmt: skip
            res = run_case(
                config, device, lambda c, d=device: create_backend("auto", d, **c.options()), context=context
            )
            ran = f"a lifecycle on {auto}: worst seq err {res.worst_error:.1e}" + ("" if res.ok else " FAIL")
            ok &= res.ok
        report.line(f"{label:<14} auto -> {auto:<10} explicit flashinfer: {refusal or 'ACCEPTED'}; {ran}  "
                    f"{'ok' if ok else 'FAIL'}")  # fmt: skip
        report.record("fallbacks", ok, case=label, auto=auto, refusal=refusal)


# --- the engine: the default model served with flashinfer and with torch ------------------------------------------
_request_ids = itertools.count()


def greedy_tokens(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from radixcache.worker.engine.request import Request, SamplingParams

    base = next(_request_ids)
    ids = [f"r{base}-{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    finished = threading.Semaphore(0)
    errors: list[str] = []

    def sink(out: Any) -> None:
        outputs[out.request_id].extend(out.token_ids)
        if out.finished:
            if out.error:
                errors.append(f"{out.request_id}: {out.error}")
            finished.release()

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.submit(Request(rid, prompt, params), sink)
    for _ in prompts:
        if not finished.acquire(timeout=300):
            raise TimeoutError("the engine did not finish the requests in 300 s")
    if errors:
        raise RuntimeError("; ".join(errors))
    return [outputs[rid] for rid in ids]


@dataclass
class Served:
    """What one engine gave for a list of prompts (serve_prompts)."""

    tokens: list[list[int]]
    backend: str
    kv_dtype: str
    warm_s: float
    cached_tokens: int


def serve_prompts(loaded: Any, config: Any, prompts: list[list[int]], max_tokens: int) -> Served:
    """`prompts` served greedily by a fresh engine on `loaded` with `config`: the first alone, then the rest (they
    hit its cached prefix, ending mid-page), the engine shut down after."""
    from radixcache.worker.engine.engine import Engine

    engine = Engine(loaded, config)
    started = time.monotonic()
    engine.start()
    warm = time.monotonic() - started
    try:
        tokens = greedy_tokens(engine, prompts[:1], max_tokens) + greedy_tokens(engine, prompts[1:], max_tokens)
        hit = engine.stats().cached_tokens
    finally:
        engine.shutdown(drain=False)
    return Served(tokens, engine.backend.name, engine.kv_dtype, warm, hit)


def first_difference(got: list[list[int]], want: list[list[int]], name: str) -> str:
    """'' when every request's tokens agree; else where the first differing request first differs from torch's."""
    same = [a == b for a, b in zip(got, want, strict=True)]
    if all(same):
        return ""
    i = same.index(False)
    a, b = got[i], want[i]
    at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"; first difference: request {i} token {at}: {name} {a[at : at + 4]} torch {b[at : at + 4]}"


def check_engine(
    report: Report, device: str, candidate: str = "flashinfer", max_tokens: int = 32, kv_dtype: str = "auto"
) -> None:
    """The shipped default model served by `candidate` and by torch, pages at `kv_dtype`: the same greedy tokens
    for every request."""
    from radixcache.worker.engine.engine import EngineConfig
    from radixcache.worker.model.loader import load_checkpoint

    path = ROOT / "worker" / "default_model"
    system = "You are a careful assistant. Answer briefly and say when you are unsure. " * 3
    questions = ["What is a radix tree?", "Why share a prefix?", "What is a page?", "Name a color.", "Count to five."]
    tokens: dict[str, list[list[int]]] = {}
    for name in (candidate, "torch"):
        loaded = load_checkpoint(path, device=device)
        prompts = [loaded.tokenizer.encode(system + q) for q in questions]
        config = EngineConfig(page_size=16, kv_pages=1024, backend=name, kv_dtype=kv_dtype)
        served = serve_prompts(loaded, config, prompts, max_tokens)
        tokens[name] = served.tokens
        dtype = dtype_name(next(loaded.model.parameters()).dtype)
        report.line(f"engine {name:<10} backend {served.backend}, {dtype}, kv {served.kv_dtype}, warm-up "
                    f"{served.warm_s:.1f} s, {served.cached_tokens} prompt tokens from the cache")  # fmt: skip
    same = [a == b for a, b in zip(tokens[candidate], tokens["torch"], strict=True)]
    detail = first_difference(tokens[candidate], tokens["torch"], candidate)
    report.line(
        f"greedy tokens identical for {sum(same)}/{len(same)} requests{detail}  {'ok' if all(same) else 'FAIL'}"
    )
    report.record("engine", all(same), identical=sum(same), requests=len(same), detail=detail, kv_dtype=kv_dtype)


# A tiny DeepSeek-V3-shaped model with FlashInfer's MLA split: tests/model_fixtures.py's DeepSeek fixture (what
# tests/test_mla.py checks against transformers), as config.json fields, with kv_lora_rank 512 / rope 64 and 16 heads;
# 2 dense layers (routing is not what this checks), q_lora_rank 64, yarn RoPE (its mscale in the softmax scale).
MLA_MODEL = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64, hidden_size=256,
    num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=2, first_k_dense_replace=2,
    max_position_embeddings=2048,
)  # fmt: skip


def mla_model(device: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The MLA_MODEL DeepSeek V3 with seeded random weights (std 0.3: logits far from uniform, so a last-bit
    difference between backends cannot flip a greedy token), no tokenizer (prompts are token ids)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from model_fixtures import deepseek_config_json
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from radixcache.worker.model import ModelConfig, random_model

    config = ModelConfig.from_hf_config(deepseek_config_json("DeepseekV3ForCausalLM", **MLA_MODEL))
    return random_model(config, seed=0, device=device, dtype=dtype, std=0.3)


def check_mla_engine(
    report: Report,
    device: str,
    candidate: str = "flashinfer",
    max_tokens: int = 16,
    page_sizes: tuple[int, ...] = (16, 1),
) -> None:
    """A DeepSeek-V3-shaped model (MLA_MODEL: latent 512 + 64, 16 heads) served by `candidate` and by torch, bf16
    latent pages at page sizes 16 and 1: the same greedy tokens for every request. The prompts share a 29-token
    prefix (a hit ending mid-page at page 16), the first served alone. On CUDA `candidate` must really be FlashInfer's
    MLA backend (not a fallback)."""
    from radixcache.worker.engine.engine import EngineConfig

    rng = random.Random(7)
    shared = [rng.randrange(3, 320) for _ in range(29)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (11, 3, 20, 1)]
    for page_size in page_sizes:
        tokens: dict[str, list[list[int]]] = {}
        names: dict[str, str] = {}
        for name in (candidate, "torch"):
            config = EngineConfig(page_size=page_size, kv_pages=4096 // page_size, backend=name)
            served = serve_prompts(mla_model(device), config, prompts, max_tokens)
            tokens[name], names[name] = served.tokens, served.backend
            report.line(f"mla engine {name:<10} page {page_size:>2}: backend {served.backend}, kv {served.kv_dtype}, "
                        f"warm-up {served.warm_s:.1f} s, {served.cached_tokens} prompt tokens from the cache")  # fmt: skip
        same = [a == b for a, b in zip(tokens[candidate], tokens["torch"], strict=True)]
        real = candidate == "torch" or names[candidate] == "flashinfer_mla"
        detail = "" if real else f"; {candidate} ran as {names[candidate]}, not flashinfer_mla"
        detail += first_difference(tokens[candidate], tokens["torch"], candidate)
        ok = all(same) and real
        report.line(f"mla greedy tokens identical for {sum(same)}/{len(same)} requests (page {page_size}){detail}  "
                    f"{'ok' if ok else 'FAIL'}")  # fmt: skip
        report.record("mla engine", ok, page_size=page_size, identical=sum(same), requests=len(same),
                      backend=names[candidate], detail=detail)  # fmt: skip


def check_tiers(report: Report, device: str) -> None:
    """Section 6: see the module docstring."""
    import tempfile

    from radixcache.worker.engine.engine import Engine, EngineConfig
    from radixcache.worker.model.loader import load_checkpoint

    loaded = load_checkpoint(ROOT / "worker" / "default_model", device=device)
    text = "A radix tree keeps every prompt's pages; the tiers below keep what it lets go. " * 8
    prompt = loaded.tokenizer.encode(text)
    fillers = [loaded.tokenizer.encode(f"{i} " + text[::-1]) for i in range(2)]
    page_bytes = None
    with tempfile.TemporaryDirectory() as folder:
        probe = Engine(loaded, EngineConfig(page_size=16, kv_pages=4))
        page_bytes = probe.pool.read_page(0).nbytes
        config = EngineConfig(page_size=16, kv_pages=48, kv_host_bytes=4 * page_bytes, kv_disk_dir=folder)
        engine = Engine(loaded, config)
        engine.start()
        try:
            if not engine.wait_tier_ready(120):
                raise RuntimeError(f"the disk tier did not open: {engine.tiers.error}")
            first = greedy_tokens(engine, [prompt], 16)
            greedy_tokens(engine, fillers, 1)  # pushes the prompt's pages out of the 48-page pool
            again = greedy_tokens(engine, [prompt], 16)
            stats = engine.stats()
            host = engine.cache.tier.tiers.by_medium("CPU")
            pinned = [payload.kv.is_pinned() for _, payload in host.items()] if device == "cuda" else []
        finally:
            engine.shutdown(drain=False)
    pool = probe.pool
    data = pool.read_page(1)
    out_s = time_host(lambda: pool.read_page(1))
    in_s = time_host(lambda: pool.write_page(2, data))
    ok = first == again and stats.host_hit_tokens > 0 and stats.disk_hit_tokens > 0 and all(pinned)
    report.line(f"tiers on {device}: greedy tokens identical {first == again}; {stats.host_hit_tokens} prompt tokens "
                f"from host memory, {stats.disk_hit_tokens} from disk; host pages pinned {sum(pinned)}/{len(pinned)}; "
                f"page of {page_bytes} B out {out_s * 1e6:.0f} us, in {in_s * 1e6:.0f} us  {'ok' if ok else 'FAIL'}")  # fmt: skip
    report.record("tiers", ok, device=device, identical=first == again, host_hit_tokens=stats.host_hit_tokens,
                  disk_hit_tokens=stats.disk_hit_tokens, pinned=sum(pinned), page_bytes=page_bytes,
                  read_page_us=out_s * 1e6, write_page_us=in_s * 1e6)  # fmt: skip


def time_host(fn: Callable[[], Any], iters: int = 50) -> float:
    """Seconds per call, wall clock (synchronised on CUDA)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def check_speculation(report: Report, device: str, candidate: str = "flashinfer", max_tokens: int = 32) -> None:
    """Speculative decoding on `candidate`: verification chunks (1 + k tokens over a cached prefix) in the same
    batch as plain decodes; the default model's greedy tokens with --speculate 8 equal those with it off."""
    from radixcache.worker.engine.engine import Engine, EngineConfig
    from radixcache.worker.model.loader import load_checkpoint

    path = ROOT / "worker" / "default_model"
    questions = ["What is a radix tree?", "Why share a prefix?", "What is a page?"]
    tokens: dict[int, list[list[int]]] = {}
    accepted = 0
    for speculate in (8, 0):
        loaded = load_checkpoint(path, device=device)
        prompts = [loaded.tokenizer.encode(q) for q in questions]
        engine = Engine(loaded, EngineConfig(page_size=16, kv_pages=1024, backend=candidate, speculate=speculate))
        engine.start()
        try:
            first = greedy_tokens(engine, prompts, max_tokens)
            # retried beside a new request: drafts from the cache, verified next to a plain decode
            again = greedy_tokens(engine, prompts + [prompts[0] + first[0][:3]], max_tokens)
            tokens[speculate] = first + again
            accepted = max(accepted, engine.stats().accepted_draft_tokens)
        finally:
            engine.shutdown(drain=False)
    same = tokens[8] == tokens[0]
    ok = same and accepted > 0
    report.line(f"{candidate}: greedy tokens with speculation {'==' if same else '!='} without; {accepted} draft "
                f"tokens accepted  {'ok' if ok else 'FAIL'}")  # fmt: skip
    report.record("speculation", ok, identical=same, accepted=accepted)


def check_rows(
    report: Report,
    device: str,
    candidate: str = "flashinfer",
    prefix: int = 40,
    positions: int = 8,
    dtype: torch.dtype | None = None,
) -> None:
    """Row-exactness on `candidate`, the default model in `dtype` (None: its own, bf16): the logits after a token
    computed as a decode of its own must be the same bits when it is one of a batch of decodes and when it is a draft
    row of a verify chunk (what keeps 16-bit greedy output the same with speculation and the cache on and off; the
    torch backend is built for it, tests/test_model_rows.py). Reports how many rows matched; ok only when all did."""
    from radixcache.worker.model.llama import attention_options
    from radixcache.worker.model.loader import load_checkpoint

    loaded = load_checkpoint(ROOT / "worker" / "default_model", device=device, dtype=dtype)
    model, mc = loaded.model, loaded.config
    dtype = next(model.parameters()).dtype
    ps, seqs, per_seq = 16, 4, -(-(prefix + 4 * positions + positions) // 16)
    options = dict(num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=dtype)
    backend = create_backend(candidate, device, attention=attention_options(mc), **options)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, mc.vocab_size, (seqs, per_seq * ps), generator=g).tolist()

    def logits_as(steps: list[list[tuple[int, int, int]]]) -> dict[tuple[int, int], torch.Tensor]:
        pool = KVPool(KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim), page_size=ps, num_pages=seqs * per_seq,
                      dtype=dtype, device=device)  # fmt: skip
        out = {}
        with torch.inference_mode():
            for step in steps:
                slices = [SequenceSlice(list(range(s * per_seq, (s + 1) * per_seq)), c, n) for s, c, n in step]
                ids = torch.tensor([t for s, c, n in step for t in tokens[s][c : c + n]], device=device)
                logits = model(ids, BatchLayout.build(slices, ps, device), pool, backend, all_logits=True).cpu()
                rows = [(s, p) for s, c, n in step for p in range(c, c + n)]
                out.update({row: logits[i] for i, row in enumerate(rows)})
        return out

    prefill = [[(s, 0, prefix + 4 * s)] for s in range(seqs)]
    alone = logits_as(prefill + [[(0, prefix + j, 1)] for j in range(positions)])
    ways = {
        "in a batch of decodes": prefill
        + [[(s, prefix + 4 * s + j, 1) for s in range(seqs)] for j in range(positions)],
        "as a verify chunk's rows": prefill + [[(1, prefix + 4, 1), (0, prefix, positions), (2, prefix + 8, 1)]],
    }
    ok = True
    for way, steps in ways.items():
        got = logits_as(steps)
        same = sum(torch.equal(got[(0, prefix + j)], alone[(0, prefix + j)]) for j in range(positions))
        ok &= same == positions
        report.line(f"{candidate}: {same}/{positions} rows {way} are the same bits as a decode alone  "
                    f"{'ok' if same == positions else 'FAIL'}")  # fmt: skip
        report.record("rows", same == positions, way=way, identical=same, rows=positions, dtype=dtype_name(dtype))


# --- timings ---------------------------------------------------------------------------------------------------------
def time_cuda(fn: Callable[[], Any], iters: int = 20) -> float:
    """Median seconds per call of fn over `iters` calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (bytes read + bytes written) of a 1 GiB tensor."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_cuda(lambda: dst.copy_(src), iters=10) / 1e9


def timing_table(report: Report, deadline: float) -> None:
    bw = copy_bandwidth()
    report.line(f"device copy bandwidth (read+write): {bw:,.0f} GB/s")
    report.line("decode attention, bf16, 32 q heads / 8 kv heads / head_dim 128; GB/s = KV bytes read / time")
    report.line(f"{'backend':<11} {'kv':<8} {'batch':>5} {'context':>7} {'page':>4} {'KV MiB':>8} {'time us':>9} "
                f"{'GB/s':>8} {'% copy':>7}")  # fmt: skip
    rows = [(1, 8192, 16, "bf16"), (32, 2048, 16, "bf16"), (128, 1024, 16, "bf16"), (32, 2048, 1, "bf16")]
    rows += [(32, 2048, 16, "fp8_e4m3"), (128, 1024, 16, "fp8_e4m3")]
    for batch, ctx, page_size, kv_dtype in rows:
        if time.monotonic() > deadline:
            report.line("(time budget reached: remaining rows skipped)")
            return
        pages_per = ctx // page_size
        seqs = [SequenceSlice(list(range(b * pages_per, (b + 1) * pages_per)), ctx - 1, 1) for b in range(batch)]
        layout = BatchLayout.build(seqs, page_size, "cuda")
        pool = KVPool(
            KVShape(1, 8, 128), page_size=page_size, num_pages=batch * pages_per, dtype=kv_dtype, device="cuda"
        )
        pool.kv.copy_(torch.randn(pool.kv.shape, device="cuda").to(pool.kv.dtype))
        q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
        k, v = torch.randn(2, batch, 8, 128, device="cuda").bfloat16()
        kv_bytes = batch * ctx * pool.bytes_per_token
        for name in ["flashinfer", "torch"] if batch * ctx <= 64 * 1024 else ["flashinfer"]:
            backend = create_backend(
                name, "cuda", num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, kv_dtype=kv_dtype
            )
            backend.begin_step(layout)
            step = (q, k, v, pool.kv_layer(0), layout)
            seconds = time_cuda(lambda backend=backend, step=step: backend.forward(0, *step))
            gbs = kv_bytes / seconds / 1e9
            report.line(f"{name:<11} {kv_dtype:<8} {batch:>5} {ctx:>7} {page_size:>4} {kv_bytes / 2**20:>8.0f} "
                        f"{seconds * 1e6:>9.1f} {gbs:>8.0f} {100 * gbs / bw:>6.0f}%")  # fmt: skip


# --- main ------------------------------------------------------------------------------------------------------------
def section(report: Report, title: str, fn: Callable[[], None]) -> None:
    """Run one section; it ends with a PASS or FAIL line (FAIL if any of its checks failed or it raised)."""
    report.line("")
    report.line(f"== {title}")
    failures = report.failures
    try:
        fn()
    except Exception as exc:
        log.exception("%s failed", title)
        report.line(f"FAIL: {type(exc).__name__}: {exc}")
        report.line("".join(traceback.format_exception_only(type(exc), exc)).strip())
        report.record(title, False, error=f"{type(exc).__name__}: {exc}")
    verdict = "PASS" if report.failures == failures else "FAIL"
    report.sections[title] = verdict
    report.line(f"{verdict}: {title}")


def summary(report: Report, seconds: float) -> str:
    """The run in one JSON line a person can paste: each section's PASS/FAIL, the failed checks, the time."""
    return json.dumps({"sections": report.sections, "failed_checks": report.failures, "seconds": round(seconds)})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"), help="output folder")
    p.add_argument("--budget", type=float, default=360.0, help="seconds after which no new kernel case starts")
    p.add_argument("--context", type=int, help="the long sequence's context in the lifecycle (8192; CPU dry run 256)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget
    report = Report(args.out)
    try:
        cuda = torch.cuda.is_available()
        report.line(f"radixcache gpu-check: torch {torch.__version__}, output in {args.out.resolve()}")
        if cuda:
            cap = torch.cuda.get_device_capability()
            report.line(f"device: {torch.cuda.get_device_name()} (sm {cap[0]}{cap[1]}, CUDA {torch.version.cuda}); "
                        f"nvcc: {shutil.which('nvcc') or 'not on PATH'}")  # fmt: skip
        section(
            report,
            "backend selection and fallbacks",
            lambda: check_fallbacks(report, cuda, min(args.context or 256, 256)),
        )
        if not cuda:
            report.line("")
            report.line("== dry run on the CPU: the kernel checks' own logic, torch backend as the candidate")
            dry = [c for c in config_matrix() if c.head_dim == 64 or c.group == 4][::3]  # both dtypes, pages, dims
            dry += fp8_matrix()[:1]
            section(
                report,
                "kernels, dry run (torch as the candidate)",
                lambda: check_kernels(
                    report,
                    dry,
                    "cpu",
                    lambda c: create_backend("torch", "cpu", attention=c.attention),
                    context=args.context or 256,
                    deadline=deadline,
                ),
            )
            section(
                report,
                "MLA: kernels, dry run (torch as the candidate)",
                lambda: check_kernels(
                    report,
                    mla_matrix()[:2],  # both page sizes
                    "cpu",
                    lambda c: create_backend("torch", "cpu", attention=c.attention),
                    context=args.context or 256,
                    deadline=deadline,
                    compile_note=False,
                ),
            )
            section(report, "tiers below the pool (CPU)", lambda: check_tiers(report, "cpu"))
            report.line("")
            report.line("no CUDA device: flashinfer checks, the engine check and timings skipped")
            return 1 if report.failures else 0
        try:
            import flashinfer
        except Exception as exc:  # ImportError, or a broken install raising anything at import
            report.line(
                f"flashinfer does not import ({type(exc).__name__}: {exc}); install flashinfer-python and rerun"
            )
            return 1
        report.line(f"flashinfer {getattr(flashinfer, '__version__', '?')} from {Path(flashinfer.__file__).parent}; "
                    "the first kernels JIT-compile, this can take minutes")  # fmt: skip
        configs = config_matrix()
        flashinfer_backend = lambda c: create_backend("flashinfer", "cuda", **c.options())  # noqa: E731
        section(report, "kernels vs torch (float32) per sequence",
                lambda: check_kernels(report, configs[:1], "cuda", flashinfer_backend, context=args.context or 8192,
                                      deadline=deadline))  # fmt: skip
        section(report, "engine: default model, flashinfer vs torch, greedy", lambda: check_engine(report, "cuda"))
        section(report, "engine: speculation on vs off, flashinfer, greedy", lambda: check_speculation(report, "cuda"))
        section(
            report, "rows: a token as a decode alone, batched, a draft (flashinfer)", lambda: check_rows(report, "cuda")
        )
        # MLA before the rest of the matrix: FlashInfer's MLA wrapper has run on no GPU here yet (BENCHMARKS.md)
        section(report, "MLA: flashinfer_mla kernels vs torch (float32) on latent pages",
                lambda: check_kernels(report, mla_matrix(), "cuda", flashinfer_backend, context=args.context or 8192,
                                      deadline=deadline, compile_note=False))  # fmt: skip
        # page size 16 only here (page 1 is in the kernel cases above), for the time budget
        section(report, "MLA engine: DeepSeek-V3-shaped 512/64, flashinfer vs torch, greedy",
                lambda: check_mla_engine(report, "cuda", page_sizes=(16,)))  # fmt: skip
        section(report, "kernels vs torch (float32), the rest of the matrix",
                lambda: check_kernels(report, configs[1:], "cuda", flashinfer_backend, context=args.context or 8192,
                                      deadline=deadline, compile_note=False))  # fmt: skip
        section(report, "fp8_e4m3 KV pages: flashinfer vs torch over the same pages",
                lambda: check_kernels(report, fp8_matrix(), "cuda", flashinfer_backend, context=args.context or 8192,
                                      deadline=deadline + 60, compile_note=False))  # fmt: skip
        section(report, "engine: default model with fp8_e4m3 pages, flashinfer vs torch, greedy",
                lambda: check_engine(report, "cuda", kv_dtype="fp8_e4m3"))  # fmt: skip
        section(report, "decode timings", lambda: timing_table(report, deadline + 90))
        section(report, "tiers below the pool (CUDA: pinned host memory, disk)", lambda: check_tiers(report, "cuda"))
        return 1 if report.failures else 0
    finally:
        report.line("")
        report.line(f"{report.failures} failed checks; total {time.monotonic() - started:.0f} s")
        report.line(summary(report, time.monotonic() - started))
        report.close()


if __name__ == "__main__":
    sys.exit(main())
