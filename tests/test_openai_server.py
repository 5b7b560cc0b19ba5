"""The HTTP front's lifecycle and failure paths, in-process over the FakeEngine: 503 while loading and draining, a
drain that lets streams finish, and failures inside one request (500 / 503, or an error event mid-stream)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fake_engine import FAILS_AFTER_ONE_TOKEN, NO_CAPACITY, FakeEngine
from worker_harness import ThreadedWorker

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def url(worker: ThreadedWorker, path: str) -> str:
    return f"http://127.0.0.1:{worker.server.http_port}{path}"


def test_503_until_the_model_is_loaded():
    worker = ThreadedWorker(FakeEngine(), http_port=0).start(attach=False)
    try:
        assert httpx.get(url(worker, "/health")).status_code == 503
        r = httpx.post(url(worker, "/v1/chat/completions"), json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        worker.attach()
        assert httpx.get(url(worker, "/health")).json() == {"status": "serving"}
        assert httpx.post(url(worker, "/v1/chat/completions"), json=BODY).status_code == 200
    finally:
        worker.stop()


def test_a_drain_lets_streams_finish_and_refuses_new_requests():
    engine = FakeEngine(step_s=0.02)
    worker = ThreadedWorker(engine, http_port=0).start()
    stopped = threading.Event()
    events: list[str] = []
    try:
        with httpx.stream(
            "POST", url(worker, "/v1/chat/completions"), json=BODY | {"max_tokens": 60, "stream": True}
        ) as r:
            lines = (line for line in r.iter_lines() if line)
            events.append(next(lines))  # the stream is running
            threading.Thread(target=lambda: (worker.stop(grace=30), stopped.set()), daemon=True).start()
            while not worker.server.core.draining:
                time.sleep(0.01)
            assert httpx.get(url(worker, "/health")).status_code == 503
            assert httpx.post(url(worker, "/v1/chat/completions"), json=BODY).status_code == 503
            events += list(lines)
    finally:
        assert stopped.wait(30)
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert len(text) == 60  # every token, although the worker was asked to stop meanwhile
    with pytest.raises(httpx.ConnectError):
        httpx.get(url(worker, "/health"))


@pytest.fixture(scope="module")
def worker():
    with ThreadedWorker(FakeEngine(step_s=0.001), http_port=0) as w:
        yield w


def test_a_failure_inside_a_request_is_500_and_others_carry_on(worker):
    r = httpx.post(
        url(worker, "/v1/completions"), json={"model": "fake", "prompt": FAILS_AFTER_ONE_TOKEN, "max_tokens": 5}
    )
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    r = httpx.post(url(worker, "/v1/completions"), json={"model": "fake", "prompt": NO_CAPACITY, "max_tokens": 5})
    assert r.status_code == 503  # cannot fit beside pinned pages now: try again later
    assert (
        httpx.post(url(worker, "/v1/chat/completions"), json=BODY).json()["choices"][0]["message"]["content"] == "abcde"
    )


def test_a_failure_mid_stream_ends_it_with_an_error_event(worker):
    body = {"model": "fake", "prompt": FAILS_AFTER_ONE_TOKEN, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", url(worker, "/v1/completions"), json=body) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert json.loads(events[-2][6:])["error"]["message"].endswith("injected failure")
    assert events[-1] == "data: [DONE]"


def test_too_large_for_the_kv_pool_is_413(worker):
    body = {"model": "fake", "prompt": "x", "max_tokens": 500}  # fits the context (512), not 16 pages of 4
    engine: FakeEngine = worker.engine
    old, engine.num_pages = engine.num_pages, 16
    try:
        r = httpx.post(url(worker, "/v1/completions"), json=body)
    finally:
        engine.num_pages = old
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"


def test_a_streamed_response_closes_its_engine_stream_on_the_event_loop(worker, monkeypatch):
    # EngineStream.close must run on its loop (it touches an asyncio.Queue); a plain-function BackgroundTask would
    # run it in a worker thread, one thread hop per response.
    from radixcache.worker.engine.stream import EngineStream

    threads: list[threading.Thread] = []
    close = EngineStream.close

    def recording_close(self: EngineStream) -> None:
        threads.append(threading.current_thread())
        close(self)

    monkeypatch.setattr(EngineStream, "close", recording_close)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", url(worker, "/v1/completions"), json=body) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    deadline = time.monotonic() + 5
    while len(threads) < 2 and time.monotonic() < deadline:  # the generator's finally and the background close
        time.sleep(0.01)
    assert len(threads) >= 2 and all(t is worker.thread for t in threads)
