"""One admission runs each rule once (FrontCore.admit over FakeEngine, whose submit runs the engine's own checks as
Engine.submit does): the front's rules before tokenizing (worker/front/validation.py: chat messages, tools, sampling
values), the engine's at submit (worker/engine/checks.py: the prompt's ids, stop token ids, length, room). Each rule
is counted where it is decided."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from fake_engine import FakeEngine

from radixcache.worker.engine import checks
from radixcache.worker.engine.request import SamplingParams
from radixcache.worker.front import validation
from radixcache.worker.front.core import FrontCore
from radixcache.worker.front.validation import PromptInput, SamplingValues
from radixcache.worker.server import describe

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT = PromptInput(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], tools=TOOLS)
VALUES = SamplingValues(max_tokens=4, temperature=0.5, stop=("\n",), stop_token_ids=(7,))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Calls of each rule, by name: every module's reference to it is wrapped."""
    calls: Counter = Counter()

    def count(module: Any, name: str, label: str | None = None) -> None:
        original: Callable[..., Any] = getattr(module, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[label or name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)

    for name in ("chat_messages", "check_tools", "check_text_bytes"):
        count(validation, name)
    for module in (checks, validation):  # validation calls the engine's length rule before it copies token ids
        count(module, "check_prompt_length")
    count(checks, "check_token_ids")
    count(checks, "check_room")
    count(SamplingParams, "__post_init__", "SamplingParams rules")
    return calls


def admit(prompt: PromptInput, values: SamplingValues = VALUES, **options: Any) -> None:
    engine = FakeEngine()
    core = FrontCore()
    core.attach(engine, describe(engine, model_name="fake"))

    async def run() -> None:
        (await core.admit("t", "r", prompt, values, **options)).close()

    asyncio.run(run())


def test_a_chat_admission_checks_its_messages_tools_and_values_once(counted: Counter) -> None:
    admit(CHAT)
    assert counted == {
        "chat_messages": 1, "check_tools": 1, "SamplingParams rules": 1,
        "check_prompt_length": 1, "check_token_ids": 2, "check_room": 1,  # at submit: the prompt's ids, the stop ids
    }  # fmt: skip


def test_a_text_admission_checks_its_size_before_tokenizing_and_its_tokens_at_submit(counted: Counter) -> None:
    admit(PromptInput(text="hello"))
    assert counted == {
        "check_text_bytes": 1, "SamplingParams rules": 1, "check_prompt_length": 1, "check_token_ids": 2,
        "check_room": 1,
    }  # fmt: skip


def test_token_ids_are_counted_before_they_are_copied_and_read_once_at_submit(counted: Counter) -> None:
    admit(PromptInput(token_ids=[5, 6, 7]))
    # The length twice: O(1), before the ids are copied (validation) and at submit (the engine's own check).
    assert counted == {"check_prompt_length": 2, "check_token_ids": 2, "check_room": 1, "SamplingParams rules": 1}


def test_an_unset_max_tokens_is_fitted_to_the_prompt_with_one_more_construction(counted: Counter) -> None:
    admit(CHAT, SamplingValues(), fill_max_tokens=True)  # OpenAI chat's default: as long as the reply can be
    assert counted["SamplingParams rules"] == 2 and counted["chat_messages"] == 1
