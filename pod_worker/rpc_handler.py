"""The frame every PodWorker handler (server.py and its mixins) runs in: each failure becomes a gRPC
status code (handler, stream_handler; RequestError for the adapter's own refusals, the pod's typed
errors of pod_worker/errors.py mapped one to one), so a bad request never takes the server down;
and the worker's own waits are cut to end a little before the RPC's deadline (wait_budget,
deadline), so DEADLINE_EXCEEDED only ever means that the caller's deadline passed."""
from __future__ import annotations

import logging
import time

import grpc

from multipod.model import ConfigError
from multipod.pod_worker import errors
from multipod.pod_worker.checkpoint import CheckpointError
from multipod.pod_worker.dcn import ExchangeError
from multipod.pod_worker.dcn.transfer import TransferError
from multipod.protos import codec
from multipod.protos.channels import MalformedMessage

log = logging.getLogger(__name__)

# How long a request waits for the pod when its RPC carries no deadline (the controller always sets one).
DEFAULT_WAIT_S = 120.0
# The worker's own waits end this much before the RPC's deadline (at most a tenth of it), so that
# its typed answer reaches the caller before the caller's deadline does.
ANSWER_MARGIN_S = 0.5


class RequestError(Exception):
    """A request the adapter refuses; carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


# The pod's typed refusals (pod_worker/errors.py) -> status codes; first match wins.
_POD_ERROR_CODES = (
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotReady, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.StepAborted, grpc.StatusCode.ABORTED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.CorruptCheckpoint, grpc.StatusCode.DATA_LOSS),
    (errors.SaveNotFound, grpc.StatusCode.NOT_FOUND),
)


def _code_of(exc: errors.PodError) -> grpc.StatusCode:
    for kind, code in _POD_ERROR_CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def handler(method):
    """Run a servicer method, turning every failure into a gRPC error (never a dead server)."""
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except RequestError as exc:
            context.abort(exc.code, str(exc))
        except errors.PodError as exc:
            context.abort(_code_of(exc), str(exc))
        except (ConfigError, codec.CodecError, MalformedMessage) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CheckpointError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ExchangeError, TransferError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:  # a bug or a resource error: report it, keep serving
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


_END = object()


def stream_handler(method):
    """handler for a server-streaming method: a failure before or between the messages becomes a
    gRPC error (never a dead server)."""
    def advance(self, stream, context):
        return next(stream, _END)
    advance.__name__ = method.__name__      # named in the log if it fails
    advance = handler(advance)

    def wrapper(self, request, context):
        stream = method(self, request, context)      # a generator: nothing has run yet
        try:
            while (message := advance(self, stream, context)) is not _END:
                yield message
        finally:
            stream.close()
    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def wait_budget(context, default_s: float = DEFAULT_WAIT_S) -> float:
    """Seconds the worker's own waits may take for this RPC: its time left, minus the margin."""
    remaining = context.time_remaining()
    remaining = default_s if remaining is None else max(0.0, remaining)
    return remaining - min(ANSWER_MARGIN_S, remaining / 10)


def deadline(context) -> float:
    """wait_budget as a time.monotonic() deadline."""
    return time.monotonic() + wait_budget(context)
