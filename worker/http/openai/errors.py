"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the HTTP status that fits."""

from __future__ import annotations

import re
from typing import Any

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


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status: a client's mistake (405, 415, 431, ...) is an invalid request."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class APIError(Exception):
    """Ends a request with `status` and an OpenAI error body. `param` names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        error = ErrorBody(message=self.message, type=error_type(self.status), param=self.param, code=self.code)
        return ErrorResponse(error=error).model_dump()


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


# validation's messages begin with the field they are about (its gRPC-side name), e.g. "messages[2].role must be",
# "stop[0] ...", "token_ids.ids[3] = ...". The HTTP front renames the few fields whose names differ.
_LEADING_FIELD = re.compile(r"^([a-z_]+)(?:[\[.]|\s)")
_PATH = re.compile(r"^[a-z_]+(?:\[\d+\]|\.[a-z_]+)*")
_PROMPT_WORDS = ("text", "token_ids", "the prompt", "no input", "set exactly one")


def param_of(message: str, *, prompt_param: str, renames: dict[str, str] | None = None) -> str | None:
    """The HTTP request field an InvalidArgument message is about: its leading field name, renamed to the HTTP
    front's name (`renames`); messages about the prompt itself name `prompt_param` ("messages" or "prompt")."""
    if message.startswith(_PROMPT_WORDS):
        return prompt_param
    match = _LEADING_FIELD.match(message)
    if match is None:
        return None
    name = match.group(1)
    if name in ("messages", "tools"):
        # keep the path into them: "messages[2].role", "messages[0].tool_calls[1].function.name"
        return _PATH.match(message).group(0)  # type: ignore[union-attr]  # it starts with the name
    return (renames or {}).get(name, name)
