"""Tokenizer: a `tokenizers.Tokenizer` (tokenizer.json) plus what tokenizer_config.json adds (special tokens,
chat template), and an incremental detokenizer that streams text without ever splitting a UTF-8 character."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from hashlib import blake2b
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


# Unicode normalizations map each character to one or more characters but may compose several into one, or a
# 4-byte character into a 1-byte one (NFKC of U+1D400 is "A"): text can shrink, by at most this factor.
_SHRINKING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_EXPANDING_NORMALIZERS = {"Prepend", "Replace"}  # Replace only when its content is at least as long as the pattern
# Pre-tokenizers that drop input (whitespace) or models that can fold arbitrarily many bytes into one token.
_UNBOUNDED_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
_BOUNDED_MODELS = {"BPE", "Unigram"}


def _components(node: Any, key: str) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer of tokenizer.json, with its Sequence flattened."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [c for child in node.get(key, []) for c in _components(child, key)]
    return [node]


def bytes_per_token_bound(tok: tokenizers.Tokenizer) -> int | None:
    """At most how many UTF-8 bytes of input text one token of `tok` stands for; None when there is no such bound.

    The longest vocabulary entry in UTF-8 (every input byte is at least one byte of a token's string: byte-level
    BPE writes a byte as one character, SentencePiece writes a space as the 3-byte "\u2581"), at least 4 (an unknown
    character may become one <unk>), times 4 when a Unicode normalizer may shrink the text. None for tokenizers that
    drop input or fold a run of unknown characters into one token: they give no bound before tokenizing.
    """
    spec = json.loads(tok.to_str())
    factor = 1
    for n in _components(spec.get("normalizer"), "normalizers"):
        kind = n.get("type")
        if kind in _SHRINKING_NORMALIZERS:
            factor = 4
        elif kind == "Replace":
            pattern = n.get("pattern", {})
            if "String" not in pattern or len(n.get("content", "")) < len(pattern["String"]):
                return None
        elif kind not in _EXPANDING_NORMALIZERS:
            return None
    for p in _components(spec.get("pre_tokenizer"), "pretokenizers"):
        if p.get("type") in _UNBOUNDED_PRE_TOKENIZERS or p.get("behavior") == "Removed":
            return None
    model = spec.get("model", {})
    if model.get("type") not in _BOUNDED_MODELS:
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in _components(spec.get("pre_tokenizer"), "pretokenizers"))
    if not (byte_level or model.get("byte_fallback")):
        if model.get("type") == "Unigram" or model.get("fuse_unk") or model.get("unk_token") is None:
            return None  # a run of unknown characters becomes one <unk> (or is dropped without an unk token)
    longest = max((len(t.encode("utf-8")) for t in tok.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, 4) * factor


class Tokenizer:
    """encode/decode over a fast tokenizer, the checkpoint's special tokens and its chat template.

    eos_token_ids: every id that ends generation (tokenizer_config's eos_token plus `extra_eos_ids`, which the
    loader fills from config.json / generation_config.json).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        max_bytes_per_token: int | None = None,
    ) -> None:
        self._tok = tokenizer
        # At most this many input bytes per token (see bytes_per_token_bound); a tokenizer that knows better, e.g.
        # one token per character, passes its own.
        self.max_bytes_per_token = max_bytes_per_token or bytes_per_token_bound(tokenizer)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else bos_token_id
        eos = set(int(i) for i in extra_eos_ids)
        if eos_token and tokenizer.token_to_id(eos_token) is not None:
            eos.add(tokenizer.token_to_id(eos_token))
        self.eos_token_ids: set[int] = eos
        self._template = None

    def digest(self) -> str:
        """BLAKE2b-128 of everything that maps text to ids here (the tokenizer's JSON, special tokens, template)."""
        h = blake2b(digest_size=16)
        for part in (
            self._tok.to_str(),
            self.bos_token,
            self.eos_token,
            self.chat_template,
            sorted(self.eos_token_ids),
        ):
            h.update(repr(part).encode("utf-8") + b"\0")
        return h.hexdigest()

    @classmethod
    def from_dir(
        cls, path: str | Path, *, extra_eos_ids: Iterable[int] = (), bos_token_id: int | None = None
    ) -> Tokenizer:
        """Read tokenizer.json (required) and tokenizer_config.json (optional) from a checkpoint folder."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer.json is missing in {path} (only fast tokenizers are supported)")
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            tokenizers.Tokenizer.from_file(str(tok_file)),
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            chat_template=template,
            extra_eos_ids=extra_eos_ids,
            bos_token_id=bos_token_id,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (e.g. a leading BOS).

        Through encode_batch, which releases the GIL while it works (encode holds it: a 15 MiB text would freeze
        every other thread, the server's event loop included, for half a minute)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_str(self) -> str:
        """The tokenizer.json text (for libraries that build their own token tables, e.g. grammar matchers)."""
        return self._tok.to_str()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *, tools: list[Any] | None = None
    ) -> str:
        """Render messages ([{"role", "content"}, ...]) with the checkpoint's jinja2 chat template (sandboxed).
        `tools` (function definitions) is the template's `tools` variable, as in Hugging Face's apply_chat_template.

        Raises ValueError when the checkpoint has no template, and jinja2's TemplateError when the template
        rejects the conversation (its raise_exception helper)."""
        if not self.chat_template:
            raise ValueError(
                "this checkpoint has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); send a raw prompt instead"
            )
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    push(token_id) returns the text that token completes; it returns "" while the decoded tail ends in U+FFFD
    (a UTF-8 character split across tokens), so a delta never carries half a character. Decoding always
    re-reads a few previous tokens so tokenizers that drop a leading space at the start of a decode (SentencePiece)
    still produce the right spacing. flush() returns whatever is held back (replacement characters included).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window re-decoded each time
        self._read = 0  # tokens whose text has been emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the token that completes it
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Text of tokens still held back; after it the detokenizer is empty of pending text."""
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        self._prefix = self._read = len(self._ids)
        return text[len(done) :] if text.startswith(done) else text
