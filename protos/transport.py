"""How every gRPC channel and listening port is opened: controller->worker and worker<->worker
alike. One place, so message limits (and, later, credentials) are the same everywhere."""
from __future__ import annotations

import grpc

from protos import channel_options


def open_channel(address: str) -> grpc.Channel:
    """A channel to a worker's address with multipod's message limits."""
    return grpc.insecure_channel(address, options=channel_options())


def add_port(server: grpc.Server, address: str) -> int:
    """Listen on `address`; returns the bound port (0 if it could not bind)."""
    return server.add_insecure_port(address)
