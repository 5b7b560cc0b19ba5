"""The bodies of vLLM's /tokenize and /detokenize (the subset radixcache serves), as pydantic models. No serving here
(tokenize_api.py). Booleans and token ids are strict: "1" or true is not a token id, 1 is not a boolean."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from radixcache.worker.http.openai.protocol import ChatMessageIn


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text (`prompt`) or a chat (`messages`), exactly one. add_special_tokens applies to a text
    (the tokenizer's post-processor, e.g. a leading BOS; vLLM's default, true); a chat template writes its own
    special tokens, so with messages it may only be false (vLLM's default there). add_generation_prompt: with
    messages, whether the assistant's turn is opened (as a chat request renders it)."""

    model_config = ConfigDict(extra="allow")  # refused by name in tokenize_api, not silently ignored

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None  # as a chat request sends them
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids -> the text they decode to (special tokens included, as vLLM decodes)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str
