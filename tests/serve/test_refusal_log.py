"""A request the Coordinator refuses is logged as one INFO line; an internal error keeps its
traceback (the record Serve's replica logs with `logger.exception`)."""

import logging
import sys

import pytest

from ddtree_serve.serve.errors import ErrorKind, RequestError, invalid
from ddtree_serve.serve.refusal_log import RefusalLogFilter, install_refusal_log_filter


def failed_request_record(error: Exception) -> logging.LogRecord:
    """The record `logger.exception("Request failed.")` makes while `error` is being handled."""
    try:
        raise error
    except Exception:
        name = "test-refusal-log"
        logger = logging.getLogger(name)
        return logger.makeRecord(name, logging.ERROR, __file__, 0, "Request failed.", (), sys.exc_info())


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (invalid("max_tokens is past the context", "max_tokens"), "400 invalid_request_error"),
        (RequestError(ErrorKind.OVERLOADED, "the queue is full"), "503 overloaded_error"),
    ],
)
def test_a_refusal_is_one_info_line_with_its_status_and_message(error: RequestError, status: str) -> None:
    record = failed_request_record(error)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    RefusalLogFilter().filter(record)
    assert record.levelno == logging.INFO and record.levelname == "INFO"
    assert record.exc_info is None
    assert record.getMessage() == f"request refused ({status}): {error.message}"


def test_a_refusal_wrapped_by_another_error_is_found_through_its_cause() -> None:
    outer = RuntimeError("handle call failed")
    outer.__cause__ = invalid("prompt too long", "prompt")
    record = failed_request_record(outer)
    RefusalLogFilter().filter(record)
    assert record.getMessage() == "request refused (400 invalid_request_error): prompt too long"


@pytest.mark.parametrize("error", [RuntimeError("boom"), RequestError(ErrorKind.INTERNAL, "engine stopped")])
def test_an_internal_error_keeps_its_level_and_traceback(error: Exception) -> None:
    record = failed_request_record(error)
    RefusalLogFilter().filter(record)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == "Request failed."


def test_the_filter_is_installed_once_on_serves_logger() -> None:
    logger = logging.getLogger("ray.serve")
    before = list(logger.filters)
    try:
        install_refusal_log_filter()
        install_refusal_log_filter()
        assert sum(isinstance(f, RefusalLogFilter) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before
