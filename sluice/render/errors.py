"""A request the server will not serve, with the HTTP status and OpenAI error fields."""
from __future__ import annotations


class RequestError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
