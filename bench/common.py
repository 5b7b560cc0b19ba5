"""Shared helpers of the serving benchmarks: the ~125M random-weight Llama checkpoint, worker subprocesses on
loopback, workload generators, the theoretical maximum hit rate, and small statistics.

Requests send token ids, so the checkpoint's tokenizer only has to load: its vocabulary may be smaller than the
model's (32,000) as long as every id a workload sends is below the model's vocabulary size.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PLOTS = REPO / "bench" / "plots"
DEFAULT_CKPT = RESULTS / "ckpt-125m"
# --smoke (every bench script has it; tests/test_bench_smoke.py runs them): the same code paths and the same last-line
# JSON keys in seconds, at sizes whose figures mean nothing. Its files go here, never over a real run's results/plots.
SMOKE_RESULTS = RESULTS / "smoke"
SMOKE_CKPT = RESULTS / "ckpt-smoke"
SMOKE_HELP = "seconds: tiny sizes and few iterations, the same JSON keys; checks the script, the figures mean nothing"

# ~125M Llama: 12 layers, hidden 768, 12 heads, 4 KV heads, vocab 32000, intermediate 2048, fp32.
LLAMA_125M = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VOCAB = LLAMA_125M["vocab_size"]
# --smoke's Llama: the 125M one's vocabulary (so every workload's token ids fit), two narrow layers.
LLAMA_SMOKE = LLAMA_125M | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# Workload token ids stay clear of the special ids at the bottom of the vocabulary.
MIN_TOKEN_ID = 16


# --- the checkpoint -----------------------------------------------------------------------------------------
def _write_tokenizer(out: Path) -> None:
    """tokenizer.json: the embedded default model's if present, else a tiny byte-level BPE trained here."""
    default = REPO / "worker" / "default_model"
    if (default / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (default / name).is_file():
                (out / name).write_bytes((default / name).read_bytes())
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [(REPO / "bench" / "common.py").read_text(encoding="utf-8")] * 4
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def ensure_checkpoint(path: Path = DEFAULT_CKPT, seed: int = 0, config: dict | None = None) -> Path:
    """Build (once) the random-weight Llama of `config` (default: the ~125M one) in Hugging Face format: config.json,
    model.safetensors (fp32), tokenizer.json. Reused when already there; returns the folder. Written beside it and
    renamed into place, so a process that finds the folder finds it whole."""
    path = Path(path)
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    import shutil
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the folder is a plain, shared one
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**(config or LLAMA_125M))).to(torch.float32).eval()
        model.save_pretrained(str(staging), safe_serialization=True)
        _write_tokenizer(staging)
        try:
            staging.rename(path)
        except OSError:  # another process won the race (or a partial folder is in the way): keep a whole one
            if not (path / "model.safetensors").is_file():
                shutil.rmtree(path, ignore_errors=True)
                staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def bench_checkpoint(smoke: bool = False) -> Path:
    """The serving benchmarks' checkpoint: the ~125M Llama, or --smoke's two narrow layers."""
    return ensure_checkpoint(SMOKE_CKPT, config=LLAMA_SMOKE) if smoke else ensure_checkpoint()


def smoke_out(path: Path, smoke: bool) -> Path:
    """Where a bench writes its result file: `path`, or under SMOKE_RESULTS for a smoke run left at the default."""
    if smoke and Path(path).parent == RESULTS:
        return SMOKE_RESULTS / Path(path).name
    return Path(path)


def weight_bytes_read_per_decode_step(config: dict | None = None) -> int:
    """Bytes of weights one decode step reads (fp32): every matrix once; of the embedding only the rows looked up
    (negligible), but the untied lm_head in full."""
    c = config or LLAMA_125M
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return 4 * (layers * per_layer + h + c["vocab_size"] * h)


def kv_bytes_per_token(config: dict | None = None) -> int:
    c = config or LLAMA_125M
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


