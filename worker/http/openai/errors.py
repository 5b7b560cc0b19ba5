"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the HTTP status that fits (the
shape of every path of the HTTP app but the Messages API's), and front-core refusals as OpenAI errors: `param` is
the refusal's field by OpenAI's names, mapped with a table (`param_of`), never read from the message."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixcache.worker.engine.field_errors import FieldPath
from radixcache.worker.front.core import Refusal, RefusalKind
from radixcache.worker.front.validation import CONSTRAINT_FIELDS, MESSAGES, PROMPT_FIELDS, TOOLS
from radixcache.worker.http.errors import HTTP_STATUS, APIError
from radixcache.worker.http.openai.protocol import ErrorBody, ErrorResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}
ERROR_CODES = {
    RefusalKind.CONTEXT_OVERFLOW: "context_length_exceeded",
    RefusalKind.UNAUTHENTICATED: "invalid_api_key",
    RefusalKind.UNAVAILABLE: "unavailable",
    RefusalKind.TOO_LARGE: "too_large",
}
# validation's field names (gRPC's) that every OpenAI route calls otherwise; a route adds its own (max_tokens may
# be max_completion_tokens or max_output_tokens, top_logprobs is completions' logprobs, ...).
NAMES = {"cache_key": "prompt_cache_key"}
# Fields whose path is kept in `param`: chat messages and tools are the request's own lists, index for index.
PATHS = frozenset({MESSAGES.head, TOOLS.head})


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status: a client's mistake (405, 415, 431, ...) is an invalid request."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(e: APIError) -> dict[str, Any]:
    """An APIError in OpenAI's shape."""
    error = ErrorBody(message=e.message, type=error_type(e.status), param=e.param, code=e.code)
    return ErrorResponse(error=error).model_dump()


def param_of(field: FieldPath, *, prompt_param: str, constraint_param: str, names: Mapping[str, str]) -> str:
    """A refusal's field as an OpenAI request parameter: the prompt's fields are `prompt_param` (messages, prompt
    or input), the constraint's `constraint_param` (response_format, tool_choice, text.format); `names` renames
    the others by their head; a path into messages or tools is kept whole (messages[2].role), any other field is
    its head (stop_token_ids[3] is stop_token_ids)."""
    head = field.head
    if head in names:
        return names[head]
    if head in PROMPT_FIELDS:
        return prompt_param
    if head in CONSTRAINT_FIELDS:
        return constraint_param
    return str(field) if head in PATHS else head


def api_error(
    refusal: Refusal,
    *,
    prompt_param: str = "messages",
    constraint_param: str = "response_format",
    names: Mapping[str, str] | None = None,
) -> APIError:
    """A front-core refusal as an OpenAI error: its status, code, and the request field it is about by this route's
    names (param_of; `names` adds the route's to NAMES). A constraint's message is prefixed with the parameter that
    asked for it ("response_format: json_schema is not valid JSON: ...")."""
    status, code, message = HTTP_STATUS[refusal.kind], ERROR_CODES.get(refusal.kind), refusal.message
    if refusal.field is None:
        return APIError(status, message, code=code)
    table = {**NAMES, **(names or {})}
    param = param_of(refusal.field, prompt_param=prompt_param, constraint_param=constraint_param, names=table)
    if refusal.field.head in CONSTRAINT_FIELDS:
        message = f"{param}: {message}"
    return APIError(status, message, param=param, code=code)
