"""What the agent-API tests share (issue 28): a tools-aware chat template for the embedded default model, a small
tool, the frameworks' recorded request bodies (tests/fixtures/), and a worker serving the default model with it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker_harness import ThreadedWorker

from radixcache.worker.cli import default_model_path
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.model.loader import load_checkpoint

MODEL = "fake"  # the name ThreadedWorker describes the engine with
FIXTURES = Path(__file__).parent / "fixtures"
# Qwen2.5's layout with the default model's special tokens: tools in a system turn, calls as <tool_call> blocks,
# results as <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools><|end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|end|>\n{% elif m.role == 'tool' %}<|user|>\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|end|>\n{% else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"enum": ["default value", "the object"]},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


def fixture(name: str) -> dict[str, Any]:
    """A recorded request body, its "_source" note dropped and its model set to the test worker's."""
    body = json.loads((FIXTURES / name).read_text())
    body.pop("_source")
    return body | {"model": MODEL}


@contextlib.contextmanager
def tools_worker(kv_pages: int = 256, **options: Any) -> Iterator[tuple[Engine, ThreadedWorker, str]]:
    """(engine, worker, base URL): the default model with TOOLS_TEMPLATE, served over HTTP in this process."""
    loaded = load_checkpoint(default_model_path())
    loaded.tokenizer.chat_template = TOOLS_TEMPLATE
    engine = Engine(loaded, EngineConfig(kv_pages=kv_pages, page_size=16))
    worker = ThreadedWorker(engine, http_port=0, **options).start()
    try:
        yield engine, worker, f"http://127.0.0.1:{worker.server.http_port}/v1"
    finally:
        worker.stop()
        engine.shutdown(drain=False)
