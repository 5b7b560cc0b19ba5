"""`radixcache serve`: load a model, start the engine and serve it over gRPC until SIGTERM/SIGINT.

The port is bound first (health NOT_SERVING, every RPC UNAVAILABLE) while the model loads and warms up. Once the
worker is ready it prints "listening on HOST:PORT" (one flushed line on stdout, the first one) and health says
SERVING: wait for that line. On SIGTERM it drains in-flight streams for --grace-period seconds and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

from radixcache.kv_dtypes import KV_DTYPES
from radixcache.memory import parse_size
from radixcache.object_store import parse_store_url
from radixcache.worker.engine.config import (
    DEFAULT_SPECULATE,
    DEMOTE_DTYPES,
    MAX_REMOTE_REPLICAS,
    MAX_SPECULATE,
    WINDOW_PAGING,
)

log = logging.getLogger("radixcache.serve")

# The chat template of --random-model's character tokenizer: each turn closed by </s>, so that turn N+1's prompt
# extends turn N's prompt + reply.
CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def default_model_path() -> Path:
    import radixcache.worker.default_model as default_model

    return Path(default_model.__file__).parent


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixcache serve",
        description=(
            'Run a radixcache gRPC worker. It prints "listening on HOST:PORT" on stdout once it is ready: the model '
            "is loaded and warmed up, health (grpc.health.v1) says SERVING and every RPC is served. Before that line "
            "the port may already accept connections, but RPCs answer UNAVAILABLE. Wait for the line, or poll health."
        ),
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", type=Path, help="HF checkpoint folder (default: the embedded default model)")
    m.add_argument("--random-model", action="store_true", help="a seeded random tiny Llama with a character tokenizer")
    m.add_argument("--seed", type=int, default=0, help="seed of --random-model (default 0)")
    m.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    m.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
    m.add_argument(
        "--weights",
        choices=("full", "int8"),
        default="full",
        help="int8: int8 projections, one scale per output channel (faster CPU decode, slightly lossy; greedy "
        "output may differ from full precision). full (default): the weights in --dtype",
    )
    e = p.add_argument_group("engine")
    e.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    kv = e.add_mutually_exclusive_group()
    kv.add_argument("--kv-memory", type=parse_size, help="KV pool size, e.g. 512MiB (default 512MiB)")
    kv.add_argument("--kv-pages", type=int, help="KV pool size in pages")
    # KV page precision (issue 24): one block.
    e.add_argument(
        "--kv-dtype",
        choices=("auto", *KV_DTYPES),
        default="auto",
        help="KV page precision (default auto: the model's dtype). int8 / fp8_e4m3 / int4 store 0.52x / 0.5x / "
        "0.27x the bytes of fp16 per token, scales included, so --kv-memory holds that many more pages; quantized "
        "pages cost quality (README: measured) and carry their own page hashes",
    )
    e.add_argument(
        "--kv-demote",
        choices=DEMOTE_DTYPES,
        help="opt-in: under memory pressure rewrite cold cached prefixes as int4 (or int8) pages instead of "
        "evicting them, and evict only those; a later hit brings them back. Lossy: a hit on a demoted prefix reads "
        "its demoted values, so its answer may differ from a recompute (README: measured)",
    )
    e.add_argument(
        "--kv-demote-share",
        type=parse_share,
        default=0.5,
        help="with --kv-demote: the share of the KV memory given to demoted pages (default 50%%)",
    )
    e.add_argument(
        "--kv-window-paging",
        choices=WINDOW_PAGING,
        default="auto",
        help="a model with sliding-window layers (Gemma 2/3, Mistral): keep their K/V apart and give back what fell "
        "out of every window, so a long sequence holds its last window of them only (auto: on unless "
        "--kv-demote or a tier below memory, which move whole pages, is on; README: Sliding windows)",
    )
    e.add_argument("--max-step-tokens", type=int, default=512, help="token budget of one engine step")
    e.add_argument("--max-running", type=int, default=64, help="requests in the batch at most")
    e.add_argument("--backend", choices=("auto", "torch", "flashinfer"), default="auto")
    e.add_argument("--no-cache", action="store_true", help="disable prefix caching (same kernels; a baseline)")
    e.add_argument(
        "--max-pinned",
        type=parse_share,
        default=0.5,
        help="share of the KV pool PinPrefix may hold, 0..1 or N%% (default 50%%): pins never starve running requests",
    )
    e.add_argument(
        "--eviction-policy",
        choices=("lru", "priority"),
        default="lru",
        help="what eviction takes first when KV memory runs short: lru (default), or priority: a request's "
        "retention (priority, retention_seconds) keeps its prefix after lower-priority and expired ones; it never "
        "refuses a request (pins do, within --max-pinned)",
    )
    t = p.add_argument_group("tiers below the KV pool (evicted pages are kept there, not recomputed)")
    t.add_argument(
        "--kv-disk",
        metavar="DIR",
        help="keep evicted pages in files under DIR/<model fingerprint> and load them back instead of recomputing; "
        "a restarted worker (or another one of the same model) serves them too. Off by default",
    )
    t.add_argument(
        "--kv-disk-size",
        type=parse_size,
        metavar="SIZE",
        help="bound of the --kv-disk store, e.g. 64GiB (default 16GiB); least recently used pages go first",
    )
    t.add_argument(
        "--kv-disk-write",
        choices=("through", "evict"),
        default="through",
        help="through (default): every computed page is queued for the disk at once, so a crash loses only what "
        "was still queued; evict: pages are written when evicted and at shutdown (less writing; a crash loses "
        "what memory held)",
    )
    t.add_argument(
        "--kv-host-memory",
        type=parse_size,
        metavar="SIZE",
        help="keep evicted pages in host memory first (pinned on CUDA), e.g. 8GiB; what it pushes out goes to "
        "--kv-disk when given. Off by default",
    )
    r = p.add_argument_group(
        "the fleet's shared KV store (Mooncake Store, below host memory and disk; package extra `store`)"
    )
    r.add_argument(
        "--kv-remote",
        metavar="mooncake://HOST:PORT",
        help="share computed pages with every worker of the same model through the Mooncake Store whose "
        "mooncake_master listens at HOST:PORT: each page is written once per fleet and loaded by any worker "
        "instead of recomputed. Off by default",
    )
    r.add_argument(
        "--kv-remote-metadata",
        metavar="URL",
        help="the store's metadata server (default http://HOST:8080/metadata: the master's "
        "--enable_http_metadata_server)",
    )
    r.add_argument(
        "--kv-remote-host",
        metavar="ADDR",
        help="this worker's address for the store's transfers (default: its address on the route to the master)",
    )
    r.add_argument(
        "--kv-remote-segment",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="memory this worker contributes to the store (default 0: the store services on each node hold it, so "
        "a worker that dies takes nothing of the store with it)",
    )
    r.add_argument(
        "--kv-remote-replicas",
        type=int,
        default=1,
        metavar="N",
        help="copies of each page in the store (default 1)",
    )
    r.add_argument(
        "--kv-remote-timeout",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="deadline of every call to the store (default 1); a store that misses it is left alone for a few "
        "seconds while the worker serves from its own tiers",
    )
    e.add_argument(
        "--speculate",
        type=parse_speculate,
        default=DEFAULT_SPECULATE,
        metavar="N",
        help=f"speculative decoding: up to N draft tokens per sequence per step, drafted from the cache and the "
        f"request itself, verified in the same forward pass; same outputs, fewer steps on repetitive work "
        f"(default {DEFAULT_SPECULATE}; 0: off)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 picks a free one)")
    s.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    s.add_argument("--tls-key", help="PEM private key")
    s.add_argument(
        "--auth-tokens",
        type=Path,
        help='bearer tokens: JSON {"token": "tenant"} or "token tenant" lines; "token tenant admin" marks an admin',
    )
    s.add_argument(
        "--kv-events-endpoint",
        help="publish cache events in vLLM's KV-event format on this ZMQ endpoint, e.g. bind+tcp://127.0.0.1:5557 "
        "(bind+ binds that interface, connect+ connects; unprefixed, vLLM's rule: a wildcard host such as "
        "tcp://*:5557 or ipc:// binds, another host is connected to); needs the 'events' extra",
    )
    s.add_argument(
        "--kv-events-format",
        choices=("vllm", "vllm-legacy"),
        default="vllm",
        help="vllm (default): events as tagged maps, as vLLM >= 0.26 publishes them; vllm-legacy: positional "
        "arrays, for consumers of older vLLM",
    )
    s.add_argument(
        "--kv-events-curve-secret",
        type=Path,
        help="ZMQ CURVE: this worker's key file (a .key_secret file, as zmq.auth.create_certificates writes); "
        "subscribers must then authenticate (with --kv-events-curve-clients)",
    )
    s.add_argument(
        "--kv-events-curve-clients",
        type=Path,
        help="ZMQ CURVE: a directory of the public key files (*.key) of the subscribers allowed to read the events",
    )
    s.add_argument(
        "--kv-events-insecure",
        action="store_true",
        help="with --auth-tokens, publish the events over TCP without CURVE: the network is trusted (the events "
        "hold every tenant's token ids)",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics on this port (0: a free one): the whole worker's counters, no auth, for "
        "the operator's scraper only",
    )
    s.add_argument("--metrics-host", help="address the metrics port binds (default: --host), e.g. 127.0.0.1")
    s.add_argument(
        "--http-port", type=int, help="also serve the OpenAI-compatible HTTP API on this port (0: a free one)"
    )
    s.add_argument(
        "--http-max-connections",
        type=int,
        default=512,
        help="open HTTP connections at most (default 512); one more is answered 503 and closed",
    )
    s.add_argument(
        "--http-head-timeout",
        type=float,
        default=10.0,
        help="seconds an HTTP request's line and headers may take to arrive (default 10; then 408, closed)",
    )
    s.add_argument(
        "--http-allowed-hosts",
        type=lambda text: tuple(text.split(",")),
        help="comma-separated Host names the HTTP API answers besides localhost and IP addresses, e.g. "
        "api.example.com ('*': any). Default: bound to loopback, localhost only; bound beyond it, any",
    )
    a = p.add_argument_group("agents (issue 28)")
    a.add_argument(
        "--remember-generated-mib", type=int, default=64,
        help="memory for the token ids of what was generated, per tenant, so a history that sends a reply back "
        "continues from the model's own tokens (default 64 MiB in all; 0: off)",
    )  # fmt: skip
    a.add_argument(
        "--responses-store", type=int, default=1000, help="stored responses per tenant (default 1000; 0: none)"
    )
    a.add_argument("--responses-store-mib", type=int, default=64, help="stored responses' size per tenant (default 64)")
    a.add_argument(
        "--responses-ttl", type=float, default=3600.0, help="seconds a stored response is kept (default 3600)"
    )
    a.add_argument(
        "--responses-pin-ttl", type=float, default=600.0,
        help="seconds a stored response's pages stay pinned, inside --max-pinned (default 600; 0: not pinned)",
    )  # fmt: skip
    s.add_argument("--grace-period", type=float, default=30.0, help="seconds to drain streams on SIGTERM")
    s.add_argument("--max-concurrent-rpcs", type=int, default=1024)
    s.add_argument(
        "--max-message-mib",
        type=int,
        default=4,
        help="largest gRPC message, MiB (default 4, gRPC's own: larger ones are refused RESOURCE_EXHAUSTED)",
    )
    s.add_argument("--max-body-mib", type=int, default=16, help="largest HTTP request body, MiB (default 16: 413)")
    s.add_argument("--log-level", default="INFO")
    return p


def parse_share(text: str) -> float:
    """'0.5' or '50%' -> 0.5; a share of something, in [0, 1]."""
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share such as 0.5 or 50%, got {text!r}") from None
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"a share must be in [0, 1] (0%..100%), got {text!r}")
    return share


def check_tier_flags(args: argparse.Namespace) -> str | None:
    """Why the tier flags cannot work (naming the flag), or None."""
    if args.kv_disk_size is not None and args.kv_disk is None:
        return "--kv-disk-size needs --kv-disk DIR"
    if args.no_cache and (args.kv_disk is not None or args.kv_host_memory is not None):
        return "--kv-disk and --kv-host-memory keep cached pages: they need the cache (drop --no-cache)"
    if args.kv_disk is not None:
        folder = Path(args.kv_disk)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"--kv-disk {args.kv_disk}: {e.strerror or e}"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"--kv-disk {args.kv_disk}: the folder is not writable"
    if args.kv_remote is not None:
        if args.no_cache:
            return "--kv-remote keeps cached pages in the fleet's store: it needs the cache (drop --no-cache)"
        try:
            parse_store_url(args.kv_remote, "--kv-remote")
        except ValueError as e:
            return str(e)
        if not 1 <= args.kv_remote_replicas <= MAX_REMOTE_REPLICAS:
            return f"--kv-remote-replicas must be in [1, {MAX_REMOTE_REPLICAS}], got {args.kv_remote_replicas}"
        if not 0.0 < args.kv_remote_timeout <= 60.0:
            return f"--kv-remote-timeout must be in (0, 60] seconds, got {args.kv_remote_timeout}"
        if args.kv_remote_metadata is not None and not args.kv_remote_metadata.startswith(("http://", "https://")):
            return f"--kv-remote-metadata must be an http:// URL, got {args.kv_remote_metadata!r}"
        if importlib.util.find_spec("mooncake") is None:  # looked up, not imported
            return "--kv-remote needs the store extra (pip install 'radixcache[store]')"
    if args.kv_window_paging == "on" and (args.kv_disk or args.kv_host_memory or args.kv_demote or args.kv_remote):
        return (
            "--kv-window-paging on keeps sliding layers apart; --kv-disk, --kv-host-memory, --kv-remote and "
            "--kv-demote move whole pages: drop one of them (auto turns window paging off for them)"
        )
    return None


def parse_speculate(text: str) -> int:
    """Draft tokens per step: an integer in [0, MAX_SPECULATE]."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens, got {text!r}") from None
    if not 0 <= n <= MAX_SPECULATE:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SPECULATE}] draft tokens (0: off), got {n}")
    return n


