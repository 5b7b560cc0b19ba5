"""radixcache against llama.cpp's llama-server on the CPU, side by side: the same ~125M checkpoint, one thread each.

    .venv/bin/python bench/llamacpp_compare.py [--decode-tokens 48] [--reps 2] [--jobs 2]     (make bench-llamacpp)

1. Builds llama-server once from the llama.cpp sources vendored in the llama-cpp-python sdist (pip download, then
   cmake with GGML_NATIVE; ~10 minutes on 2 quiet cores), cached under bench/results/llamacpp/ and reused.
2. Converts the checkpoint of bench/common.py with llama.cpp's own convert_hf_to_gguf.py to GGUF F32 and F16
   (cached). The checkpoint's tokenizer is not one llama.cpp knows; requests send token ids, so the converter is
   told to write its generic BPE pre-tokenizer.
3. Parity first: top-5 log-probabilities at every position of a few prompts, llama.cpp F32 (f32 KV cache, flash
   attention off) against our fp32 model. A comparison of two different functions would mean nothing, so a mismatch stops it.
4. Decode at batch 1 (fp32 vs F32, and our --weights int8 vs F16), gsp (shared 1,024-token system prompts, 4
   clients) and multiturn, servers in ABBA order, each a single-threaded process, each workload on fresh servers;
   ours with --speculate 0 there, so these stay figures of plain decoding.
5. The agentic trace of bench/spec_bench.py (bench/traces/agentic.json; one session after another, greedy, the tool
   calls under their JSON schema on both sides): ours with --speculate 8 against llama-server with its own n-gram
   speculation when this build has it (`--spec-type ngram-mod`, else ngram-simple, else none: the JSON says which).

Reported per side: wall ms per output token at batch 1 (streamed, client-side), CPU ms per token of the server
process (user + system time over the same span: what the work costs, robust to other load on a shared machine),
output tokens per second and TTFT p90 of gsp and multiturn. The LAST line is one JSON object with the ratios
ours / theirs: decode_b1_vs_llamacpp_f32, decode_int8_vs_llamacpp_f16 (ms per token: below 1 means faster),
gsp_throughput_vs_llamacpp, multiturn_throughput_vs_llamacpp, agentic_speculative_vs_llamacpp (tokens per second:
above 1 means faster), and llamacpp_speculation (the spec type llama-server ran the agentic trace with).

--smoke: the two-layer smoke checkpoint (converted to GGUF like the other), one parity prompt, 4 decoded tokens, one
gsp question per group of 2 tokens, one agentic session. It still needs the llama-server build of step 1, so
tests/test_bench_smoke.py runs it only where that build is already cached.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    SMOKE_HELP,
    Job,
    Worker,
    bench_checkpoint,
    free_port,
    gsp_workload,
    multiturn_first_round,
    next_round,
    percentile,
    random_tokens,
    smoke_out,
    write_json,
)

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CACHE = RESULTS / "llamacpp"
SRC = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
SERVER_BIN = SRC / "build" / "bin" / "llama-server"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download of a web UI at build time
    "-DLLAMA_OPENSSL=OFF",
]
PARITY_MAX_LOGPROB_DIFF = 1e-4  # fp32 vs F32 (f32 KV cache, no flash attention): measured 6.6e-6


# --- building and converting ------------------------------------------------------------------------------------
def ensure_llama_server(jobs: int) -> Path:
    """The llama-server binary, built once from the sdist's vendored llama.cpp (cached under bench/results/)."""
    if SERVER_BIN.is_file():
        return SERVER_BIN
    CACHE.mkdir(parents=True, exist_ok=True)
    sdists = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        print(f"downloading the {LLAMA_CPP_PYTHON} sdist (for its vendored llama.cpp)", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", LLAMA_CPP_PYTHON,
             "-d", str(CACHE)],
            check=True,
        )  # fmt: skip
        sdists = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    if not SRC.is_dir():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(CACHE, filter="data")
    build = SRC / "build"
    print(f"building llama-server in {build} with {jobs} job(s): ~10 minutes on 2 quiet cores", flush=True)
    subprocess.run(["cmake", "-S", str(SRC), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True)
    return SERVER_BIN


# The checkpoint's tokenizer is a byte-level BPE tokenizer.json: the converter would first try sentencepiece (not
# installed here) and then refuse a pre-tokenizer it does not know. Requests send token ids, so it is told to write
# the BPE vocabulary with llama.cpp's generic pre-tokenizer. The weights are converted untouched.
_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", {ckpt!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
import convert_hf_to_gguf as convert
from conversion import base, llama
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
convert.main()
"""


def ensure_gguf(ckpt: Path, outtype: str) -> Path:
    """ckpt converted by llama.cpp's convert_hf_to_gguf.py to GGUF `outtype` (f32 | f16), cached beside it."""
    out = CACHE / f"{ckpt.name}-{outtype}.gguf"
    if out.is_file():
        return out
    tmp = out.with_suffix(".tmp")
    code = _CONVERT.format(src=str(SRC), ckpt=str(ckpt), outtype=outtype, out=str(tmp))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SRC)
    tmp.rename(out)
    return out


