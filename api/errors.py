"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def rate_limited(code: str, message: str, retry_after_s: int) -> APIError:
    """429: over one of the tenant's admission limits; `Retry-After` says when to try again."""
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code=code,
        headers={"Retry-After": str(max(retry_after_s, 1))},
    )


def unauthorized(message: str = "Invalid or missing API key.") -> APIError:
    return APIError(
        401,
        message,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def not_found(message: str) -> APIError:
    return APIError(404, message, code="not_found")


def shutting_down() -> APIError:
    """503: this API process is shutting down (`api/shutdown.py`); another replica serves."""
    return APIError(
        503,
        "This API replica is shutting down; send the request again (to another replica).",
        type="server_error",
        code="shutting_down",
        headers={"Retry-After": "1"},
    )
