"""Starts `radixcache serve` as a real process on a free loopback port, and always stops it."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from typing import IO

from radixcache.client import Client


class WorkerProcess:
    """`radixcache serve --random-model --port 0 <args>`; start() returns once health says SERVING."""

    def __init__(self, *args: str, model: tuple[str, ...] = ("--random-model",)) -> None:
        self.cmd = [sys.executable, "-m", "radixcache", "serve", "--host", "127.0.0.1", "--port", "0", *model, *args]
        self.proc: subprocess.Popen[str] | None = None
        self.target = ""
        self.lines: queue.Queue[str] = queue.Queue()  # stdout after the "listening on" line
        self._log: IO[str] = tempfile.TemporaryFile("w+")

    def start(self, timeout: float = 120.0) -> WorkerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        out = self.proc.stdout
        assert out is not None
        threading.Thread(target=lambda: [self.lines.put(line) for line in out], daemon=True).start()
        try:
            line = self.lines.get(timeout=timeout)
            assert line.startswith("listening on "), line
            self.target = line.split()[-1]
            with Client(self.target) as c:
                c.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise RuntimeError(f"the worker did not start: {self.log()[-3000:]}") from None
        return self

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