# --- llama-server -------------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class LlamaServer:
    """llama-server on 127.0.0.1 with one thread, `slots` parallel sequences, flash attention off, its KV cache in
    `kv_type` (llama.cpp's default is f16; an F32 model gets f32, as our fp32 model's pool is: with an f16 cache the
    log-probabilities differ by ~7e-4 instead of ~7e-6)."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        slots: int,
        ctx_per_slot: int = 2048,
        kv_type: str = "f16",
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.args = [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", "1", "-tb", "1", "-np", str(slots), "-c", str(slots * ctx_per_slot), "-fa", "off",
            "--no-webui", "--log-disable", "--cache-type-k", kv_type, "--cache-type-v", kv_type, *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {' '.join(self.args)}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError("llama-server did not become healthy in 300 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, json.loads(data) if data else None
        finally:
            conn.close()

    def stream(self, prompt: list[int], max_tokens: int, on_token: Callable[[], None]) -> int:
        """Greedy completion of token ids, streamed; on_token() at each token. Returns the token count."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "cache_prompt": True, "return_tokens": True}  # fmt: skip
        tokens = 0
        try:
            conn.request("POST", "/completion", body=json.dumps(body))
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"llama-server: HTTP {resp.status}: {resp.read()[:300]!r}")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                n = len(event.get("tokens") or [])
                for _ in range(n):
                    on_token()
                tokens += n
                if event.get("stop"):
                    break
        finally:
            conn.close()
        return tokens

    def complete(self, prompt: list[int], max_tokens: int, schema: dict[str, Any] | None) -> list[int]:
        """A greedy completion of token ids (under a JSON schema if given); its token ids."""
        body: dict[str, Any] = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": True,
                                "return_tokens": True}  # fmt: skip
        if schema is not None:
            body["json_schema"] = schema
        status, out = self.request("POST", "/completion", body)
        if status != 200:
            raise RuntimeError(f"llama-server: HTTP {status}: {str(out)[:300]}")
        return list(out["tokens"])


def llama_speculation(binary: Path) -> tuple[tuple[str, ...], str]:
    """llama-server's n-gram speculation flags if this build has them (its own defaults otherwise), and their name;
    ((), "none") for a build without."""
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, check=False)
    usage = text.stdout + text.stderr
    if "--spec-type" in usage:
        for kind in ("ngram-mod", "ngram-simple"):
            if kind in usage:
                return ("--spec-type", kind), kind
    return (), "none"


# --- our worker ---------------------------------------------------------------------------------------------------
def our_worker(ckpt: Path, *extra: str) -> Worker:
    return Worker(ckpt, "--kv-memory", "1GiB", *extra, name="radixcache", threads=1)


def our_complete(target: str, prompt: list[int], max_tokens: int, schema: dict[str, Any] | None) -> list[int]:
    from radixcache.client import Client

    kwargs: dict[str, Any] = {"json_schema": schema} if schema is not None else {}
    with Client(target) as client:
        return client.generate_text(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, **kwargs).token_ids


def our_stream(target: str, prompt: list[int], max_tokens: int, on_token: Callable[[], None]) -> int:
    from radixcache.client import Client

    n = 0
    with Client(target) as client:
        for chunk in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            for _ in chunk.token_ids:
                on_token()
            n += len(chunk.token_ids)
    return n


