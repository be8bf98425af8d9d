"""Request errors and their one mapping onto HTTP statuses, OpenAI error types and gRPC codes.

The Coordinator and the ingress raise `RequestError`; both protocol adapters translate it with
the same table, so a bad request gets the same meaning over HTTP and gRPC.
"""

import enum

import grpc

# Seconds a client should wait before retrying a 503 (HTTP `Retry-After`): a slot or queue
# place frees up within a few engine steps; a lost group is replaced within seconds, and
# requests sent while it is replaced wait for the new one.
RETRY_AFTER_S = 1


class ErrorKind(enum.Enum):
    # (HTTP status, OpenAI error type, gRPC status code)
    INVALID_ARGUMENT = (400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)
    NOT_FOUND = (404, "not_found_error", grpc.StatusCode.NOT_FOUND)
    METHOD_NOT_ALLOWED = (405, "invalid_request_error", grpc.StatusCode.UNIMPLEMENTED)
    OVERLOADED = (503, "overloaded_error", grpc.StatusCode.RESOURCE_EXHAUSTED)
    UNAVAILABLE = (503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE)  # retriable
    INTERNAL = (500, "internal_error", grpc.StatusCode.INTERNAL)

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def openai_type(self) -> str:
        return self.value[1]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[2]

    @property
    def http_headers(self) -> dict[str, str]:
        """Headers an HTTP answer of this kind carries: `Retry-After` on every 503."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.http_status == 503 else {}


class RequestError(Exception):
    """A request the server refuses; `param` names the offending field when there is one."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[type["RequestError"], tuple[ErrorKind, str, str | None]]:
        # Crosses Ray handles by pickling: keep the constructor arguments.
        return (type(self), (self.kind, self.message, self.param))

    def openai_body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI-compatible error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind.openai_type,
                "param": self.param,
                "code": str(self.kind.http_status),
            }
        }


def invalid(message: str, param: str | None = None) -> RequestError:
    return RequestError(ErrorKind.INVALID_ARGUMENT, message, param)


def as_request_error(error: BaseException) -> RequestError | None:
    """The `RequestError` behind `error`, unwrapping Ray's task-error wrapper; None otherwise."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        # Ray re-raises a remote error as a subclass of both RayTaskError and the cause's class
        # without the cause's attributes: only an instance that carries `kind` is the real one.
        if isinstance(current, RequestError) and "kind" in vars(current):
            return current
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return None
