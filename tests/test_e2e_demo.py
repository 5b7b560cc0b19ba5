"""`make run`'s demo as a process: a worker starts, a two-turn chat streams, turn 2 hits turn 1, the worker exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


def test_demo_two_turn_chat():
    r = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("assistant> ") == 2
    assert "reused everything the first turn computed" in r.stdout
    assert "worker stopped (SIGTERM), exit code 0" in r.stdout
