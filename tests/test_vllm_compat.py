"""What tools written for vLLM read of a worker: vLLM's Prometheus names on /metrics (with its labels, moving as the
cache works), and vLLM's /tokenize, /detokenize and /v1/models fields, over real HTTP against in-process workers."""

from __future__ import annotations

import httpx
import pytest
from engine_fixtures import tiny_model
from fake_engine import FakeEngine
from prometheus_client.parser import text_string_to_metric_families
from worker_harness import ThreadedWorker

from radixcache.worker.engine.config import EngineConfig
from radixcache.worker.engine.engine import Engine

TOKENS = {"key-a": "tenant-a"}
AUTH = {"Authorization": "Bearer key-a"}
PROMPT = "pages of sixteen tokens are shared between requests with the same prefix, and the tree keeps them"


def url(worker: ThreadedWorker, path: str) -> str:
    return f"http://127.0.0.1:{worker.server.http_port}{path}"


def scrape(worker: ThreadedWorker) -> dict[str, list]:
    """/metrics as {sample name: [(labels, value), ...]}, parsed as Prometheus parses it."""
    text = httpx.get(f"http://127.0.0.1:{worker.server.metrics_port}/metrics", timeout=10).text
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def value(metrics: dict[str, list], name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (the vLLM ones: model_name and engine)."""
    want = {"model_name": "fake", "engine": "0", **labels}
    matches = [v for got, v in metrics.get(name, []) if want.items() <= got.items()]
    assert len(matches) == 1, f"{name}{want}: {metrics.get(name)}"
    return matches[0]


@pytest.fixture(scope="module")
def real():
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=64, max_step_tokens=64, max_running=4))
    with ThreadedWorker(engine, http_port=0, metrics_port=0, auth_tokens=TOKENS) as w:
        yield w


def complete(worker: ThreadedWorker, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url(worker, "/v1/completions"), json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_names_exist_with_their_labels_and_move_as_the_cache_works(real):
    before = scrape(real)
    first = complete(real, PROMPT)
    middle = scrape(real)
    complete(real, PROMPT)  # the same prompt again: its full pages are found cached
    after = scrape(real)

    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens >= 8
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert value(after, name) == 0  # both finished
    usage = value(after, "vllm:kv_cache_usage_perc")
    assert usage == 0  # the prompt's pages are cached but unreferenced: vLLM calls that free
    queries = [value(m, "vllm:prefix_cache_queries_total") for m in (before, middle, after)]
    hits = [value(m, "vllm:prefix_cache_hits_total") for m in (before, middle, after)]
    assert queries[1] - queries[0] == prompt_tokens and queries[2] - queries[1] == prompt_tokens
    assert hits[1] == hits[0]  # a first sight hits nothing
    assert hits[2] - hits[1] >= (prompt_tokens - 1) // 4 * 4 - 4  # the repeat hits its full pages
    assert hits[2] > hits[1]
    assert value(after, "vllm:num_preemptions_total") == 0
    assert value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total") == 2 * prompt_tokens
    assert value(after, "vllm:generation_tokens_total") - value(middle, "vllm:generation_tokens_total") == 4
    assert value(after, "vllm:request_success_total", finished_reason="length") >= 2
    for reason in ("stop", "abort"):
        value(after, "vllm:request_success_total", finished_reason=reason)  # shown, at whatever count
    latencies = ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds")
    for name in (*latencies, "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds"):
        assert value(after, f"{name}_bucket", le="+Inf") == value(after, f"{name}_count")
    for name in (*latencies, "vllm:e2e_request_latency_seconds"):
        assert value(after, f"{name}_count") - value(middle, f"{name}_count") == 1
    # 4 tokens: 3 gaps, fewer when accepted drafts share an output
    assert (
        1
        <= value(after, "vllm:inter_token_latency_seconds_count")
        - value(middle, "vllm:inter_token_latency_seconds_count")
        <= 3
    )
    e2e = value(after, "vllm:e2e_request_latency_seconds_sum") - value(middle, "vllm:e2e_request_latency_seconds_sum")
    ttft = value(after, "vllm:time_to_first_token_seconds_sum") - value(middle, "vllm:time_to_first_token_seconds_sum")
    assert e2e >= ttft > 0  # the finish comes after the first token
    # Ours stay as they were, beside vLLM's.
    assert after["radixcache_cache_hit_tokens_total"][0][1] == hits[2]
    assert after["radixcache_requests_running"][0][0] == {}


def test_kv_cache_usage_counts_pinned_pages_as_held(real):
    base = value(scrape(real), "vllm:kv_cache_usage_perc")
    core = real.server.core
    pinned, _ = real.run(core.pin("tenant-a", _prompt(PROMPT), 60.0))
    try:
        assert pinned > 0
        usage = value(scrape(real), "vllm:kv_cache_usage_perc")
        assert usage == pytest.approx(base + pinned / 4 / 64)  # tokens pinned / page size / pool pages
    finally:
        real.run(core.unpin("tenant-a", _prompt(PROMPT)))


def _prompt(text: str):
    from radixcache.worker.front.validation import PromptInput

    return PromptInput(text=text)


def test_tokenize_and_detokenize_round_trip(real):
    r = httpx.post(url(real, "/tokenize"), json={"prompt": PROMPT, "return_token_strs": True}, headers=AUTH)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["count"] == len(got["tokens"]) > 0 and got["max_model_len"] == 4096
    assert got["tokens"] == real.engine.tokenizer.encode(PROMPT)
    assert "".join(got["token_strs"]) == PROMPT
    assert "token_strs" not in httpx.post(url(real, "/tokenize"), json={"prompt": PROMPT}, headers=AUTH).json()
    back = httpx.post(url(real, "/detokenize"), json={"tokens": got["tokens"]}, headers=AUTH)
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    # The ids are those a completion with the same prompt submits.
    assert complete(real, PROMPT, 1)["usage"]["prompt_tokens"] == got["count"]


def test_models_show_the_context_length(real):
    r = httpx.get(url(real, "/v1/models"), headers=AUTH)
    card = r.json()["data"][0]
    assert card["id"] == card["root"] == "fake" and card["max_model_len"] == 4096 and card["owned_by"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/tokenize", {"prompt": "hi", "truncate": 3}, "truncate"),
        ("/tokenize", {"prompt": "hi", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),  # outside the vocabulary
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": list(range(5000))}, "tokens"),  # more ids than the context (4096) holds
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(real, path, body, param):
    r = httpx.post(url(real, path), json=body, headers=AUTH)
    status = 404 if param == "model" else 400
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"].split("[")[0] == param and error["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )


def test_tokenize_and_detokenize_need_a_token(real):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(url(real, path), json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_tokenize_chat_with_and_without_the_generation_prompt():
    with ThreadedWorker(FakeEngine(), http_port=0) as w:
        messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        tok = w.engine.tokenizer

        def ids(**extra: object) -> list[int]:
            r = httpx.post(url(w, "/tokenize"), json={"messages": messages, **extra})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        plain = [{"role": "user", "content": "hi"}]
        assert ids() == tok.encode(tok.apply_chat_template(plain), add_special_tokens=False)
        assert ids(add_generation_prompt=False) == tok.encode(
            tok.apply_chat_template(plain, add_generation_prompt=False), add_special_tokens=False
        )
        r = httpx.post(url(w, "/tokenize"), json={"prompt": "hi", "add_special_tokens": False})
        assert r.json()["tokens"] == tok.encode("hi", add_special_tokens=False)
        assert httpx.post(url(w, "/tokenize"), json={"prompt": "hi"}).json()["tokens"] == tok.encode("hi")
        r = httpx.post(url(w, "/tokenize"), json={"messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0]")
        r = httpx.post(url(w, "/tokenize"), json={"messages": messages, "add_special_tokens": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
