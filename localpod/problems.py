"""Errors as RunPod's API v2 sends them: an `ErrorResponse` body (`title`, `status`, `detail`,
`errors?`) with content type `application/problem+json`."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

PROBLEM_JSON = "application/problem+json"


class ProblemError(Exception):
    """Raised anywhere in a route; answered as an `ErrorResponse` with this status."""

    def __init__(self, status: int, detail: str, errors: list[str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = errors


class PlainError(Exception):
    """Raised in a route to answer with this status and body as they are, not an `ErrorResponse`: an answer in
    the shape another of RunPod's APIs used (REST v1's `{"error": ...}`)."""

    def __init__(self, status: int, body: dict[str, object]) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def problem_response(status: int, detail: str, errors: list[str] | None = None) -> JSONResponse:
    body: dict[str, object] = {"title": HTTPStatus(status).phrase, "status": status, "detail": detail}
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON)


def install_problem_handlers(app: FastAPI) -> None:
    """Make every error the app answers, FastAPI's own included, an `ErrorResponse`."""

    async def on_problem(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ProblemError)
        return problem_response(exc.status, exc.detail, exc.errors)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [f"$.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return problem_response(400, "request does not match the expected shape", errors)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return problem_response(exc.status_code, str(exc.detail))

    async def on_plain(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, PlainError)
        return JSONResponse(exc.body, status_code=exc.status)

    app.add_exception_handler(ProblemError, on_problem)
    app.add_exception_handler(PlainError, on_plain)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
