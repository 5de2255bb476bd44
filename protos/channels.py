"""How every gRPC channel and listening port is opened (controller -> worker; the workers' data
plane is pod_worker/dcn/transport.py). One place, so message limits, keepalive, authentication and
TLS are the same everywhere.

Security model (docs/reliability.md):
  * a shared secret (`--auth-token` or MULTIPOD_AUTH_TOKEN) travels in the `x-multipod-token`
    metadata of every call; a server interceptor compares it in constant time (hmac.compare_digest)
    and refuses a missing or wrong token with UNAUTHENTICATED. The standard health service stays
    open (it only says SERVING or not), so a supervisor or load balancer can probe a worker
    without the secret. The data plane (pod_worker/dcn/) proves the same secret without sending
    it: an HMAC challenge-response on every connection.
  * TLS is configured from PEM files, for links that leave the machine: a server serves its
    `tls_cert`/`tls_key`; a client checks servers against `tls_ca` (or the system roots) and
    presents its own certificate if it has one. A server given `tls_ca` requires client
    certificates signed by it (mutual TLS).
  * a request that cannot even be parsed is refused with INVALID_ARGUMENT before any handler runs.

A process has one default Security (set_default_security), which open_channel and add_port use
when none is passed: a worker's DCN links then carry the same credentials as its server.
"""
from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import os
import pathlib

import grpc

from multipod.protos import channel_options

TOKEN_HEADER = "x-multipod-token"
TOKEN_ENV = "MULTIPOD_AUTH_TOKEN"
MIN_TOKEN_CHARS = 16
# Services reachable without the token: only the standard health check.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


class SecurityError(ValueError):
    """Security settings that cannot work (missing files, a too-short token, ...)."""


class MalformedMessage(ValueError):
    """A request message that does not parse as the method's protobuf type."""


@dataclasses.dataclass(frozen=True)
class Security:
    """The shared secret and optional TLS files of one process (client and server side alike)."""
    token: str = ""               # "" = no authentication (only for trusted, single-machine tests)
    tls_cert: str = ""            # PEM certificate chain of this process (server and, with a CA, client)
    tls_key: str = ""             # PEM private key for tls_cert
    tls_ca: str = ""              # PEM CA: with it, peers must present a certificate it signed
    tls_server_name: str = ""     # expected name in the server's certificate (default: the host)

    def validate(self) -> Security:
        if self.token and len(self.token) < MIN_TOKEN_CHARS:
            raise SecurityError(f"--auth-token must be at least {MIN_TOKEN_CHARS} characters")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityError("--tls-cert and --tls-key must be given together")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path and not pathlib.Path(path).is_file():
                raise SecurityError(f"{flag}: no such file {path!r}")
        return self

    @property
    def tls(self) -> bool:
        """Whether channels use TLS (a client may have only a CA to check servers against)."""
        return bool(self.tls_cert or self.tls_ca)

    @classmethod
    def from_args(cls, token: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                  tls_ca: str | None = None, tls_server_name: str | None = None) -> Security:
        """From CLI values; the token falls back to $MULTIPOD_AUTH_TOKEN."""
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        return cls(token=token.strip(), tls_cert=tls_cert or "", tls_key=tls_key or "", tls_ca=tls_ca or "",
                   tls_server_name=tls_server_name or "").validate()


_default = Security()


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT (or HOST) only listens on this machine's loopback interface."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False    # a name: it may resolve to anything


def set_default_security(security: Security) -> None:
    """The credentials open_channel/add_port use when given none (set once at process start)."""
    global _default
    _default = security.validate()


def default_security() -> Security:
    return _default


def _read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()


