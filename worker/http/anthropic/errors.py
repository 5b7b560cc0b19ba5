"""Errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}} with the HTTP status that fits.

The HTTP app raises one APIError (worker/http/errors.py: status, message, param) for both APIs; its handlers
write it in this shape for the Messages API's paths (`anthropic_path`). Anthropic's error has no param: the message
names the field, by this API's names (a refusal's field renamed with a table, RENAMES and PREFIXES, never found by
reading the message). A context overflow is said in Anthropic's own words ("prompt is too long: N tokens > M
maximum", "input length and `max_tokens` exceed context limit: P + T > C, ..."), so a client that matches them to
compact a conversation or lower max_tokens recognises it.
"""

from __future__ import annotations

from typing import Any

from radixcache.worker.front.core import Refusal, RefusalKind
from radixcache.worker.front.validation import CONSTRAINT_FIELDS, ContextOverflow
from radixcache.worker.http.errors import HTTP_STATUS, APIError

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
# The request fields this API calls otherwise than validation (whose names are gRPC's): the message says the
# Messages API's name where it begins with the field's.
RENAMES = {"stop": "stop_sequences"}
# Fields whose messages do not say which of this API's fields they are about: the message is prefixed with it.
PREFIXES = {"prompt": "messages"}


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
    """A front-core refusal as this API's error: its status (the app's table), its message naming the field by this
    API's names: a constraint's prefixed with the parameter that asked for it (tool_choice or
    output_config.format), a renamed field's in the new name, a context overflow in Anthropic's words."""
    status, message, field = HTTP_STATUS[refusal.kind], refusal.message, refusal.field
    if refusal.kind is RefusalKind.CONTEXT_OVERFLOW and isinstance(refusal.cause, ContextOverflow):
        message = overflow_message(refusal.cause)
    elif field is None:
        pass
    elif field.head in CONSTRAINT_FIELDS:
        message = f"{constraint_param}: {message}"
    elif field.head in PREFIXES:
        message = f"{PREFIXES[field.head]}: {message}"
    elif field.head in RENAMES:
        message = refusal.worded(str(field.with_head(RENAMES[field.head])))
    return APIError(status, message)
