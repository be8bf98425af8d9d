"""A refused request is one log line, not an error with a traceback.

Ray Serve logs every exception a replica's method raises as `ERROR ... Request failed.` with the
whole traceback, through the Serve replica's own frames. The Coordinator refuses requests by
raising `RequestError` (a prompt past the context, a full queue, a target being replaced), the
way the ingress answers them with a 4xx or 503; logged so, an ordinary 400 read like a crash of
the server. This filter rewrites such records into one INFO line with the status and the
message, as vLLM and SGLang log a refusal; an internal error keeps its ERROR and traceback.
"""

import logging

from ddtree_serve.serve.errors import ErrorKind, RequestError, as_request_error

SERVE_LOGGER = "ray.serve"
"""The logger Serve's replicas log a failed request with (`ray.serve._private.replica`)."""


class RefusalLogFilter(logging.Filter):
    """Turns a failed-request record whose exception is a `RequestError` other than an internal
    error into one INFO line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        refusal = _refusal(record)
        if refusal is not None:
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg = "request refused (%d %s): %s"
            record.args = (refusal.kind.http_status, refusal.kind.openai_type, refusal.message)
            record.exc_info = record.exc_text = None
        return True


def install_refusal_log_filter() -> None:
    """On Serve's replica logger, once per process."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(existing, RefusalLogFilter) for existing in logger.filters):
        logger.addFilter(RefusalLogFilter())


def _refusal(record: logging.LogRecord) -> RequestError | None:
    if record.levelno < logging.ERROR or not record.exc_info or record.exc_info[1] is None:
        return None
    error = as_request_error(record.exc_info[1])
    return None if error is None or error.kind is ErrorKind.INTERNAL else error
