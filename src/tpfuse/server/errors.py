"""A client error and the OpenAI-style body that reports it."""

from __future__ import annotations


class RequestError(ValueError):
    """A client error: `status` is the HTTP code, `param` the offending field (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def error_body(message: str, param: str | None = None, type: str = "invalid_request_error", code=None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
