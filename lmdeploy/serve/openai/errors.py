"""`APIError`: an error raised anywhere in the server (handlers, middleware) and rendered as an OpenAI error body."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from .protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """Rendered as `{"error": {message, type, param, code}}` with HTTP status `status` (and `headers`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = 'invalid_request_error', headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)
