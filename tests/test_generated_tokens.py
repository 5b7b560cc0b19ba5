"""The memory of generated token ids (worker/front/generated.py): a history that sends a reply back is tokenized with the
ids the model wrote, at that message's place only, and the memory stays inside its bounds per tenant."""

from __future__ import annotations

from engine_fixtures import byte_tokenizer

from radixcache.worker.front.generated import GeneratedTokens, encode_rendered
from radixcache.worker.front.validation import ModelLimits, PromptInput, render_prompt
from radixcache.worker.model.tokenizer import Tokenizer

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}</s>{% endfor %}<assistant>"
)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def tokenizer() -> Tokenizer:
    return Tokenizer(byte_tokenizer()._tok, eos_token="<|eos|>", chat_template=TEMPLATE)


def odd_ids(tok: Tokenizer, text: str) -> list[int]:
    """`text` tokenized one character at a time: decodes to it, but not what the tokenizer would write."""
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert tok.decode(ids) == text and ids != tok.encode(text, add_special_tokens=False)
    return ids


def render(tok: Tokenizer, messages: list[dict], memory: GeneratedTokens | None = None) -> list[int]:
    limits = ModelLimits.of(tok, vocab_size=tok.vocab_size, context_length=4096)
    replies = memory.lookup("t", messages) if memory else None
    return render_prompt(PromptInput(messages=messages), tok, limits, replies)[0]


def test_a_history_continues_from_the_ids_the_model_generated():
    tok, memory = tokenizer(), GeneratedTokens()
    turn1 = [{"role": "user", "content": "the cache keeps"}]
    prompt1 = render(tok, turn1, memory)
    reply = odd_ids(tok, CALL)
    memory.remember("t", reply, tok.decode)
    called = {"role": "assistant", "content": "",
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}  # fmt: skip
    turn2 = turn1 + [called, {"role": "tool", "content": "2"}]
    ids = render(tok, turn2, memory)
    assert ids[: len(prompt1) + len(reply)] == prompt1 + reply  # everything turn 1 computed is a prefix
    assert tok.decode(ids) == tok.decode(render(tok, turn2))  # the same text as without the memory
    assert render(tok, turn2)[: len(prompt1) + len(reply)] != prompt1 + reply  # (which re-tokenizes the call)
    # Another tenant's history never uses this tenant's replies.
    assert memory.lookup("other", turn2) == {}
    # Arguments sent back as a JSON string (as OpenAI clients do) find the same reply.
    as_string = dict(called, tool_calls=[{"function": {"name": "add", "arguments": '{"a":1}'}}])
    assert list(memory.lookup("t", turn1 + [as_string])) == [1]


def test_a_reply_the_template_writes_otherwise_is_encoded_as_text_and_the_others_still_hit():
    tok, memory = tokenizer(), GeneratedTokens()
    plain = odd_ids(tok, "keys and values")
    memory.remember("t", plain, tok.decode)
    memory.remember("t", odd_ids(tok, "  padded  "), tok.decode)  # the client strips it: found, text differs
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "padded"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "keys and values"},
        {"role": "user", "content": "c"},
    ]
    assert sorted(memory.lookup("t", history)) == [1, 3]
    ids = render(tok, history, memory)
    rendered = tok.apply_chat_template(history)
    assert tok.decode(ids) == rendered
    before = tok.encode(rendered[: rendered.index("keys and values")], add_special_tokens=False)
    assert ids[: len(before) + len(plain)] == before + plain


def test_encode_rendered_falls_back_to_the_whole_text_when_the_markers_cannot_be_placed():
    tok = tokenizer()
    memory = GeneratedTokens()
    memory.remember("t", odd_ids(tok, "hello"), tok.decode)
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "hello"}]
    replies = memory.lookup("t", history)
    rendered = tok.apply_chat_template(history)

    def refuses(conversation: list[dict]) -> str:
        raise ValueError("no")

    assert encode_rendered(tok, rendered, refuses, history, replies) == tok.encode(rendered, add_special_tokens=False)


def test_the_memory_is_bounded_per_tenant_and_in_all():
    tok = tokenizer()
    memory = GeneratedTokens(max_bytes=10_000, max_entries=3, max_namespace_bytes=6_000)
    for i in range(5):
        memory.remember("a", tok.encode(f"reply {i}", add_special_tokens=False), tok.decode)
    assert len(memory) == 3  # the oldest two forgotten
    assert memory.lookup("a", [{"role": "assistant", "content": "reply 0"}]) == {}
    assert list(memory.lookup("a", [{"role": "assistant", "content": "reply 2"}])) == [0]  # touched: kept
    memory.remember("a", tok.encode("reply 5", add_special_tokens=False), tok.decode)
    assert memory.lookup("a", [{"role": "assistant", "content": "reply 2"}]) != {}
    assert memory.lookup("a", [{"role": "assistant", "content": "reply 3"}]) == {}
    big = tok.encode("x" * 2_000, add_special_tokens=False)
    for tenant in ("b", "c", "d"):
        memory.remember(tenant, big, tok.decode)
    assert memory.bytes <= memory.max_bytes
    assert all(size <= memory.max_namespace_bytes for size in memory._namespace_bytes.values())
    memory.clear("d")
    assert memory.lookup("d", [{"role": "assistant", "content": "x" * 2_000}]) == {}
    off = GeneratedTokens(max_bytes=0)
    off.remember("a", [5, 6], tok.decode)
    assert len(off) == 0
