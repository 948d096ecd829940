"""The error an OpenAI-API request is refused with: its HTTP status, OpenAI error type and the field at fault."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `type`, and the field (`param`) at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.error_type = status, param, error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": None}}
