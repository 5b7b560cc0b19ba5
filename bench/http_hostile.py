"""What the HTTP front holds against header floods and slow clients, per server configuration, measured.

    python bench/http_hostile.py [--variants default,uvicorn,h11] [--flood-mib 64] [--slow 200] [--hold-s 30] [--smoke]

For each variant it starts `radixcache serve --random-model --http-port 0` (a separate process: its RSS is read
from /proc) and runs, one after the other, while probing HTTP /health and gRPC health every 50 ms:
  flood: 8 connections each sending one endless header value (up to --flood-mib MiB each, 30 s at most), again
         and again (reconnecting) for --flood-s seconds;
  slow:  --slow connections trickling a request head, one header line every 2 s, for --hold-s seconds;
  idle:  --slow connections that send nothing, for --hold-s seconds.
Variants: default (the worker as shipped), uvicorn (the same server with the guard taken out: uvicorn's own
settings, httptools), h11 (uvicorn's h11 protocol with h11_max_incomplete_event_size=64 KiB, limit_concurrency=64,
timeout_keep_alive=5: every bound uvicorn itself offers). A watchdog kills a worker past --rss-limit-mb.
Prints one JSON object per variant and phase (the LAST line: the last variant's idle phase); bounded by the sizes
and seconds above. --smoke: the default variant, a 1 MiB flood for 0.5 s, 4 slow and 4 idle connections held 1 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # before bench/: its http_hostile

from common import SMOKE_HELP  # noqa: E402
from http_hostile import Attack, HealthProbe, header_flood, hold_connections, rss_mb  # noqa: E402

# Runs `radixcache serve` with uvicorn.Config's keyword arguments overridden (a JSON object in argv[1]).
LAUNCH = """
import json, sys
import uvicorn
overrides = json.loads(sys.argv[1])
original = uvicorn.Config.__init__
def init(self, *args, **kwargs):
    kwargs.update(overrides)
    original(self, *args, **kwargs)
uvicorn.Config.__init__ = init
from radixcache.worker.cli import main
sys.exit(main(["serve", *sys.argv[2:]]))
"""
VARIANTS: dict[str, dict] = {
    "default": {},
    "uvicorn": {"http": "httptools"},
    "h11": {
        "http": "h11",
        "h11_max_incomplete_event_size": 64 * 1024,
        "limit_concurrency": 64,
        "timeout_keep_alive": 5,
    },
}


class Worker:
    def __init__(self, overrides: dict, rss_limit_mb: float) -> None:
        args = ["--random-model", "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--kv-pages", "256"]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, json.dumps(overrides), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        lines = iter(self.proc.stdout)
        self.grpc_target = next(lines).split()[-1]
        http = next(lines).split()[-1]  # openai api on http://127.0.0.1:PORT/v1
        self.http_port = int(http.rsplit(":", 1)[1].split("/")[0])
        self.killed = False
        threading.Thread(target=self._watch, args=(rss_limit_mb,), daemon=True).start()

    def _watch(self, limit: float) -> None:
        while self.proc.poll() is None:
            try:
                if rss_mb(self.proc.pid) > limit:
                    self.killed = True
                    self.proc.kill()
            except OSError:
                return
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_phase(worker: Worker, name: str, attack: Attack) -> dict:
    probe = HealthProbe("127.0.0.1", worker.http_port, worker.grpc_target, pid=worker.proc.pid)
    before = rss_mb(worker.proc.pid)
    probe.start()
    time.sleep(0.5)
    attack.start()
    out = attack.result(timeout=600)
    probe.stop()
    alive = worker.proc.poll() is None
    after = rss_mb(worker.proc.pid) if alive else float("nan")
    summary = {"phase": name, "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1)}
    summary |= probe.summary() | {"worker_alive": alive, "killed_by_watchdog": worker.killed}
    summary["rounds"] = attack.rounds
    if hasattr(out, "sent_bytes"):
        summary["flood_mib_accepted_max"] = round(max(out.sent_bytes) / 2**20, 2)
        summary["flood_answers"] = sorted(set(out.answers))
    else:
        summary |= {"opened": out.opened, "open_at_end": out.open_at_end}
        if out.closed_after_s:
            summary["closed_after_s_median"] = round(out.closed_after_s[len(out.closed_after_s) // 2], 2)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="default,uvicorn,h11")
    p.add_argument("--flood-mib", type=float, default=64.0)
    p.add_argument("--flood-s", type=float, default=15.0, help="flood rounds repeat (reconnect) for this long")
    p.add_argument("--slow", type=int, default=200)
    p.add_argument("--hold-s", type=float, default=30.0)
    p.add_argument("--rss-limit-mb", type=float, default=3000.0)
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.variants, args.flood_mib, args.flood_s, args.slow, args.hold_s = "default", 1.0, 0.5, 4, 1.0
    for variant in args.variants.split(","):
        worker = Worker(VARIANTS[variant], args.rss_limit_mb)
        try:
            for name, make in phases(worker.http_port, args).items():
                if worker.proc.poll() is not None:
                    break
                attack = Attack(make, at_least_s=args.flood_s if name == "flood" else 0.0)
                print(json.dumps({"variant": variant} | run_phase(worker, name, attack)), flush=True)
        finally:
            worker.stop()


def phases(port: int, args: argparse.Namespace) -> dict[str, Callable[[], Coroutine[Any, Any, Any]]]:
    host = "127.0.0.1"
    return {
        "flood": lambda: header_flood(host, port, connections=8, mib_each=args.flood_mib, seconds=30),
        "slow": lambda: hold_connections(host, port, connections=args.slow, seconds=args.hold_s, trickle_every_s=2.0),
        "idle": lambda: hold_connections(host, port, connections=args.slow, seconds=args.hold_s, trickle_every_s=None),
    }


if __name__ == "__main__":
    main()