def char_tokenizer() -> Any:
    """A one-token-per-character tokenizer with a small chat template, for --random-model.

    Every id decodes to printable text that encodes back to the same id, so a random model's replies survive the
    round trip through a chat history (turn N+1 then hits the whole of turn N in the cache). 191 characters:
    printable ASCII, newline, tab and printable Latin-1; anything else is <unk>.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    from radixcache.worker.model.tokenizer import Tokenizer

    chars = ["\n", "\t"] + [chr(c) for c in range(32, 127)] + [chr(c) for c in range(161, 256) if c != 173]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {ch: i + 3 for i, ch in enumerate(chars)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    # One token per character (known or <unk>), so at most 4 bytes of UTF-8 per token.
    return Tokenizer(tok, bos_token="<s>", eos_token="</s>", chat_template=CHAR_CHAT_TEMPLATE, max_bytes_per_token=4)


def load_model(args: argparse.Namespace) -> tuple[Any, str, str]:
    """(LoadedModel, model name, model path) as the options ask."""
    import torch

    from radixcache.worker.model.config import ModelConfig
    from radixcache.worker.model.loader import load_checkpoint, random_model

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.random_model:
        tokenizer = char_tokenizer()
        config = ModelConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_ids=(1,),
        )
        loaded = random_model(
            config, seed=args.seed, device=device, dtype=args.dtype or "float32", weights=args.weights
        )
        loaded.tokenizer = tokenizer
        return loaded, f"random-seed{args.seed}", ""
    path = args.model or default_model_path()
    loaded = load_checkpoint(path, device=device, dtype=args.dtype, weights=args.weights)
    return loaded, Path(path).resolve().name, str(Path(path).resolve())


def build_engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """Load the model, start and warm up the engine as the options ask: (Engine, ModelFacts). Also what each
    replica of `radixcache cluster` runs."""
    from radixcache.worker.engine.engine import Engine, EngineConfig
    from radixcache.worker.server import describe

    loaded, name, path = load_model(args)
    config = EngineConfig(
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        kv_memory_bytes=args.kv_memory,
        max_step_tokens=args.max_step_tokens,
        max_running=args.max_running,
        cache_enabled=not args.no_cache,
        backend=args.backend,
        max_pinned=args.max_pinned,
        speculate=args.speculate,
        kv_dtype=args.kv_dtype,
        kv_demote=args.kv_demote,
        kv_demote_share=args.kv_demote_share,
        kv_window_paging=args.kv_window_paging,
        eviction_policy=args.eviction_policy,
        kv_disk_dir=args.kv_disk,
        kv_host_bytes=args.kv_host_memory,
        kv_disk_write=args.kv_disk_write,
        kv_remote=args.kv_remote,
        kv_remote_metadata=args.kv_remote_metadata,
        kv_remote_host=args.kv_remote_host,
        kv_remote_segment_bytes=args.kv_remote_segment,
        kv_remote_replicas=args.kv_remote_replicas,
        kv_remote_timeout_s=args.kv_remote_timeout,
        **({"kv_disk_bytes": args.kv_disk_size} if args.kv_disk_size is not None else {}),
    )
    engine = Engine(loaded, config)
    engine.start()  # warm-up forward, then the engine thread
    info = describe(engine, model_name=name, model_path=path, cache_enabled=not args.no_cache)
    log.info(
        "serving %s: %d KV pages of %d tokens (%.1f MiB, %s, %d bytes per token), backend %s, %s on %s",
        name, info.kv_pages, info.page_size, info.kv_bytes / 2**20, info.kv_dtype, info.kv_bytes_per_token,
        info.backend, info.dtype, info.device,
    )  # fmt: skip
    return engine, info


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv[1:])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from radixcache.worker.front.auth import load_token_file
    from radixcache.worker.server import ServerOptions, run_worker

    try:
        tokens, admins = load_token_file(args.auth_tokens) if args.auth_tokens else (None, None)
    except (OSError, ValueError) as e:
        print(f"radixcache serve: --auth-tokens: {e}", file=sys.stderr)
        return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        print("radixcache serve: TLS needs both --tls-cert and --tls-key", file=sys.stderr)
        return 2
    if (why := check_tier_flags(args)) is not None:  # before loading the model, not after
        print(f"radixcache serve: {why}", file=sys.stderr)
        return 2
    curve = None
    if bool(args.kv_events_curve_secret) != bool(args.kv_events_curve_clients):
        print("radixcache serve: CURVE needs both --kv-events-curve-secret and --kv-events-curve-clients",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.kv_events_endpoint:  # fail before loading the model, not after
        from radixcache.worker.events.zmq_publisher import CurveKeys, check_available, check_security

        if args.kv_events_curve_secret:
            curve = CurveKeys(args.kv_events_curve_secret, args.kv_events_curve_clients)
        try:
            check_available()
            check_security(args.kv_events_endpoint, auth=tokens is not None, curve=curve,
                           insecure=args.kv_events_insecure)  # fmt: skip
        except (RuntimeError, ValueError) as e:
            print(f"radixcache serve: {e}", file=sys.stderr)
            return 2
    if args.http_port is not None:
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            print(f"radixcache serve: --http-port needs the openai extra (pip install 'radixcache[openai]'): {e}",
                  file=sys.stderr)  # fmt: skip
            return 2
    options = ServerOptions(
        host=args.host,
        port=args.port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_tokens=tokens,
        admin_tokens=admins,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_format=args.kv_events_format,
        kv_events_curve=curve,
        kv_events_insecure=args.kv_events_insecure,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        grace_period=args.grace_period,
        max_message_bytes=args.max_message_mib << 20,
        max_body_bytes=args.max_body_mib << 20,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        http_port=args.http_port,
        http_max_connections=args.http_max_connections,
        http_head_timeout_s=args.http_head_timeout,
        http_allowed_hosts=args.http_allowed_hosts,
        remember_generated_bytes=args.remember_generated_mib << 20,
        responses_max=args.responses_store,
        responses_max_bytes=args.responses_store_mib << 20,
        responses_ttl_s=args.responses_ttl,
        responses_pin_ttl_s=args.responses_pin_ttl,
    )

    def load_engine() -> tuple[Any, Any]:
        return build_engine(args)

    def on_listening(host: str, port: int) -> None:
        print(f"listening on {host}:{port}", flush=True)

    from radixcache.worker.attention.base import BackendUnavailableError

    try:
        return asyncio.run(run_worker(options, load_engine, on_listening=on_listening))
    except BackendUnavailableError as e:  # --backend flashinfer where it cannot run: say why, no traceback
        print(f"radixcache serve: --backend: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"radixcache serve: {e}", file=sys.stderr)
        return 1