# --- parity -------------------------------------------------------------------------------------------------------
def parity(ckpt: Path, server: LlamaServer, prompts: list[list[int]]) -> dict[str, Any]:
    """Top-5 log-probabilities of the next token at every position: our fp32 model in-process against llama.cpp
    (one 1-token completion per prefix; its prompt cache makes each a one-token step)."""
    import torch

    from radixcache.pool import KVPool, KVShape
    from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
    from radixcache.worker.model.loader import load_checkpoint

    loaded = load_checkpoint(ckpt, dtype="float32")
    cfg = loaded.config
    worst, top1_mismatch, positions = 0.0, 0, 0
    for prompt in prompts:
        pages = -(-len(prompt) // 16)
        pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), page_size=16, num_pages=pages)
        layout = BatchLayout.build([SequenceSlice(list(range(pages)), 0, len(prompt))], 16)
        with torch.inference_mode():
            logits = loaded.model(torch.tensor(prompt), layout, pool, create_backend("torch"), all_logits=True)
        ours = torch.log_softmax(logits.double(), dim=-1)
        for i in range(len(prompt)):
            status, body = server.request(
                "POST",
                "/completion",
                {"prompt": prompt[: i + 1], "n_predict": 1, "n_probs": 5, "temperature": 0.0, "cache_prompt": True},
            )
            if status != 200:
                raise RuntimeError(f"llama-server parity request: HTTP {status}: {body}")
            top = body["completion_probabilities"][0]["top_logprobs"]
            their_ids = [t["id"] for t in top]
            our_ids = torch.topk(ours[i], 5).indices.tolist()
            top1_mismatch += their_ids[0] != our_ids[0]
            worst = max(worst, max(abs(t["logprob"] - float(ours[i, t["id"]])) for t in top))
            positions += 1
    return {"positions": positions, "max_abs_logprob_diff": worst, "top1_mismatches": top1_mismatch}


# --- measurements ---------------------------------------------------------------------------------------------------
def decode_b1(stream: Callable[..., int], pid: int, prompt: list[int], tokens: int) -> dict[str, float]:
    """One streamed greedy generation: wall ms per token after the first, and the server's CPU ms per token over
    the same span."""
    stamps: list[float] = []
    cpu: list[float] = []

    def on_token() -> None:
        stamps.append(time.perf_counter())
        if len(stamps) in (1, tokens):
            cpu.append(cpu_seconds(pid))

    n = stream(prompt, tokens, on_token)
    if n != tokens or len(cpu) != 2:
        raise RuntimeError(f"streamed {n} tokens, expected {tokens}")
    return {
        "ms_per_token": 1000 * (stamps[-1] - stamps[0]) / (tokens - 1),
        "cpu_ms_per_token": 1000 * (cpu[1] - cpu[0]) / (tokens - 1),
    }


