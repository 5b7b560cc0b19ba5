"""The one error of the HTTP app, and the one table of which HTTP status a front-core refusal gets.

Every route raises APIError (status, message, and where OpenAI's shape shows them, param and code); the app's
handlers write it in the shape of the API the path belongs to: Anthropic's for /v1/messages
(worker/http/anthropic/errors.py), OpenAI's everywhere else (worker/http/openai/errors.py). Each API maps a
refusal's field to its own names there, with a table; HTTP_STATUS is shared by both.
"""

from __future__ import annotations

from radixcache.worker.front.core import RefusalKind

# A front-core refusal's HTTP status (request ids are made here, so a duplicate one is the server's fault: 500).
HTTP_STATUS = {
    RefusalKind.INVALID_ARGUMENT: 400,
    RefusalKind.CONTEXT_OVERFLOW: 400,
    RefusalKind.UNAUTHENTICATED: 401,
    RefusalKind.PERMISSION_DENIED: 403,
    RefusalKind.UNAVAILABLE: 503,
    RefusalKind.TOO_LARGE: 413,
    RefusalKind.ALREADY_EXISTS: 500,
    RefusalKind.PIN_BUDGET: 429,
    RefusalKind.NO_CAPACITY: 503,
    RefusalKind.INTERNAL: 500,
}


class APIError(Exception):
    """Ends a request with `status` and an error body in its API's shape. `param` names the request field at fault
    (by the API's names), `code` is OpenAI's error code; Anthropic's shape has neither (its message names the
    field)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)
