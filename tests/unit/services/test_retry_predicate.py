"""The one retry predicate (services.clients): retry transport errors, timeouts, 429 and 5xx; never another 4xx."""

from __future__ import annotations

import httpx
import pytest

from services.clients import is_retryable, retry_after_s


def _status_error(code: int, headers: dict | None = None) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://reward/v1/score")
    response = httpx.Response(code, request=request, headers=headers)
    return httpx.HTTPStatusError(f"{code}", request=request, response=response)


@pytest.mark.parametrize("code", [429, 500, 501, 502, 503, 504, 599])
def test_429_and_5xx_are_retried(code):
    assert is_retryable(_status_error(code))


@pytest.mark.parametrize("code", [301, 400, 401, 403, 404, 409, 413, 422])
def test_other_statuses_are_not(code):
    assert not is_retryable(_status_error(code))


@pytest.mark.parametrize(
    "exc", [httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("cut")]
)
def test_transport_errors_and_timeouts_are_retried(exc):
    assert is_retryable(exc)


def test_errors_that_are_not_http_are_not_retried():
    assert not is_retryable(ValueError("a bug"))


def test_retry_after_is_read_from_the_failure():
    assert retry_after_s(_status_error(429, {"Retry-After": "3"})) == 3.0
    assert retry_after_s(_status_error(503, {"Retry-After": "soon"})) is None
    assert retry_after_s(httpx.ConnectError("refused")) is None