def run_clients(stream: Callable[..., int], next_job: Callable[[int], Job | None], clients: int) -> dict[str, float]:
    """`clients` threads; client c sends next_job(c) (thread-safe; None: done) each time its last request ended.
    Output tokens per second over the whole run and TTFT p50/p90."""
    lock = threading.Lock()
    ttfts: list[float] = []
    total = [0]

    def client(c: int) -> None:
        while (job := next_job(c)) is not None:
            sent = time.perf_counter()
            stamps: list[float] = []
            n = stream(job.prompt, job.max_tokens, lambda s=stamps: s.append(time.perf_counter()))
            with lock:
                ttfts.append(stamps[0] - sent)
                total[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"tok_s": total[0] / wall, "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90)}


def closed_loop(stream: Callable[..., int], jobs: list[Job], clients: int) -> dict[str, float]:
    """`clients` clients taking the next job of one shared queue when their last one ended."""
    queue = list(reversed(jobs))
    lock = threading.Lock()

    def next_job(_: int) -> Job | None:
        with lock:
            return queue.pop() if queue else None

    return run_clients(stream, next_job, clients)


def multiturn(stream: Callable[..., int], first: list[Job], rounds: int, user: int) -> dict[str, float]:
    """Each client sends its rounds in order, clients concurrently; round r+1's prompt = round r's prompt + an answer
    + new user tokens. The answer in the next prompt is a seeded stand-in of the same length (not the streamed
    one), so both servers see identical prompts and reuse the same prefixes."""
    chains = []
    for job in first:
        rng = random.Random(1000 + job.client)
        chain = [job]
        for _ in range(rounds - 1):
            chain.append(next_round(chain[-1], random_tokens(rng, job.max_tokens), user, rng))
        chains.append(list(reversed(chain)))
    return run_clients(stream, lambda c: chains[c].pop() if chains[c] else None, len(chains))


def agentic(complete: Callable[..., list[int]], ckpt: Path, sessions: int) -> dict[str, float]:
    """The agentic trace's sessions one after another (batch 1): generated tokens per second over the whole run."""
    from spec_bench import TRACE, Session

    from radixcache.worker.model.tokenizer import Tokenizer

    trace = json.loads(TRACE.read_text())
    tokenizer = Tokenizer.from_dir(ckpt)
    context = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    total, start = 0, time.perf_counter()
    for task in trace["tasks"][:sessions]:
        session = Session(trace, task, tokenizer, context)
        while (item := session.next_request()) is not None:
            prompt, params, constraint = item
            schema = json.loads(constraint.text) if constraint is not None else None
            output = complete(prompt, params.max_tokens, schema)
            total += len(output)
            session.answer(output)
    return {"tok_s": total / (time.perf_counter() - start), "tokens": total}


def run_side(side: str, args: argparse.Namespace, ckpt: Path, ggufs: dict[str, Path], binary: Path, task: str) -> Any:
    """One measurement of `task` on a fresh server of `side` (ours | ours-int8 | ours-spec | llama-f32 | llama-f16 |
    llama-spec)."""
    rng = random.Random(7)
    prompt = random_tokens(rng, args.context)
    gsp = gsp_workload(groups=2, prompts=args.gsp_prompts, system=1024, question=32, output=args.gsp_output)
    mt_first = multiturn_first_round(clients=2, system=256, user=32, output=args.gsp_output)
    clients = 4
    if side == "ours-spec":
        with our_worker(ckpt, "--speculate", "8") as w:
            return agentic(lambda p, n, schema: our_complete(w.target, p, n, schema), ckpt, args.agentic_sessions)
    if side == "llama-spec":
        spec, _ = llama_speculation(binary)
        with LlamaServer(binary, ggufs["f32"], slots=1, kv_type="f32", extra=spec) as server:
            return agentic(server.complete, ckpt, args.agentic_sessions)
    if side.startswith("ours"):
        extra = ("--weights", "int8") if side == "ours-int8" else ()
        with our_worker(ckpt, "--speculate", "0", *extra) as w:
            assert w.proc is not None

            def stream(p: list[int], n: int, on_token: Callable[[], None]) -> int:
                return our_stream(w.target, p, n, on_token)

            return _task(task, stream, w.proc.pid, prompt, args, gsp, mt_first, clients)
    f16 = side == "llama-f16"
    with LlamaServer(binary, ggufs["f16" if f16 else "f32"], slots=clients, kv_type="f16" if f16 else "f32") as server:
        return _task(task, server.stream, server.pid, prompt, args, gsp, mt_first, clients)


def _task(task: str, stream, pid, prompt, args, gsp, mt_first, clients) -> Any:  # noqa: ANN001
    if task == "decode":
        stream(prompt[:16], 4, lambda: None)  # warm the server up
        return decode_b1(stream, pid, prompt, args.decode_tokens)
    if task == "gsp":
        return closed_loop(stream, gsp, clients)
    return multiturn(stream, mt_first, rounds=3, user=32)


def abba(pair: tuple[str, str], task: str, reps: int, run: Callable[[str, str], Any]) -> dict[str, list[Any]]:
    results: dict[str, list[Any]] = {pair[0]: [], pair[1]: []}
    for _ in range(reps):
        for side in (pair[0], pair[1], pair[1], pair[0]):
            r = run(side, task)
            results[side].append(r)
            print(f"  {task:<9} {side:<10} {json.dumps({k: round(v, 4) for k, v in r.items()})}", flush=True)
    return results


def median_of(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the one-time llama-server build")
    p.add_argument("--reps", type=int, default=1, help="ABBA repetitions per comparison")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed batch-1 decode")
    p.add_argument("--gsp-prompts", type=int, default=4, help="questions per system prompt (2 groups)")
    p.add_argument("--gsp-output", type=int, default=16)
    p.add_argument("--parity-prompts", type=int, default=3)
    p.add_argument("--agentic-sessions", type=int, default=3, help="sessions of the agentic trace (at most 8)")
    p.add_argument("--out", type=Path, default=RESULTS / "llamacpp_compare.json")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (needs the llama-server build)")
    args = p.parse_args(argv)
    if args.smoke:
        args.decode_tokens, args.context, args.gsp_prompts, args.gsp_output = 4, 16, 1, 2
        args.parity_prompts, args.agentic_sessions = 1, 1
    args.out = smoke_out(args.out, args.smoke)

    binary = ensure_llama_server(args.jobs)
    ckpt = bench_checkpoint(args.smoke)
    ggufs = {t: ensure_gguf(ckpt, t) for t in ("f32", "f16")}
    rng = random.Random(3)
    prompts = [random_tokens(rng, 24) for _ in range(args.parity_prompts)]
    with LlamaServer(binary, ggufs["f32"], slots=1, kv_type="f32") as server:
        par = parity(ckpt, server, prompts)
    print(f"parity (fp32 vs llama.cpp F32, f32 KV cache, -fa off): {par}", flush=True)
    if par["max_abs_logprob_diff"] > PARITY_MAX_LOGPROB_DIFF or par["top1_mismatches"]:
        raise SystemExit("llama.cpp and radixcache compute different functions here; no timing would mean anything")

    def run(side: str, task: str) -> Any:
        return run_side(side, args, ckpt, ggufs, binary, task)

    dec32 = abba(("ours", "llama-f32"), "decode", args.reps, run)
    dec8 = abba(("ours-int8", "llama-f16"), "decode", args.reps, run)
    gsp = abba(("ours", "llama-f32"), "gsp", args.reps, run)
    mt = abba(("ours", "llama-f32"), "multiturn", args.reps, run)
    agent = abba(("ours-spec", "llama-spec"), "agentic", args.reps, run)

    # (summary key, table label, runs of the comparison, our side, their side, measure)
    spec = [
        ("decode_b1_vs_llamacpp_f32", "decode b1 ms/token", dec32, "ours", "llama-f32", "ms_per_token"),
        ("decode_b1_cpu_vs_llamacpp_f32", "decode b1 CPU ms/token", dec32, "ours", "llama-f32", "cpu_ms_per_token"),
        ("decode_int8_vs_llamacpp_f16", "decode b1 ms/token", dec8, "ours-int8", "llama-f16", "ms_per_token"),
        ("decode_int8_cpu_vs_llamacpp_f16", "decode b1 CPU ms/token", dec8, "ours-int8", "llama-f16",
         "cpu_ms_per_token"),
        ("gsp_throughput_vs_llamacpp", "gsp output tok/s", gsp, "ours", "llama-f32", "tok_s"),
        ("gsp_ttft_p90_vs_llamacpp", "gsp TTFT p90 s", gsp, "ours", "llama-f32", "ttft_p90_s"),
        ("multiturn_throughput_vs_llamacpp", "multiturn output tok/s", mt, "ours", "llama-f32", "tok_s"),
        ("multiturn_ttft_p90_vs_llamacpp", "multiturn TTFT p90 s", mt, "ours", "llama-f32", "ttft_p90_s"),
        ("agentic_speculative_vs_llamacpp", "agentic output tok/s", agent, "ours-spec", "llama-spec", "tok_s"),
    ]  # fmt: skip
    summary: dict[str, Any] = {
        "parity_max_abs_logprob_diff": par["max_abs_logprob_diff"],
        "llamacpp_speculation": llama_speculation(binary)[1],
    }
    print(f"\n{'':<24}{'radixcache':>22}{'llama.cpp':>22}{'ours/theirs':>13}")
    for key, label, runs, ours_side, their_side, measure in spec:
        ours, theirs = median_of(runs[ours_side], measure), median_of(runs[their_side], measure)
        summary[key] = ours / theirs
        print(f"{label:<24}{ours_side:>12}{ours:10.3f}{their_side:>14}{theirs:8.3f}{ours / theirs:13.3f}")
    summary = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in summary.items()}  # 6.6e-06 stays
    write_json(args.out, {"parity": par, "decode_f32": dec32, "decode_int8": dec8, "gsp": gsp, "multiturn": mt,
                          "agentic": agent, "summary": summary,
                          "args": vars(args) | {"out": str(args.out)}})  # fmt: skip
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
