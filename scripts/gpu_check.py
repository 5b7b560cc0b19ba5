"""`make gpu-check`: the flashinfer backend against the torch backend, then a decode-attention timing table.

Runs from a bare checkout (`PYTHONPATH=. python3 scripts/gpu_check.py`, the project not installed): it maps
worker/ to radixcache.worker itself. Installs nothing. Without CUDA it runs the CPU parts (layout building and the
torch reference on a few random layouts), says there is no CUDA and exits 0. With CUDA:

1. correctness: random layouts (prefill, decode, mixed prefill+decode with cached prefixes), page sizes 1 and 16,
   GQA ratios 1 and 4, bf16. flashinfer's output (written into a NaN-filled buffer, so an unwritten element shows)
   must be within relative error 1e-2 of the torch backend run in float32 on the same bf16 data, and both must
   write the same K/V into the pages.
2. timing: decode attention time and the KV bandwidth it achieves, next to the device's measured copy bandwidth.

The table is printed and, when $OUT is set, also written to $OUT/gpu_check.txt. Exit status 1 if a check fails.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = time.monotonic()
TIME_BUDGET_S = 7 * 60  # stop timing rows early so the whole run stays under 8 minutes
REL_TOL = 1e-2
LINES: list[str] = []


def log(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    out = os.environ.get("OUT")
    if out:  # rewrite on every line: whatever ran is kept even if the command is stopped at its limit
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gpu_check.txt").write_text("\n".join(LINES) + "\n")


def register_worker_package() -> None:
    """Make `radixcache.worker` importable from worker/ when the project is not installed."""
    sys.path.insert(0, str(ROOT))
    import radixcache

    try:
        import radixcache.worker  # noqa: F401 (installed, or already mapped)

        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(
        "radixcache.worker", ROOT / "worker" / "__init__.py", submodule_search_locations=[str(ROOT / "worker")]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["radixcache.worker"] = module
    radixcache.worker = module
    spec.loader.exec_module(module)


register_worker_package()

import torch  # noqa: E402

from radixcache.pool import KVPool, KVShape  # noqa: E402
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend  # noqa: E402


def random_batch(rng: random.Random, kinds: str, page_size: int, max_ctx: int) -> list[SequenceSlice]:
    """Scattered block tables; 'p' = a prefill chunk on a cached prefix (maybe empty), 'd' = one decode token."""
    free = list(range(4 * len(kinds) * (max_ctx // page_size + 2)))
    rng.shuffle(free)
    seqs = []
    for kind in kinds:
        if kind == "p":
            cached, new = rng.choice([0, rng.randint(1, max_ctx // 2)]), rng.randint(2, max_ctx // 2)
        else:
            cached, new = rng.randint(1, max_ctx - 1), 1
        pages = [free.pop() for _ in range(-(-(cached + new) // page_size))]
        seqs.append(SequenceSlice(pages, cached, new))
    return seqs


def make_case(seed: int, kinds: str, page_size: int, kv_heads: int, group: int, dim: int, max_ctx: int, device):  # noqa: ANN001, ANN201
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seqs = random_batch(rng, kinds, page_size, max_ctx)
    layout = BatchLayout.build(seqs, page_size, device)
    num_pages = int(layout.kv_indices.max()) + 1
    pool = KVPool(
        KVShape(1, kv_heads, dim), page_size=page_size, num_pages=num_pages, dtype=torch.bfloat16, device=device
    )
    pool.kv.normal_()
    t = layout.num_tokens
    q = torch.randn(t, kv_heads * group, dim, device=device).bfloat16()
    k = torch.randn(t, kv_heads, dim, device=device).bfloat16()
    v = torch.randn(t, kv_heads, dim, device=device).bfloat16()
    return layout, pool, q, k, v


def torch_reference(layout: BatchLayout, pool: KVPool, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """The torch backend in float32 on the same (bf16-valued) data: output [T,H,D] float32, written layer."""
    layer = pool.layer(0).float().clone()
    backend = create_backend("torch", q.device)
    backend.begin_step(layout)
    out = backend.forward(0, q.float(), k.float(), v.float(), layer, layout)
    return out, layer


def cpu_smoke() -> None:
    """The non-CUDA parts: layouts and the torch reference, checked against a dense per-sequence computation."""
    for kinds in ("p", "d", "pdd"):
        for page_size in (1, 16):
            layout, pool, q, k, v = make_case(1, kinds, page_size, 2, 4, 16, 64, "cpu")
            out, layer = torch_reference(layout, pool, q, k, v)
            rows = layer.view(-1, 2, 16)
            start = 0
            for b, total in enumerate(layout.seq_lens):
                n = layout.num_new[b]
                pages = layout.kv_indices[layout.kv_indptr[b] : layout.kv_indptr[b + 1]].long()
                slots = (pages[:, None] * 2 * page_size + torch.arange(page_size)).flatten()[:total]
                keys, values = rows[slots], rows[slots + page_size]
                qs = q[start : start + n].float().view(n, 2, 4, 16)
                scores = torch.einsum("nkgd,lkd->nkgl", qs, keys) / 4.0
                mask = torch.arange(total)[None, :] > torch.arange(total - n, total)[:, None]
                scores.masked_fill_(mask[:, None, None, :], float("-inf"))
                want = torch.einsum("nkgl,lkd->nkgd", scores.softmax(-1), values).reshape(n, 8, 16)
                err = float((out[start : start + n] - want).abs().max())
                assert err < 1e-4, f"torch reference disagrees with dense attention ({kinds}, page {page_size}): {err}"
                start += n
    log("cpu smoke: layouts + torch reference vs dense attention OK (3 batch kinds x page sizes 1, 16)")


def check_correctness() -> bool:
    ok = True
    log("")
    log(f"{'case':<28} {'page':>4} {'group':>5} {'tokens':>6} {'rel err':>9}  result")
    seed = 0
    for kinds, label in (("pp", "prefill"), ("dddddddd", "decode"), ("pdpddpdd", "mixed prefill+decode")):
        for page_size in (1, 16):
            for group in (1, 4):
                seed += 1
                layout, pool, q, k, v = make_case(seed, kinds, page_size, 2, group, 128, 700, "cuda")
                ref, ref_layer = torch_reference(layout, pool, q, k, v)
                backend = create_backend(
                    "flashinfer", "cuda", num_heads=2 * group, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16
                )
                backend.begin_step(layout)
                got = backend.forward(0, q, k, v, pool.layer(0), layout)
                # Again into a NaN-filled buffer: any element the kernel skips stays NaN.
                wrapper = backend._decode if backend._use_decode else backend._prefill
                nan_out = torch.full_like(q, float("nan"))
                try:
                    wrapper.run(q, pool.layer(0), out=nan_out)
                except TypeError:  # an older run() without out=: fall back to the returned tensor
                    nan_out = got
                torch.cuda.synchronize()
                rel = float((nan_out.float() - ref).abs().max() / ref.abs().max())
                written_same = torch.equal(pool.layer(0).float(), ref_layer)
                finite = bool(torch.isfinite(nan_out).all()) and bool(torch.isfinite(got).all())
                passed = finite and written_same and rel < REL_TOL and torch.equal(got, nan_out)
                ok &= passed
                why = "" if passed else f" (finite={finite}, kv written same={written_same})"
                log(
                    f"{label:<28} {page_size:>4} {group:>5} {layout.num_tokens:>6} {rel:>9.2e}  {'ok' if passed else 'FAIL'}{why}"
                )
    return ok


def time_cuda(fn, iters: int = 20) -> float:  # noqa: ANN001
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
    seconds = time_cuda(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / seconds / 1e9


def timing_table() -> None:
    bw = copy_bandwidth()
    log("")
    log(f"device copy bandwidth (read+write): {bw:,.0f} GB/s")
    log("decode attention, bf16, 32 q heads / 8 kv heads / head_dim 128; GB/s = KV bytes read / time")
    log(
        f"{'backend':<11} {'batch':>5} {'context':>7} {'page':>4} {'KV MiB':>8} {'time us':>9} {'GB/s':>8} {'% copy':>7}"
    )
    rows = [(1, 8192, 16), (32, 2048, 16), (128, 1024, 16), (32, 2048, 1)]
    for batch, ctx, page_size in rows:
        if time.monotonic() - START > TIME_BUDGET_S:
            log("(time budget reached: remaining rows skipped)")
            return
        pages_per = ctx // page_size
        seqs = [SequenceSlice(list(range(b * pages_per, (b + 1) * pages_per)), ctx - 1, 1) for b in range(batch)]
        layout = BatchLayout.build(seqs, page_size, "cuda")
        pool = KVPool(
            KVShape(1, 8, 128), page_size=page_size, num_pages=batch * pages_per, dtype=torch.bfloat16, device="cuda"
        )
        pool.kv.normal_()
        q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
        k = torch.randn(batch, 8, 128, device="cuda").bfloat16()
        v = torch.randn(batch, 8, 128, device="cuda").bfloat16()
        kv_bytes = batch * ctx * 8 * 128 * 2 * 2
        names = ["flashinfer", "torch"] if batch * ctx <= 64 * 1024 else ["flashinfer"]
        for name in names:
            backend = create_backend(name, "cuda", num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
            backend.begin_step(layout)
            step = (q, k, v, pool.layer(0), layout)
            seconds = time_cuda(lambda backend=backend, step=step: backend.forward(0, *step))
            gbs = kv_bytes / seconds / 1e9
            log(
                f"{name:<11} {batch:>5} {ctx:>7} {page_size:>4} {kv_bytes / 2**20:>8.0f} {seconds * 1e6:>9.1f} "
                f"{gbs:>8.0f} {100 * gbs / bw:>6.0f}%"
            )


def main() -> int:
    log(f"radixcache gpu-check: torch {torch.__version__}")
    cpu_smoke()
    if not torch.cuda.is_available():
        log("no CUDA device: flashinfer checks and timings skipped")
        return 0
    log(f"device: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        log(f"flashinfer does not import ({type(exc).__name__}: {exc}); install flashinfer-python and rerun")
        return 1
    log(f"flashinfer {getattr(flashinfer, '__version__', '?')}; first kernels JIT-compile, this can take minutes")
    ok = check_correctness()
    log(f"correctness: {'all ok' if ok else 'FAILURES above'} ({time.monotonic() - START:.0f} s so far)")
    timing_table()
    log(f"total {time.monotonic() - START:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
