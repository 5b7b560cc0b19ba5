"""The `radixcache` command: a thin dispatcher.

It is the one place that sees the cache, the worker and the client, and it imports a subcommand's package only when
that subcommand runs, so `radixcache generate` never loads torch.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("radixcache.worker.cli", "run the gRPC worker"),
    "cluster": ("radixcache.cluster.cli", "run N workers on Ray Serve behind one endpoint (extra: cluster)"),
    "generate": ("radixcache.client.cli", "stream a completion from a worker"),
    "chat": ("radixcache.client.cli", "interactive multi-turn chat, printing cached_tokens per turn"),
    "stats": ("radixcache.client.cli", "print a worker's cache statistics"),
    "pin": ("radixcache.client.cli", "pin a prefix (e.g. a system prompt) in a worker's cache"),
    "events": ("radixcache.client.cli", "print a worker's cache event stream (snapshot, then live changes)"),
    "explain": (
        "radixcache.client.cli",
        "walk a prompt through a worker's cache page by page: what matched, and why no more",
    ),
    "memory": ("radixcache.memory", "KV-cache memory calculator"),
}


def usage() -> str:
    lines = ["usage: radixcache <command> [options]", "", "commands:"]
    lines += [f"  {name:<10}{help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"radixcache: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main([name, *rest]) or 0)


if __name__ == "__main__":
    sys.exit(main())
