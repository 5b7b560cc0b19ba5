"""What the worker generated, as token ids, so that a conversation that sends the assistant's own output back
continues from the very tokens the model wrote: its reuse of the cache does not depend on re-tokenizing the history
the same way.

Why: a reply's text does not tokenize back to the ids that produced it. Constrained decoding writes a name as
`a` + `dd` where the tokenizer writes `add`, a sampled reply may take any split of a word, and once the re-tokenized
history differs from what is cached, every token after the difference is computed again (issue 28: ~26 tokens of
each tool-calling turn). So the front core remembers, per namespace (tenant), each finished generation's token ids
with their exact text, keyed by what the client sees of it (the content and tool calls a front returned), and
`encode_rendered` uses them where a rendered chat history holds that exact text at the place of that assistant
message; everything else is tokenized as before.

Bounds: entries per namespace, bytes per namespace and bytes in all (LRU: a reply used again stays). The tokens of a
history then depend on whether its replies are still remembered: remembered, the model's own tokens (what the
cache holds); forgotten, the tokenizer's (what any server without this memory computes). Neither is more right;
both decode to the same text. `--remember-generated-mib 0` turns it off.

Threads: `remember` and `lookup` are called on a front's event loop, `encode_rendered` in a tokenizing worker
thread (it reads only the entries it is handed).
"""

from __future__ import annotations

import json
import threading
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixcache.worker.front.tool_calls import parse_tool_calls

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_ENTRIES = 4096  # per namespace
_ENTRY_OVERHEAD = 200  # bytes of bookkeeping per entry, roughly (key tuple, dict slots)


