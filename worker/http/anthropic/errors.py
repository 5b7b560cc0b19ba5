"""Errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}} with the HTTP status that fits.

The HTTP app raises one APIError (worker/http/openai/errors.py: status, message, param) for both APIs; its handlers
write it in this shape for the Messages API's paths (`anthropic_path`). Anthropic's error has no param: the message
names the field. A context overflow is said in Anthropic's own words ("prompt is too long: N tokens > M maximum",
"input length and `max_tokens` exceed context limit: P + T > C, ..."), so a client that matches them to compact a
conversation or lower max_tokens recognises it.
"""

from __future__ import annotations

from typing import Any

from radixcache.worker.front.core import Refusal, RefusalKind
from radixcache.worker.front.validation import ContextOverflow
from radixcache.worker.http.openai.errors import APIError

PATH_PREFIX = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# The request fields that the front core's messages name otherwise (validation's names are gRPC's).
RENAMES = {"stop": "stop_sequences"}


def anthropic_path(path: str) -> bool:
    """Whether a request path belongs to the Messages API (its errors are written in this shape)."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def overflow_message(cause: ContextOverflow) -> str:
    if cause.prompt_tokens is not None and cause.max_tokens is not None:
        return (
            f"input length and `max_tokens` exceed context limit: {cause.prompt_tokens} + {cause.max_tokens} > "
            f"{cause.context_length}, decrease input length or `max_tokens` and try again"
        )
    if cause.prompt_tokens is not None:
        return f"prompt is too long: {cause.prompt_tokens} tokens > {cause.context_length - 1} maximum"
    return f"prompt is too long: {cause}"


def refusal_error(refusal: Refusal, *, constraint_param: str = "tool_choice") -> APIError:
    """A front-core refusal as this API's error: its status (the app's table), its message naming the field."""
    from radixcache.worker.http.openai.chat_api import HTTP_STATUS  # the one status table of the HTTP fronts

    status, message = HTTP_STATUS[refusal.kind], refusal.message
    if refusal.kind is RefusalKind.CONTEXT_OVERFLOW and isinstance(refusal.cause, ContextOverflow):
        message = overflow_message(refusal.cause)
    elif refusal.subject == "constraint":
        message = f"{constraint_param}: {message}"
    elif refusal.subject == "prompt":
        message = f"messages: {message}"
    else:
        for old, new in RENAMES.items():
            if message.startswith((old + " ", old + "[")):
                message = new + message[len(old) :]
    return APIError(status, message)
