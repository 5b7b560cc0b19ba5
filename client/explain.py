"""`radixcache explain`'s input and output: the prompt from the command line, an ExplainPrefixResponse as lines or JSON.

The worker decides everything (radixcache.explain, behind the ExplainPrefix RPC); this only reads and prints it.
"""

from __future__ import annotations

import sys
from typing import Any


def prompt_of(text: str | None, tokens: str | None, path: str | None) -> dict[str, Any]:
    """Client.explain's prompt keyword from the command line: text ("-": stdin), comma-separated ids, or a file.
    ValueError naming --tokens for an id that is not an integer."""
    if tokens is not None:
        try:
            return {"token_ids": [int(t) for t in tokens.replace(" ", "").split(",") if t]}
        except ValueError:
            raise ValueError(f"--tokens takes comma-separated integers, got {tokens!r}") from None
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return {"text": f.read()}
    return {"text": sys.stdin.read() if text == "-" else text}


def explain_lines(e: Any) -> list[str]:
    """One line per page looked at, then where the lookup stopped and why."""
    ps = e.page_size
    lines = [f"prompt_tokens={e.prompt_tokens} page_size={ps} looked up={e.cacheable_tokens} (all but the last token)"]
    for p in e.pages:
        first = p.index * ps
        span = f"tokens {first}..{first + p.tokens - 1}" if p.tokens else "no tokens"
        lines.append(f"  page {p.index:>4}  {span:<20} {p.state:<8} served {p.served}/{p.tokens}")
    looked = sum(p.tokens for p in e.pages)
    if looked < e.cacheable_tokens:
        rest = f"{looked}..{e.cacheable_tokens - 1}"
        lines.append(f"  tokens {rest}: not looked at (nothing after a page not wholly served is served)")
    end = f", match {e.cache_match_end}" if e.cache_match_end else ""
    lines.append(f"cached_tokens={e.cached_tokens}: stopped at token {e.cached_tokens}, {e.cache_miss_reason}{end}")
    return lines


def explain_json(e: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": e.prompt_tokens,
        "page_size": e.page_size,
        "cacheable_tokens": e.cacheable_tokens,
        "cached_tokens": e.cached_tokens,
        "cache_miss_reason": e.cache_miss_reason,
        "cache_match_end": e.cache_match_end,
        "pages": [{"index": p.index, "tokens": p.tokens, "served": p.served, "state": p.state} for p in e.pages],
    }