# --- worker subprocesses --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """A `radixcache serve` subprocess on 127.0.0.1, in its own process group; always stopped by stop()/with."""

    def __init__(self, model: Path, *extra: str, name: str = "worker", threads: int | None = None) -> None:
        self.name = name
        self.args = [
            sys.executable,
            "-m",
            "radixcache",
            "serve",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--grace-period",
            "0",
            "--log-level",
            "WARNING",
            *extra,
        ]
        self.env = dict(os.environ)
        if threads is not None:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen[str] | None = None
        self.target = ""
        self._log: list[str] = []

    def start(self, timeout: float = 180.0) -> Worker:
        self.proc = subprocess.Popen(
            self.args,
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stop() kills all of it
        )
        found = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self._log.append(line.rstrip())
                del self._log[:-200]
                if not found.is_set() and line.startswith("listening on "):
                    self.target = line.split("listening on ", 1)[1].strip()
                    found.set()

        threading.Thread(target=read, daemon=True, name=f"{self.name}-stdout").start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = "\n".join(self._log[-30:])
                self.stop()
                raise RuntimeError(f"{self.name} did not start ({' '.join(self.args)}):\n{log}")
        from radixcache.client import Client

        with Client(self.target) as c:
            c.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- workloads ------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """One request of a workload. `after`: index of the job whose answer this one extends (multiturn), else -1."""

    name: str
    prompt: list[int]
    max_tokens: int
    group: int = 0
    round: int = 0
    client: int = 0
    user_tokens: list[int] = field(default_factory=list)  # multiturn: the new user message of this round


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, VOCAB) for _ in range(n)]


def gsp_workload(groups: int, prompts: int, system: int, question: int, output: int, seed: int = 0) -> list[Job]:
    """SGLang's generated-shared-prefix: `groups` system prompts of `system` tokens, each followed by `prompts`
    different questions of `question` tokens. Order: round-robin over groups (prompt p of every group, then p+1),
    so each group's first prompt is among the first requests, as with a live service."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, system) for _ in range(groups)]
    jobs = []
    for p in range(prompts):
        for g in range(groups):
            jobs.append(Job(f"gsp-g{g}-p{p}", systems[g] + random_tokens(rng, question), output, group=g))
    return jobs


def unique_workload(n: int, prompt: int, output: int, seed: int = 1) -> list[Job]:
    rng = random.Random(seed)
    return [Job(f"uniq-{i}", random_tokens(rng, prompt), output, group=i) for i in range(n)]


def multiturn_first_round(clients: int, system: int, user: int, output: int, seed: int = 2) -> list[Job]:
    """Round 0 of each client: its own `system`-token preamble + a `user`-token message. Later rounds are made by
    `next_round` from the previous prompt and answer."""
    rng = random.Random(seed)
    return [
        Job(f"mt-c{c}-r0", random_tokens(rng, system + user), output, group=c, client=c, round=0)
        for c in range(clients)
    ]


def next_round(prev: Job, answer: Sequence[int], user: int, rng: random.Random) -> Job:
    """prompt_{r+1} = prompt_r + answer_r + new user tokens."""
    new = random_tokens(rng, user)
    r = prev.round + 1
    return Job(
        f"mt-c{prev.client}-r{r}",
        prev.prompt + list(answer) + new,
        prev.max_tokens,
        group=prev.group,
        client=prev.client,
        round=r,
        user_tokens=new,
    )


# --- the theoretical maximum of prefix reuse ------------------------------------------------------------------
def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def max_reusable(prompts: Sequence[Sequence[int]], computed: Sequence[Sequence[int]], page_size: int = 1) -> list[int]:
    """For each prompt i, the most prompt tokens any prefix cache could serve: the longest common prefix with any
    earlier request's computed tokens (computed[j] = prompt_j + answer_j[:-1]: the last sampled token is never fed
    through the model, so no cache holds its K/V), capped at len(prompt) - 1 (one token must be computed to get
    logits), rounded down to whole pages for a page-granular cache (ours is token-exact: page_size=1).
    Infinite capacity, arrival order = index order."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for j in range(i):
            best = max(best, _lcp(p, computed[j]))
        best = min(best, len(p) - 1)
        out.append(best - best % page_size)
    return out


# --- statistics ------------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