# -- client side ---------------------------------------------------------------------------------
class _TokenAuth(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._metadata = ((TOKEN_HEADER, token),)

    def __call__(self, context, callback):
        callback(self._metadata, None)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor,
                        grpc.UnaryStreamClientInterceptor):
    """Adds the token to every call of an insecure channel (call credentials need TLS), streamed
    replies (GenerateStream) included."""

    def __init__(self, token: str):
        self._token = token

    def _with_token(self, details):
        metadata = list(details.metadata or []) + [(TOKEN_HEADER, self._token)]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def open_channel(address: str, security: Security | None = None) -> grpc.Channel:
    """A channel to a worker's address with multipod's message limits and credentials."""
    security = security or _default
    options = channel_options()
    if security.tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(security.tls_ca) if security.tls_ca else None,
            private_key=_read(security.tls_key) if security.tls_key else None,
            certificate_chain=_read(security.tls_cert) if security.tls_cert else None)
        if security.token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.metadata_call_credentials(_TokenAuth(security.token)))
        if security.tls_server_name:
            options.append(("grpc.ssl_target_name_override", security.tls_server_name))
        return grpc.secure_channel(address, credentials, options=options)
    channel = grpc.insecure_channel(address, options=options)
    if security.token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(security.token))
    return channel


# -- server side ---------------------------------------------------------------------------------
class _Refuse:
    """A handler that refuses every call with one status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code, self.message = code, message

    def unary(self, request, context):
        context.abort(self.code, self.message)

    def stream(self, request_iterator, context):
        context.abort(self.code, self.message)


_BAD = object()   # what the safe deserializer returns for bytes that do not parse


def _safe_deserializer(deserialize):
    def parse(data: bytes):
        try:
            message = deserialize(data)
        except Exception:   # protobuf raises DecodeError and others on garbage
            return _BAD
        return message
    return parse


def _checked_stream(iterator, method: str):
    for message in iterator:
        if message is _BAD:
            raise MalformedMessage(f"a message of the {method} stream does not parse")
        yield message


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the right token (UNAUTHENTICATED) and requests that do not parse
    (INVALID_ARGUMENT), before the servicer sees them."""

    def __init__(self, token: str):
        self._token = token.encode()

    def _authorised(self, details) -> bool:
        if not self._token:
            return True
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._token)
        return False

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        method = details.method
        if not self._authorised(details):
            refuse = _Refuse(grpc.StatusCode.UNAUTHENTICATED,
                             f"{method}: missing or wrong auth token (header {TOKEN_HEADER})")
            if handler.request_streaming:
                return grpc.stream_unary_rpc_method_handler(refuse.stream)
            return grpc.unary_unary_rpc_method_handler(refuse.unary)
        if handler.response_streaming:      # multipod has no response streams; leave them alone
            return handler
        parse = _safe_deserializer(handler.request_deserializer)
        if handler.request_streaming:
            behaviour = handler.stream_unary

            def stream_unary(request_iterator, context):
                return behaviour(_checked_stream(request_iterator, method), context)
            return grpc.stream_unary_rpc_method_handler(stream_unary, parse, handler.response_serializer)
        behaviour = handler.unary_unary

        def unary_unary(request, context):
            if request is _BAD:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse")
            return behaviour(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, handler.response_serializer)


def server_interceptors(security: Security | None = None) -> list[grpc.ServerInterceptor]:
    """Interceptors every multipod server installs (token check, parse check)."""
    security = security or _default
    return [AuthInterceptor(security.token)]


def add_port(server: grpc.Server, address: str, security: Security | None = None) -> int:
    """Listen on `address` (TLS if configured); returns the bound port (0 if it could not bind)."""
    security = security or _default
    if security.tls_ca and not security.tls_cert:
        raise SecurityError("a server with --tls-ca also needs --tls-cert and --tls-key")
    if security.tls_cert:
        # With a CA, clients must present a certificate it signed (mutual TLS).
        credentials = grpc.ssl_server_credentials(
            [(_read(security.tls_key), _read(security.tls_cert))],
            root_certificates=_read(security.tls_ca) if security.tls_ca else None,
            require_client_auth=bool(security.tls_ca))
    # grpcio raises RuntimeError when nothing could be bound (the port is taken: servers bind
    # without SO_REUSEPORT, see channel_options); callers expect 0 and name the address.
    try:
        if security.tls_cert:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:
        return 0
