"""Chat: a multi-turn conversation that keeps its history and reports what each turn took from the cache.

The worker renders the history with the model's chat template, so every turn's prompt extends the previous turn's
(prompt + reply): from turn 2 on, cached_tokens should cover the whole previous turn.

    chat = Chat(client, system="You are terse.", max_tokens=64)
    reply = chat.send("Hi!")
    print(reply.text, reply.cached_tokens)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixcache.client.client import Chunk, Client, Completion


class Chat:
    def __init__(self, client: Client, *, system: str | None = None, **sampling: Any) -> None:
        self.client = client
        self.sampling = sampling
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.turns: list[Completion] = []

    def stream(self, user: str, **sampling: Any) -> Iterator[Chunk]:
        """Send a user turn and stream the reply; the reply joins the history once the stream is complete."""
        self.messages.append({"role": "user", "content": user})
        chunks: list[Chunk] = []
        try:
            for chunk in self.client.generate(messages=self.messages, **{**self.sampling, **sampling}):
                chunks.append(chunk)
                yield chunk
        except BaseException:
            self.messages.pop()  # the turn failed: leave the history as it was
            raise
        if not chunks or chunks[-1].finish_reason is None:  # the caller stopped early
            self.messages.pop()
            return
        reply = Completion.join(chunks)
        self.messages.append({"role": "assistant", "content": reply.text})
        self.turns.append(reply)

    def send(self, user: str, **sampling: Any) -> Completion:
        """Send a user turn; returns the reply (text, cached_tokens, prompt_tokens, completion_tokens, ...)."""
        for _ in self.stream(user, **sampling):
            pass
        return self.turns[-1]