@dataclass(frozen=True)
class Reply:
    """One remembered generation: its exact text (special tokens written out) and the ids that produced it."""

    text: str
    ids: array  # array("i"): 4 bytes a token

    @property
    def size(self) -> int:
        return len(self.text.encode("utf-8")) + 4 * len(self.ids) + _ENTRY_OVERHEAD


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (a client's arguments string may nest deeper than json.loads goes)
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def reply_key(content: str | None, calls: Sequence[tuple[str, Any]]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What a client sees of a reply, normalized: its content (stripped) and its calls (name, arguments as canonical
    JSON). Only finds candidates: a reply is used only where its exact text is in the rendered history."""
    return (content or "").strip(), tuple((name, _canonical_arguments(args)) for name, args in calls)


def message_key(message: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """reply_key of an assistant message as chat templates take it (Hugging Face's shape); None for other roles."""
    if message.get("role") != "assistant":
        return None
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        calls.append((str(function.get("name", "")), function.get("arguments", {})))
    content = message.get("content")
    return reply_key(content if isinstance(content, str) else "", calls)


class GeneratedTokens:
    """The bounded memory of generated token ids (see the module docstring)."""

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_namespace_bytes: int | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_namespace_bytes = max_bytes // 4 if max_namespace_bytes is None else max_namespace_bytes
        self._lock = threading.Lock()
        self._all: OrderedDict[tuple[str, Any], Reply] = OrderedDict()  # (namespace, key), least recent first
        self._namespaces: dict[str, OrderedDict[Any, int]] = {}  # namespace -> key -> size, least recent first
        self._namespace_bytes: dict[str, int] = {}
        self.bytes = 0
        self.hits = self.remembered = 0

    def __len__(self) -> int:
        return len(self._all)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def remember(self, namespace: str, ids: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        """Remember a finished generation's ids (its stop token already dropped); decode: ids -> exact text,
        special tokens written out."""
        if not self.enabled or not ids:
            return
        reply = Reply(decode(list(ids)), array("i", ids))
        content, calls = parse_tool_calls(reply.text)
        key = reply_key(content, [(c.name, c.arguments) for c in calls])
        if reply.size > self.max_namespace_bytes:
            return
        with self._lock:
            self._drop(namespace, key)
            self._all[(namespace, key)] = reply
            self._namespaces.setdefault(namespace, OrderedDict())[key] = reply.size
            self._namespace_bytes[namespace] = self._namespace_bytes.get(namespace, 0) + reply.size
            self.bytes += reply.size
            self.remembered += 1
            entries = self._namespaces[namespace]
            while len(entries) > self.max_entries or self._namespace_bytes[namespace] > self.max_namespace_bytes:
                self._drop(namespace, next(iter(entries)))
            while self.bytes > self.max_bytes:
                oldest_namespace, oldest_key = next(iter(self._all))
                self._drop(oldest_namespace, oldest_key)

    def _drop(self, namespace: str, key: Any) -> None:
        reply = self._all.pop((namespace, key), None)
        if reply is None:
            return
        entries = self._namespaces[namespace]
        del entries[key]
        self._namespace_bytes[namespace] -= reply.size
        self.bytes -= reply.size
        if not entries:
            del self._namespaces[namespace], self._namespace_bytes[namespace]

    def lookup(self, namespace: str, messages: Sequence[Mapping[str, Any]]) -> dict[int, Reply]:
        """The remembered replies of a history's assistant messages: message index -> Reply (touched: recently
        used). Cheap (one dict lookup per assistant message); call it before tokenizing."""
        if not self.enabled:
            return {}
        found = {}
        with self._lock:
            for i, message in enumerate(messages):
                key = message_key(message)
                reply = None if key is None else self._all.get((namespace, key))
                if reply is not None:
                    self._all.move_to_end((namespace, key))
                    self._namespaces[namespace].move_to_end(key)
                    found[i] = reply
            self.hits += len(found)
        return found

    def clear(self, namespace: str | None = None) -> None:
        """Forget a namespace's replies (None: every namespace's), e.g. when its cache is flushed."""
        with self._lock:
            for ns in list(self._namespaces) if namespace is None else [namespace]:
                for key in list(self._namespaces.get(ns, ())):
                    self._drop(ns, key)


def encode_rendered(
    tokenizer: Any,
    rendered: str,
    render: Callable[[list[dict[str, Any]]], str],
    messages: list[dict[str, Any]],
    replies: Mapping[int, Reply],
) -> list[int]:
    """The token ids of a rendered chat history, with the remembered replies' own ids where the template put their
    exact text (at their message's place: the template is rendered once more with a unique marker as each such
    message's content, which locates it). Everything between is encoded as usual (without special tokens added:
    the template wrote them). Falls back to encoding `rendered` whole when the markers cannot be placed."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    if not replies:
        return encode(rendered)
    tag = uuid.uuid4().hex
    markers = {i: f"\ue000{tag}:{i}\ue001" for i in replies}
    marked = [
        {k: v for k, v in m.items() if k != "tool_calls"} | {"content": markers[i]} if i in markers else m
        for i, m in enumerate(messages)
    ]
    try:
        skeleton = render(marked)
    except Exception:  # a template that insists on tool_calls for such a turn
        return encode(rendered)
    order = sorted(markers, key=lambda i: skeleton.find(markers[i]))
    if any(skeleton.count(markers[i]) != 1 for i in order):
        return encode(rendered)
    pieces, rest = [], skeleton
    for i in order:
        before, rest = rest.split(markers[i], 1)
        pieces.append(before)
    pieces.append(rest)  # pieces[k] is the text before the k-th marker; the last one, after the last
    if not rendered.startswith(pieces[0]):
        return encode(rendered)
    ids: list[int] = []
    text, pos = pieces[0], len(pieces[0])
    for k, i in enumerate(order):
        after = pieces[k + 1]
        reply = replies[i]
        if rendered.startswith(reply.text + after, pos) and (
            k + 1 < len(order) or pos + len(reply.text + after) == len(rendered)
        ):
            ids += encode(text) + list(reply.ids)
            text, pos = "", pos + len(reply.text)
        else:  # the template wrote this message otherwise than the model did: encode it as text
            end = rendered.find(after, pos) if after else len(rendered)
            if end < 0:
                return encode(rendered)
            text, pos = text + rendered[pos:end], end
        text, pos = text + after, pos + len(after)
    if pos != len(rendered):
        return encode(rendered)
    return ids + encode(text)
