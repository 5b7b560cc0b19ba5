"""What the OpenAI HTTP front costs next to gRPC: the same streaming workload through both fronts of ONE worker.

One `radixcache serve --http-port 0` process (the embedded default model unless --model, --no-cache so that
neither front profits from the other's prompts). The workload (random token-id prompts, greedy, ignore_eos, a fixed
number of output tokens, `--concurrency` closed-loop clients) is sent in rounds that alternate the fronts (gRPC,
HTTP, openai, then reversed, ...), so machine noise falls on all alike.

The clients run in this process, on a 2-core machine beside the worker, so a client that spends more CPU per token
slows the front it drives: the comparison must use clients about as cheap as each other. gRPC: radixcache's
AsyncClient (protobuf parsing in grpc's C core). HTTP/SSE, the headline: LeanSSEClient below, /v1/completions with
stream=True over keep-alive HTTP/1.1, one json.loads per event. A third row drives the same requests with the
official `openai` AsyncOpenAI client (what users run; its per-chunk parsing costs ~4x the lean client's CPU here);
--no-openai-client leaves it out.

Besides latency and throughput it reports CPU time per output token, of the worker process and of this process (the
clients), from /proc and getrusage: on a shared machine the fronts' own costs show there more steadily than in
wall-clock figures.

The Responses API (issue 28) gets two more measurements. A chat workload (random-word conversations, rendered by
the chat template on both paths) through gRPC Generate(messages), through POST /v1/responses and through Anthropic's
POST /v1/messages, each streamed with the lean client: `responses_ttft_p50_overhead_ms`,
`messages_ttft_p50_overhead_ms`. And an agent loop on a second worker with the cache on: `--turns`
turns of a conversation, once chained with previous_response_id (the worker continues from its stored tokens) and
once resending the whole history each turn (as clients without server-side state do), with the cached share of
each turn's input and its TTFT (official openai client, streaming).

Prints a table (TTFT p50/p90, TPOT p50, output tokens/s per front) and, as its last line, one JSON object with
`http_ttft_p50_overhead_ms` (HTTP minus gRPC) and `http_throughput_ratio` (HTTP / gRPC) with the lean client, the
same two for the openai client (`http_openai_*`), the Responses figures, and each row's figures. Not a test; its
--smoke is (tests/test_bench_smoke.py): 2 requests per round, one round per front, 16 + 4 tokens, 2 agent turns, 3
repetitions of the front cost (the same keys; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SMOKE_HELP, Worker, percentile  # noqa: E402

from radixcache.client import AsyncClient, Client  # noqa: E402


@dataclass
class Timing:
    ttft: float
    tpot: float | None
    tokens: int


async def grpc_one(client: AsyncClient, prompt: list[int] | list[dict[str, str]], max_tokens: int) -> Timing:
    """Token ids (ignore_eos: a fixed output length), or chat messages (rendered by the worker's template)."""
    t0 = time.perf_counter()
    first, n = None, 0
    chat = bool(prompt) and isinstance(prompt[0], dict)
    what = {"messages": prompt} if chat else {"token_ids": prompt, "ignore_eos": True}
    async for chunk in client.generate(max_tokens=max_tokens, **what):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        n += len(chunk.token_ids)
    end = time.perf_counter()
    first = first or end
    return Timing(first - t0, (end - first) / (n - 1) if n > 1 else None, n)


async def http_one(client, model: str, prompt: list[int], max_tokens: int) -> Timing:  # noqa: ANN001 (openai)
    t0 = time.perf_counter()
    first, n = None, 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first or end
    return Timing(first - t0, (end - first) / (n - 1) if n > 1 else None, n)


class LeanSSEClient:
    """A minimal HTTP/1.1 client for one streamed /v1/completions request at a time per connection (keep-alive,
    chunked transfer encoding, server-sent events): about the per-event work of our gRPC client (one read, one
    json.loads), so that the comparison measures the fronts and not a client's Python. Connections are pooled."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self.host, self.port, self.path = host, port, path
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _send(self, payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """Send the request on an idle connection (a fresh one if the server closed it meanwhile: uvicorn ends
        idle keep-alive connections after 5 s); returns the connection and the response head."""
        request = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        while self._idle:
            reader, writer = self._idle.pop()
            try:
                writer.write(request)
                return reader, writer, await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(request)
        return reader, writer, await reader.readuntil(b"\r\n\r\n")

    async def events(self, body: dict) -> AsyncIterator[dict]:
        """POST `body` and yield each `data:` event's JSON (not [DONE]); raises on a status other than 200."""
        reader, writer, head = await self._send(json.dumps(body).encode())
        status = head.split(b" ", 2)[1]
        if status != b"200" or b"transfer-encoding: chunked" not in head.lower():
            writer.close()
            raise RuntimeError(f"unexpected response: {head!r}")
        pending = b""
        while True:
            size = int(await reader.readline(), 16)
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                break
            pending += data[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"event: "):  # the Responses API names each event before its data
                    event = event[event.find(b"\n") + 1 :]
                if event.startswith(b"data: ") and event != b"data: [DONE]":
                    yield json.loads(event[6:])
        self._idle.append((reader, writer))

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def http_lean_one(client: LeanSSEClient, model: str, prompt: list[int], max_tokens: int) -> Timing:
    """The same request through LeanSSEClient: the front's cost without a heavy client's."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    first, n = None, 0
    async for chunk in client.events(body):
        if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
            first = time.perf_counter()
        if chunk.get("usage"):
            n = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return Timing(first - t0, (end - first) / (n - 1) if n > 1 else None, n)


WORDS = "the cache keeps keys and values of every token so each step is incremental pages share prefixes".split()


def conversation(rng: random.Random, words: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))},
    ]


async def timed_events(
    client: LeanSSEClient, body: dict, first_delta: str, tokens: Callable[[dict], int | None]
) -> Timing:
    """Stream `body` through LeanSSEClient: TTFT at the first event of type `first_delta`, the output tokens from
    the event that `tokens` reads them from (None for the others)."""
    t0 = time.perf_counter()
    first, n = None, 0
    async for event in client.events(body):
        if event["type"] == first_delta and first is None:
            first = time.perf_counter()
        n = tokens(event) or n
    end = time.perf_counter()
    first = first or end
    return Timing(first - t0, (end - first) / (n - 1) if n > 1 else None, n)


async def responses_lean_one(client: LeanSSEClient, model: str, messages: list[dict[str, str]], max_tokens: int) -> Timing:  # fmt: skip
    """POST /v1/responses, streamed, through LeanSSEClient (the instructions and input of the same conversation)."""
    body = {
        "model": model, "instructions": messages[0]["content"], "input": messages[1:], "max_output_tokens": max_tokens,
        "stream": True, "store": False,
    }  # fmt: skip

    def tokens(event: dict) -> int | None:
        done = event["type"] in ("response.completed", "response.incomplete")
        return event["response"]["usage"]["output_tokens"] if done else None

    return await timed_events(client, body, "response.output_text.delta", tokens)


async def messages_lean_one(client: LeanSSEClient, model: str, messages: list[dict[str, str]], max_tokens: int) -> Timing:  # fmt: skip
    """POST /v1/messages (Anthropic's Messages API), streamed, through LeanSSEClient: the same conversation's system
    prompt and user turn."""
    body = {
        "model": model, "system": messages[0]["content"], "messages": messages[1:], "max_tokens": max_tokens,
        "stream": True,
    }  # fmt: skip

    def tokens(event: dict) -> int | None:
        return event["usage"]["output_tokens"] if event["type"] == "message_delta" else None

    return await timed_events(client, body, "content_block_delta", tokens)


async def agent_loop(base_url: str, model: str, turns: int, output: int, chained: bool) -> list[dict[str, float]]:
    """One conversation of `turns` turns through /v1/responses: chained with previous_response_id, or resending
    the whole history. Per turn: input tokens, cached tokens, cached share, reusable tokens (what the turn before
    computed: its input and output but the last, uncomputed, token), cached of reusable, TTFT (ms)."""
    import openai

    figures, history, previous, reusable = [], [], None, 0
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        for turn in range(turns):
            question = {"role": "user", "content": f"Question {turn}: how does a radix tree share prefixes?"}
            kwargs = (
                {"previous_response_id": previous, "input": [question]} if chained else {"input": history + [question]}
            )
            t0 = time.perf_counter()
            first = None
            stream = await client.responses.create(
                model=model, instructions="You are a terse assistant.", max_output_tokens=output, stream=True,
                store=chained, **kwargs,
            )  # fmt: skip
            async for event in stream:
                if event.type == "response.output_text.delta" and first is None:
                    first = time.perf_counter()
                if event.type in ("response.completed", "response.incomplete"):
                    response = event.response
            usage = response.usage
            cached = usage.input_tokens_details.cached_tokens
            figures.append({
                "input_tokens": usage.input_tokens, "cached_tokens": cached,
                "cached_share": round(cached / usage.input_tokens, 3), "reusable_tokens": reusable,
                "cached_of_reusable": round(cached / reusable, 3) if reusable else None,
                "ttft_ms": round(1000 * ((first or time.perf_counter()) - t0), 1),
            })  # fmt: skip
            reusable = usage.input_tokens + usage.output_tokens - 1
            previous = response.id
            history += [question, {"role": "assistant", "content": response.output_text}]
    return figures


def front_cost(repeats: int = 300) -> dict[str, float]:
    """What each HTTP front itself spends, in this process and without an engine: ms from the body to the first
    streamed delta (parse, map, first events) and per streamed token (serialize), the Responses and Messages APIs
    vs chat completions, best of 3. Independent of the network and of the engine: steadier than TTFT on a busy
    machine."""
    from radixcache.worker.engine.request import FinishReason, RequestOutput
    from radixcache.worker.http.anthropic import output as anthropic_output
    from radixcache.worker.http.anthropic.protocol import MessagesRequest
    from radixcache.worker.http.anthropic.requests import parse_messages
    from radixcache.worker.http.openai.protocol import ChatCompletionRequest
    from radixcache.worker.http.openai.requests import parse_chat
    from radixcache.worker.http.openai.responses import ChatResponder
    from radixcache.worker.http.openai.responses_input import parse_responses
    from radixcache.worker.http.openai.responses_output import ResponsesResponder, sse
    from radixcache.worker.http.openai.responses_protocol import ResponsesRequest

    messages = conversation(random.Random(0), 32)
    outputs = [
        RequestOutput("r", [5], f" w{i}", 40, 0, i + 1, finish_reason=FinishReason.LENGTH if i == 31 else None)
        for i in range(32)
    ]

    def responses(tokens: int) -> None:
        body = {"model": "m", "instructions": messages[0]["content"], "input": messages[1:], "stream": True}
        parse_responses(ResponsesRequest.model_validate(body))
        r = ResponsesResponder(response_id="resp_x", model="m", echo={}, parse_tools=False, closes_at_stop=False)
        for event in r.first_events() + [e for out in outputs[:tokens] for e in r.add(out)]:
            sse(event)

    def messages_api(tokens: int) -> None:
        body = {"model": "m", "system": messages[0]["content"], "messages": messages[1:], "max_tokens": 32, "stream": True}  # fmt: skip
        parse_messages(MessagesRequest.model_validate(body))
        r = anthropic_output.MessagesResponder(
            message_id="msg_x", model="m", parse_tools=False, closes_at_stop=False, stop_sequences=(), prewarm=False,
            generated_text=str,
        )  # fmt: skip
        for event in [e for out in outputs[:tokens] for e in r.add(out)]:
            anthropic_output.sse(event)

    def chat(tokens: int) -> None:
        parse_chat(ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "stream": True}))
        r = ChatResponder(request_id="c", model="m", n=1, token_text=str, parse_tools=False, logprobs=False)
        for chunk in r.first_chunks() + [c for out in outputs[:tokens] for c in r.add(out)]:
            chunk.model_dump_json(exclude_none=True)

    def best(f, tokens: int) -> float:  # noqa: ANN001
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(repeats):
                f(tokens)
            times.append((time.perf_counter() - t0) / repeats * 1000)
        return min(times)

    out = {}
    for name, f in (("responses", responses), ("messages", messages_api), ("chat", chat)):
        first, whole = best(f, 1), best(f, 32)
        out[f"{name}_ms_to_first_delta"] = round(first, 3)
        out[f"{name}_ms_per_token"] = round((whole - first) / 31, 4)
    return out


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ = 100)


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Round:
    timings: list[Timing]
    wall: float
    worker_cpu: float  # seconds of the worker process
    client_cpu: float  # seconds of this process (the clients)


async def run_round(send, prompts: list[list[int]], concurrency: int, worker_pid: int) -> Round:  # noqa: ANN001
    """Closed loop: `concurrency` clients, each sending the next prompt when its last request ended."""
    queue = list(prompts)
    timings: list[Timing] = []
    t0, w0, c0 = time.perf_counter(), process_cpu(worker_pid), own_cpu()

    async def client() -> None:
        while queue:
            timings.append(await send(queue.pop()))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return Round(timings, time.perf_counter() - t0, process_cpu(worker_pid) - w0, own_cpu() - c0)


def summary(rounds: list[Round]) -> dict[str, float]:
    timings = [t for r in rounds for t in r.timings]
    ttft = [t.ttft * 1000 for t in timings]
    tpot = [t.tpot * 1000 for t in timings if t.tpot is not None]
    tokens = sum(t.tokens for t in timings)
    return {
        "requests": len(timings),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "tpot_p50_ms": percentile(tpot, 50),
        "tok_s": tokens / sum(r.wall for r in rounds),
        "worker_cpu_ms_per_token": 1000 * sum(r.worker_cpu for r in rounds) / tokens,
        "client_cpu_ms_per_token": 1000 * sum(r.client_cpu for r in rounds) / tokens,
    }


async def bench(grpc_target: str, base_url: str, model: str, worker_pid: int, args: argparse.Namespace) -> dict:
    import openai

    rng = random.Random(args.seed)
    url = urlsplit(base_url)
    lean_client = LeanSSEClient(url.hostname or "127.0.0.1", url.port or 80, url.path + "/completions")
    async with AsyncClient(grpc_target) as grpc_client:
        vocab = (await grpc_client.model_info())["vocab_size"]
        openai_client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        senders = {
            "grpc": lambda p: grpc_one(grpc_client, p, args.output),
            "http": lambda p: http_lean_one(lean_client, model, p, args.output),
        }
        if args.openai_client:
            senders["http_openai"] = lambda p: http_one(openai_client, model, p, args.output)
        responses_client = LeanSSEClient(url.hostname or "127.0.0.1", url.port or 80, url.path + "/responses")
        messages_client = LeanSSEClient(url.hostname or "127.0.0.1", url.port or 80, url.path + "/messages")
        chat_senders = {
            "grpc_chat": lambda m: grpc_one(grpc_client, m, args.output),
            "responses": lambda m: responses_lean_one(responses_client, model, m, args.output),
            "messages": lambda m: messages_lean_one(messages_client, model, m, args.output),
        }
        workloads = [(senders, lambda: [rng.randrange(8, vocab) for _ in range(args.prompt)])]
        workloads.append((chat_senders, lambda: conversation(rng, args.prompt // 2)))
        results: dict[str, list[Round]] = {front: [] for front in [*senders, *chat_senders]}
        for group, make in workloads:
            # A warm-up request through each front (imports, connections), not measured.
            for send in group.values():
                await send(make())
            order = list(group)
            for r in range(args.rounds):
                for front in order if r % 2 == 0 else order[::-1]:
                    prompts = [make() for _ in range(args.requests)]
                    results[front].append(await run_round(group[front], prompts, args.concurrency, worker_pid))
        await openai_client.close()
        lean_client.close()
        responses_client.close()
        messages_client.close()
    return {front: summary(rounds) for front, rounds in results.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "worker" / "default_model", help="checkpoint folder")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients per front")
    p.add_argument("--requests", type=int, default=24, help="requests per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds per front (alternating)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--output", type=int, default=32, help="output tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker (OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", type=int, default=10, help="turns of the Responses agent loop (0: leave it out)")
    p.add_argument(
        "--no-openai-client", dest="openai_client", action="store_false",
        help="leave out the row of the official openai client (its Python parsing runs in this process)",
    )  # fmt: skip
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests, args.rounds, args.prompt, args.output, args.turns = 2, 2, 1, 16, 4, 2
    return args


def openai_url(worker: Worker) -> str:
    """The worker's "openai api on URL" line."""
    deadline = time.monotonic() + 30
    while not any(line.startswith("openai api on ") for line in worker._log):
        if time.monotonic() > deadline:
            raise RuntimeError("the worker printed no 'openai api on' line")
        time.sleep(0.05)
    return next(line for line in worker._log if line.startswith("openai api on ")).split()[-1]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = args.model.resolve().name
    with Worker(args.model, "--http-port", "0", "--no-cache", name="worker", threads=args.threads) as worker:
        base_url = openai_url(worker)
        assert worker.proc is not None
        result = asyncio.run(bench(worker.target, base_url, model, worker.proc.pid, args))
    loops = {}
    if args.turns:
        with Worker(args.model, "--http-port", "0", name="cached", threads=args.threads) as cached:
            loop_url = openai_url(cached)
            for mode in ("previous_response_id", "resend_history"):
                with Client(cached.target) as admin:
                    admin.flush()  # each conversation starts cold: neither profits from the other's pages
                chained = mode == "previous_response_id"
                loops[mode] = asyncio.run(agent_loop(loop_url, model, args.turns, args.output, chained))
    g, h = result["grpc"], result["http"]
    print(
        f"{args.rounds} rounds x {args.requests} requests per front, {args.concurrency} clients, "
        f"{args.prompt} prompt + {args.output} output tokens, greedy, --no-cache, one worker"
    )
    print(
        f"{'front':<14}{'TTFT p50 ms':>12}{'TTFT p90 ms':>12}{'TPOT p50 ms':>12}{'tok/s':>8}"
        f"{'worker CPU ms/tok':>19}{'client CPU ms/tok':>19}"
    )
    names = {
        "grpc": "gRPC", "http": "HTTP/SSE", "http_openai": "HTTP (openai)", "grpc_chat": "gRPC chat",
        "responses": "Responses", "messages": "Messages",
    }  # fmt: skip
    for front, s in result.items():
        print(
            f"{names[front]:<14}{s['ttft_p50_ms']:>12.1f}{s['ttft_p90_ms']:>12.1f}{s['tpot_p50_ms']:>12.2f}"
            f"{s['tok_s']:>8.1f}{s['worker_cpu_ms_per_token']:>19.2f}{s['client_cpu_ms_per_token']:>19.2f}"
        )
    headline: dict = {
        "smoke": args.smoke,
        "http_ttft_p50_overhead_ms": round(h["ttft_p50_ms"] - g["ttft_p50_ms"], 2),
        "http_throughput_ratio": round(h["tok_s"] / g["tok_s"], 3),
        "http_worker_cpu_per_token_ratio": round(h["worker_cpu_ms_per_token"] / g["worker_cpu_ms_per_token"], 3),
    }
    if "http_openai" in result:
        o = result["http_openai"]
        headline["http_openai_ttft_p50_overhead_ms"] = round(o["ttft_p50_ms"] - g["ttft_p50_ms"], 2)
        headline["http_openai_throughput_ratio"] = round(o["tok_s"] / g["tok_s"], 3)
    cost = front_cost(3 if args.smoke else 300)
    print("front cost (ms, in process, no engine):", cost)
    headline["front_cost"] = cost
    c, r = result["grpc_chat"], result["responses"]
    headline["responses_ttft_p50_overhead_ms"] = round(r["ttft_p50_ms"] - c["ttft_p50_ms"], 2)
    headline["responses_throughput_ratio"] = round(r["tok_s"] / c["tok_s"], 3)
    m = result["messages"]
    headline["messages_ttft_p50_overhead_ms"] = round(m["ttft_p50_ms"] - c["ttft_p50_ms"], 2)
    headline["messages_throughput_ratio"] = round(m["tok_s"] / c["tok_s"], 3)
    for mode, figures in loops.items():
        print(f"agent loop, {mode} (cached share of input / TTFT per turn): " + " ".join(f"{f['cached_share']:.2f}/{f['ttft_ms']:.0f}ms" for f in figures))  # fmt: skip
        later = figures[1:]
        headline[f"loop_{mode}"] = {
            "cached_share_turns_2_on": round(sum(f["cached_tokens"] for f in later) / sum(f["input_tokens"] for f in later), 3),
            "cached_of_reusable_turns_2_on": round(sum(f["cached_tokens"] for f in later) / sum(f["reusable_tokens"] for f in later), 3),
            "ttft_ms_p50_turns_2_on": percentile([f["ttft_ms"] for f in later], 50),
            "turns": figures,
        }  # fmt: skip
    headline.update({front: {k: round(v, 2) for k, v in s.items()} for front, s in result.items()})
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    main()
