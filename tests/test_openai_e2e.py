"""The OpenAI-compatible HTTP API end to end: a real `radixcache serve --http-port` process (seeded random tiny model,
real engine and cache), driven through the official `openai` client (sync, async, streaming) and plain httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from worker_process import WorkerProcess

from radixcache.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKENS = "key-alice alice\nkey-bob bob\n"
MODEL = "random-seed0"
SPECIAL = ("<s>", "</s>", "<unk>")  # the --random-model character tokenizer's
SYSTEM = "You are a terse assistant. Answer in one short line, and never use more words than needed. " * 2


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens.txt"
    tokens.write_text(TOKENS)
    args = ["--kv-pages", "1024", "--http-port", "0", "--auth-tokens", str(tokens), "--max-body-mib", "1"]
    with WorkerProcess(*args) as w:
        line = w.lines.get(timeout=30)
        assert line.startswith("openai api on "), line
        w.base_url = line.split()[-1]
        yield w
        w.terminate()
        assert w.wait(30) == 0, w.log()[-3000:]


@pytest.fixture(scope="module")
def client(worker):
    with openai.OpenAI(base_url=worker.base_url, api_key="key-alice", max_retries=0) as c:
        yield c


def grpc_stats(worker, key: str = "key-alice") -> dict:
    with Client(worker.target, token=key) as c:
        return c.stats()


def wait_idle(worker, timeout: float = 20.0) -> dict:
    """Stats once nothing runs; asserts no lease or page leaked."""
    deadline = time.monotonic() + timeout
    while True:
        s = grpc_stats(worker)
        if (s["running"], s["waiting"], s["live_leases"]) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert s["live_leases"] == 0 and s["running"] == 0 and s["waiting"] == 0, s
    assert s["pages_in_use"] == 0, s
    return s


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# -- chat and completions: sync, async, streaming --------------------------------------------------------------------
def test_chat_whole_streamed_and_async_agree(worker, client):
    messages = chat("What is a radix tree?")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens == 24 or choice.finish_reason == "stop"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content  # greedy: the deltas concatenate to the whole reply
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    async def async_reply() -> str:
        async with openai.AsyncOpenAI(base_url=worker.base_url, api_key="key-alice", max_retries=0) as ac:
            r = await ac.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
            s = await ac.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True)
            return r.choices[0].message.content + "|" + "".join([c.choices[0].delta.content or "" async for c in s])

    assert asyncio.run(async_reply()) == choice.message.content + "|" + choice.message.content
    wait_idle(worker)


def test_completions_from_text_and_from_token_ids(worker, client):
    whole = client.completions.create(model=MODEL, prompt="The cache keeps", max_tokens=16)
    assert (
        whole.object == "text_completion"
        and whole.usage.completion_tokens == len(whole.choices[0].text)
        or (whole.choices[0].finish_reason == "stop")
    )
    streamed = client.completions.create(model=MODEL, prompt="The cache keeps", max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    with Client(worker.target, token="key-alice") as c:
        ids = c.tokenize("The cache keeps")
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=16)
    assert from_ids.choices[0].text == whole.choices[0].text
    assert from_ids.usage.prompt_tokens == len(ids) == whole.usage.prompt_tokens


def test_models_and_health(worker, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(worker.base_url.removesuffix("/v1") + "/health").status_code == 200  # no key needed


# -- the cache through the API ---------------------------------------------------------------------------------------
def test_second_turn_reports_what_the_first_computed_as_cached(worker, client):
    messages = chat("Name three trees.")
    turn1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, logprobs=True)
    messages += [
        {"role": "assistant", "content": turn1.choices[0].message.content},
        {"role": "user", "content": "And three more?"},
    ]
    turn2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    # Turn 1 computed its prompt and every generated token but the last (sampled, never fed back). Turn 2's prompt
    # extends turn 1's prompt + reply, so all of that is served from the cache, up to the first generated token that
    # does not come back as text (a special token such as <s>, which the reply's text leaves out).
    generated = [t.token for t in turn1.choices[0].logprobs.content]
    kept = next((i for i, t in enumerate(generated) if t in SPECIAL[::2]), len(generated))  # </s> is rendered
    computed = turn1.usage.prompt_tokens + min(kept, turn1.usage.completion_tokens - 1)
    assert turn2.usage.prompt_tokens_details.cached_tokens == computed
    # gRPC reports the same figure, from the same cache: the prompt HTTP computed is a hit through gRPC.
    with Client(worker.target, token="key-alice") as c:
        chunks = list(c.generate(messages=messages, max_tokens=1))
    assert chunks[-1].prompt_tokens == turn2.usage.prompt_tokens
    assert chunks[-1].cached_tokens == turn2.usage.prompt_tokens - 1  # all but the one token left to compute
    # Another tenant shares nothing.
    with openai.OpenAI(base_url=worker.base_url, api_key="key-bob", max_retries=0) as bob:
        other = bob.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_a_retried_chat_is_drafted_from_the_cache_and_speculate_false_opts_out(worker, client):
    """The worker speculates by default: a retried request's answer is drafted from the cache (OpenAI's Predicted
    Outputs counts: usage.completion_tokens_details), the same text; the vendor field speculate=false opts out."""
    messages = chat("Describe a radix tree in one line.")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, extra_body={"speculate": False})
    assert again.choices[0].message.content == first.choices[0].message.content == out.choices[0].message.content
    details = again.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and again.usage.completion_tokens == first.usage.completion_tokens
    none = out.usage.completion_tokens_details
    assert none.accepted_prediction_tokens == 0 and none.rejected_prediction_tokens == 0
    bad = httpx.post(
        worker.base_url + "/chat/completions",
        json={"model": MODEL, "messages": messages, "speculate": "often"},
        headers={"Authorization": "Bearer key-alice"},
    )
    assert bad.status_code == 400 and "speculate" in bad.text


def test_n_samples_share_one_prompt_computation_and_are_reproducible(worker, client):
    messages = chat("Pick a random word.")
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    wait_idle(worker)
    steps = grpc_stats(worker)["steps"]
    one = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    one_steps = grpc_stats(worker)["steps"] - steps
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "flush the tail"}], max_tokens=1)
    steps = grpc_stats(worker)["steps"]
    four = client.chat.completions.create(**kwargs, n=4, extra_body={"ignore_eos": True})
    # The prompt was computed once: the four samples took the steps one sample takes (one prefill, then decodes).
    assert grpc_stats(worker)["steps"] - steps == one_steps == 8
    texts = [c.message.content for c in four.choices]
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4
    assert texts[0] == one.choices[0].message.content  # sample i is seeded with seed + i
    assert four.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert four.usage.completion_tokens == 4 * 8
    again = client.chat.completions.create(**kwargs, n=4, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts
    streamed = client.chat.completions.create(**kwargs, n=4, stream=True, extra_body={"ignore_eos": True})
    by_index = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] += c.delta.content or ""
    assert by_index == texts
    # gRPC has n too: the same samples, told apart by GenerateResponse.index.
    with Client(worker.target, token="key-alice") as c:
        chunks = list(c.generate(messages=messages, max_tokens=8, temperature=1.0, seed=11, n=4, ignore_eos=True))
    assert ["".join(ch.text for ch in chunks if ch.index == i) for i in range(4)] == texts
    assert sum(1 for ch in chunks if ch.finish_reason) == 4
    wait_idle(worker)


# -- parameters ------------------------------------------------------------------------------------------------------
def test_stop_strings_and_logprobs(worker, client):
    prompt = "Stop me if you can:"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[5:7]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop, "never-seen"])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"

    reply = client.chat.completions.create(
        model=MODEL,
        messages=chat("Hello"),
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 6  # special tokens (e.g. <s>) have a logprob but no text in the reply
    assert "".join(t.token for t in content if t.token not in SPECIAL) == reply.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())

    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_penalties_change_the_output_as_documented(worker, client):
    base = {
        "model": MODEL,
        "messages": chat("Repeat after me: aaaa"),
        "max_tokens": 40,
        "extra_body": {"ignore_eos": True},
    }
    plain = client.chat.completions.create(**base, logprobs=True, top_logprobs=5)
    tokens = [t.token for t in plain.choices[0].logprobs.content]
    assert len(set(tokens)) < len(tokens), "greedy output of the fixture repeats itself"
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = client.chat.completions.create(**base, **penalty, logprobs=True, top_logprobs=5)
        out = [t.token for t in penalized.choices[0].logprobs.content]
        assert out != tokens
        assert len(set(out)) > len(set(tokens))  # repeating a token costs: more distinct tokens
    favoured = client.chat.completions.create(**base, presence_penalty=-2.0)
    assert len(set(favoured.choices[0].message.content)) <= len(set(tokens))


# -- bad requests, auth, limits --------------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"seed": 2**70}, "seed"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),  # false is served (issue 28); not a bool is not
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "user"}] * 2000}, "messages"),
    ({"messages": [{"role": "user", "content": "long " * 2000}]}, "messages"),
]
BAD_COMPLETIONS = [
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, 2, 100_000]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "stop_token_ids": [100_000]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHAT + [(f | {"_completions": 1}, p) for f, p in BAD_COMPLETIONS])
def test_bad_requests_get_400_naming_the_field(worker, fields, param):
    fields = dict(fields)
    if fields.pop("_completions", None):
        url, body = "/completions", {"model": MODEL, "max_tokens": 4} | fields
    else:
        url, body = "/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 4} | fields
    r = httpx.post(worker.base_url + url, json=body, headers={"Authorization": "Bearer key-alice"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_errors_in_openai_shape_and_nothing_lost(worker, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=0)
    assert bad.value.param == "max_tokens" and "max_tokens" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=1)
    assert missing.value.param == "model" and missing.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=worker.base_url, api_key="wrong", max_retries=0).models.list()
    r = httpx.get(worker.base_url + "/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(worker.base_url + "/nowhere", headers={"Authorization": "Bearer key-alice"})
    assert r.status_code == 404 and "error" in r.json()
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = httpx.post(worker.base_url + "/chat/completions", json=big, headers={"Authorization": "Bearer key-alice"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    headers = {"Authorization": "Bearer key-alice", "Content-Type": "application/json"}
    r = httpx.post(worker.base_url + "/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # Nothing stalled, nothing leaked: the worker still answers.
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).usage.completion_tokens >= 1
    wait_idle(worker)


def test_a_client_that_disconnects_frees_its_pages(worker):
    headers = {"Authorization": "Bearer key-alice"}
    # speculate false: the random model repeats itself, so drafts would finish it within the client's 1 s timeout
    long = {"model": MODEL, "messages": chat("Go on forever."), "max_tokens": 1700, "ignore_eos": True,
            "speculate": False}  # fmt: skip
    steps = grpc_stats(worker)["steps"]
    with httpx.Client(timeout=30) as h:
        with h.stream(
            "POST", worker.base_url + "/chat/completions", json=long | {"stream": True}, headers=headers
        ) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
            while grpc_stats(worker)["running"] == 0:
                next(lines)
        # closed mid-stream
    s = wait_idle(worker)
    assert s["steps"] - steps < 1700  # aborted, not run to its end
    # Not streaming: the client gives up (read timeout) and goes away; the request ends with it.
    steps = s["steps"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(worker.base_url + "/chat/completions", json=long, headers=headers, timeout=1.0)
    s = wait_idle(worker)
    assert s["steps"] - steps < 1700


def test_structured_output_with_the_random_models_character_tokenizer(worker, client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=chat("json please"),
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        max_tokens=40,
    )
    data = json.loads(reply.choices[0].message.content)
    assert set(data) == {"ok", "n"} and isinstance(data["ok"], bool) and 0 <= data["n"] <= 50
    assert reply.choices[0].finish_reason == "stop"
    with Client(worker.target, token="key-alice") as c:  # and over gRPC, from the same worker
        assert c.generate_text("x", regex="(ab|cd){3}", max_tokens=10).text in {
            x + y + z for x in ("ab", "cd") for y in ("ab", "cd") for z in ("ab", "cd")
        }
