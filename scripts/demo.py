"""`make run`: start a worker on a free loopback port, stream a two-turn chat through the client, stop the worker.

The second turn's cached_tokens shows the prefix cache at work: its prompt is the first turn's prompt + reply + the
new question, and everything the first turn computed comes from the cache. Uses the embedded default model, or a
seeded random model (gibberish replies, same caching) when the checkpoint is not there.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from radixcache.client import Chat, Client

SYSTEM = "You are a helpful assistant. Answer in one or two short sentences."
# The default model learned from Python's own documentation: ask it about Python.
QUESTIONS = ["What is a generator?", "And what does the with statement do?"]


def default_model_present() -> bool:
    spec = importlib.util.find_spec("radixcache.worker.default_model")
    return bool(spec and spec.origin and (Path(spec.origin).parent / "config.json").is_file())


def start_worker(log: object) -> tuple[subprocess.Popen[str], str]:
    model = [] if default_model_present() else ["--random-model"]
    cmd = [sys.executable, "-m", "radixcache", "serve", "--port", "0", "--kv-memory", "256MiB", *model]
    print("$ radixcache " + " ".join(cmd[3:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "listening on HOST:PORT", printed once the worker is ready (health SERVING)
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"the worker did not start (exit code {proc.wait()})")
    return proc, line.split()[-1]


def main() -> int:
    with tempfile.TemporaryFile("w+") as log:
        proc, target = start_worker(log)
        try:
            with Client(target) as client:
                t0 = time.monotonic()
                client.wait_ready(timeout=240)
                info = client.model_info()
                print(
                    f"worker {target} ready in {time.monotonic() - t0:.1f} s: {info['model_name']} "
                    f"({info['architecture']}, vocab {info['vocab_size']}, context {info['context_length']}), "
                    f"{info['kv_pages']} KV pages of {info['page_size']} tokens, {info['backend']} backend\n"
                )
                chat = Chat(client, system=SYSTEM, max_tokens=48)
                for question in QUESTIONS:
                    print(f"user> {question}\nassistant> ", end="", flush=True)
                    for chunk in chat.stream(question):
                        print(chunk.text, end="", flush=True)
                    r = chat.turns[-1]
                    print(
                        f"\n  [prompt_tokens={r.prompt_tokens} cached_tokens={r.cached_tokens} "
                        f"completion_tokens={r.completion_tokens} finish_reason={r.finish_reason}]\n"
                    )
                first, second = chat.turns
                # Turn 1 computed its prompt and every reply token but the last (sampled, never fed back); the cache
                # keeps all of it, its last partial page too, so turn 2 reads exactly that many tokens.
                computed = first.prompt_tokens + first.completion_tokens - 1
                print(
                    f"turn 2: {second.cached_tokens} of its {second.prompt_tokens} prompt tokens came from the cache; "
                    f"turn 1 computed {computed} (prompt {first.prompt_tokens} + reply {first.completion_tokens} - 1)"
                )
                ok = second.cached_tokens == computed
                print("=> the second turn reused everything the first turn computed" if ok else "=> MISS")
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            print(f"worker stopped (SIGTERM), exit code {code}")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
