"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, for every failure the server answers
(docs/architecture.md, "Server"): a request the schema refuses, a body that is not JSON and a field the admission
checks refuse are 400 naming the field in `param`; other statuses carry their own type."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .schemas import FIELD_NAMES

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
         504: "timeout_error"}


class APIError(Exception):
    """A request the server answers with an error: HTTP status, message, the request field at fault (or None)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def param_of(location: tuple, unknown_field: bool = False) -> str | None:
    """The request field a pydantic error location names, as OpenAI writes it (`messages.[0].content`); with
    `unknown_field` its last part is a field the schema does not know."""
    names = []
    for number, part in enumerate(location[1:], 2):  # location[0] is "body"
        if isinstance(part, int):
            names.append(f"[{part}]")
        elif part in FIELD_NAMES or (unknown_field and number == len(location)):
            names.append(part)
        else:
            break
    return ".".join(names) or None


def validation_error(error: RequestValidationError) -> APIError:
    """400 for the first thing the schema refused: the field, or the body itself when it is not a JSON object."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})")
    unknown = first["type"] == "extra_forbidden"
    param = param_of(tuple(first["loc"]), unknown)
    if param is None:
        return APIError(400, f"the body must be a JSON object of the request's fields ({first['msg']})")
    message = "this server takes no such field" if unknown else first["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}", param)


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers, in OpenAI's error object."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        return validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException):
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()
