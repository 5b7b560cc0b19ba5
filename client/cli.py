"""The client subcommands of `radixcache`: generate, chat, stats, pin, events, explain. Imports only grpc and the stubs.

    radixcache generate --target 127.0.0.1:50051 "Once upon a time" --max-tokens 64
    radixcache chat --system "You are terse."          # one user turn per stdin line; prints cached_tokens per turn
    radixcache stats
    radixcache pin --ttl 600 --file system_prompt.txt  # --unpin to remove it
    radixcache events --token ADMIN_TOKEN              # the cache event stream: snapshot, then live batches
    radixcache explain --tokens 1,2,3,4,5              # what the cache would serve of a prompt, page by page

The target and token may also come from RADIXCACHE_TARGET and RADIXCACHE_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import grpc

from radixcache.client.chat import Chat
from radixcache.client.client import Client


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get("RADIXCACHE_TARGET", "127.0.0.1:50051"), help="HOST:PORT")
    p.add_argument("--token", default=os.environ.get("RADIXCACHE_TOKEN"), help="bearer token (auth)")
    p.add_argument("--tls-ca", help="CA certificate (PEM) of a TLS worker")
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each call, seconds")


def _sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"radixcache {command}")
    _common(p)
    if command == "generate":
        p.description = "Stream a completion to stdout (a summary goes to stderr)."
        p.add_argument("prompt", help='the prompt text ("-" reads stdin)')
        p.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
        p.add_argument("--system", help="with --chat: a system message first")
        _sampling(p)
    elif command == "chat":
        p.description = "Interactive multi-turn chat: one user turn per stdin line; prints cached_tokens per turn."
        p.add_argument("--system", help="system message")
        _sampling(p)
    elif command == "stats":
        p.description = "Print the worker's cache statistics."
        p.add_argument("--json", action="store_true")
        p.add_argument("--model", action="store_true", help="also print the model info")
    elif command == "pin":
        p.description = "Pin a prefix (e.g. a system prompt) in the worker's cache; computes it first if needed."
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("text", nargs="?", help="the prefix text")
        src.add_argument("--file", help="read the prefix from this file")
        p.add_argument("--ttl", type=float, help="seconds the pin lasts (default: until unpinned)")
        p.add_argument("--unpin", action="store_true", help="remove the pin instead")
    elif command == "events":
        p.description = (
            "Print the worker's cache event stream (needs an admin token with --auth-tokens): a snapshot of every "
            "cached page, then live batches of stored/removed/cleared pages, until interrupted."
        )
        p.add_argument("--json", action="store_true", help="one JSON object per batch (token ids included)")
        p.add_argument("--snapshot-only", action="store_true", help="exit once the snapshot is printed")
        p.add_argument("--batches", type=int, help="exit after this many messages")
    elif command == "explain":
        p.description = (
            "Walk a prompt through the worker's cache (your own namespace: the token's tenant) page by page: what a "
            "request with it would be served now, where that would stop and why. Changes nothing in the cache."
        )
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("text", nargs="?", help='the prompt text ("-" reads stdin)')
        src.add_argument("--tokens", help="the prompt as comma-separated token ids")
        src.add_argument("--file", help="read the prompt text from this file")
        p.add_argument("--json", action="store_true", help="the answer as one JSON object")
    return p


def _client(args: argparse.Namespace) -> Client:
    return Client(args.target, token=args.token, tls_ca=args.tls_ca, tls=args.tls)


def _turn_summary(c: Any) -> str:
    return (
        f"[prompt_tokens={c.prompt_tokens} cached_tokens={c.cached_tokens} "
        f"completion_tokens={c.completion_tokens} finish_reason={c.finish_reason}]"
    )


def _generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    kwargs = _sampling_kwargs(args)
    with _client(args) as client:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            stream = client.generate(messages=messages, timeout=args.timeout, **kwargs)
        else:
            stream = client.generate(prompt, timeout=args.timeout, **kwargs)
        last = None
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
        sys.stdout.write("\n")
        if last is not None:
            print(_turn_summary(last), file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    with _client(args) as client:
        chat = Chat(client, system=args.system, **_sampling_kwargs(args))
        while True:
            if interactive:
                print("you> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if not line.strip():
                continue
            print("assistant> ", end="", flush=True)
            for chunk in chat.stream(line, timeout=args.timeout):
                print(chunk.text, end="", flush=True)
            print()
            print(_turn_summary(chat.turns[-1]), flush=True)
    return 0


def _stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        out: dict[str, Any] = {"cache": client.stats()}
        if args.model:
            out["model"] = client.model_info()
    if args.json:
        print(json.dumps(out if args.model else out["cache"], indent=2))
        return 0
    for section, values in out.items():
        if args.model:
            print(f"[{section}]")
        for k, v in values.items():
            if k == "replicas":  # a cluster: one line per replica, its main figures
                for r in v:
                    print(f"replica {r['replica_id']}: " + " ".join(f"{f}={r[f]}" for f in _REPLICA_FIELDS))
            else:
                print(f"{k:<16} {v:.4f}" if isinstance(v, float) else f"{k:<16} {v}")
    return 0


_REPLICA_FIELDS = ("running", "waiting", "pages_cached", "pages_free", "hit_tokens", "queried_tokens")


def _pin(args: argparse.Namespace) -> int:
    text = args.text
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    with _client(args) as client:
        if args.unpin:
            print(f"unpinned {client.unpin(text)} tokens")
        else:
            print(f"pinned {client.pin(text, ttl_seconds=args.ttl)} tokens")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from radixcache.client.explain import explain_json, explain_lines, prompt_of

    try:
        prompt = prompt_of(args.text, args.tokens, args.file)
    except ValueError as e:
        print(f"radixcache explain: {e}", file=sys.stderr)
        return 2
    with _client(args) as client:
        answer = client.explain(**prompt, timeout=args.timeout)
    print(json.dumps(explain_json(answer)) if args.json else "\n".join(explain_lines(answer)))
    return 0


BATCH_KINDS = {1: "snapshot", 2: "events", 3: "reset"}


def _hashes(values: Any) -> str:
    return "[" + " ".join(f"{h:016x}" for h in values) + "]"


def _batch_json(m: Any) -> dict[str, Any]:
    events = []
    for e in m.events:
        kind = e.WhichOneof("event")
        item: dict[str, Any] = {"type": kind, "namespace": e.namespace}
        if kind == "stored":
            item["parent_hash"] = e.stored.parent_hash if e.stored.HasField("parent_hash") else None
            item["page_hashes"] = list(e.stored.page_hashes)
            item["token_ids"] = list(e.stored.token_ids)
        elif kind == "removed":
            item["page_hashes"] = list(e.removed.page_hashes)
        events.append(item)
    out = {"kind": BATCH_KINDS.get(m.kind, str(m.kind)), "sequence": m.sequence, "page_size": m.page_size}
    out["kv_dtype"] = m.kv_dtype  # quantized precisions are part of every page hash
    if m.kind == 1:
        out["snapshot_complete"] = m.snapshot_complete
    return out | {"timestamp": m.timestamp, "events": events}


def _batch_text(m: Any) -> list[str]:
    kind = BATCH_KINDS.get(m.kind, str(m.kind))
    head = f"{kind} seq={m.sequence}"
    if m.kind == 1:
        kv = f" kv_dtype={m.kv_dtype}" if m.kv_dtype else ""
        head += f" page_size={m.page_size}{kv}" + (" (complete)" if m.snapshot_complete else " (part)")
    lines = [head]
    for e in m.events:
        what = e.WhichOneof("event")
        if what == "stored":
            parent = f"{e.stored.parent_hash:016x}" if e.stored.HasField("parent_hash") else "-"
            pages = _hashes(e.stored.page_hashes)
            lines.append(f"  stored  ns={e.namespace!r} parent={parent} pages={pages} tokens={len(e.stored.token_ids)}")
        elif what == "removed":
            lines.append(f"  removed ns={e.namespace!r} pages={_hashes(e.removed.page_hashes)}")
        else:
            lines.append(f"  cleared ns={e.namespace!r}")
    return lines


def _events(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for n, m in enumerate(client.cache_events(timeout=args.timeout), 1):
            print(json.dumps(_batch_json(m)) if args.json else "\n".join(_batch_text(m)), flush=True)
            if (args.snapshot_only and m.kind == 1 and m.snapshot_complete) or n == args.batches:
                break
    return 0


COMMANDS = {
    "generate": _generate, "chat": _chat, "stats": _stats, "pin": _pin, "events": _events, "explain": _explain,
}  # fmt: skip


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command not in COMMANDS:
        print(f"radixcache: the client commands are {', '.join(COMMANDS)}; got {command!r}", file=sys.stderr)
        return 2
    args = parser(command).parse_args(argv[1:])
    try:
        return COMMANDS[command](args)
    except grpc.RpcError as e:
        print(f"radixcache {command}: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except KeyboardInterrupt:
        return 130
