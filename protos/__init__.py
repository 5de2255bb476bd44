"""The wire contract: gRPC messages and services (generated stubs), and the tensor codec."""

# Bumped on any incompatible change to multipod.proto or to what a field means. A worker refuses a
# controller or peer that speaks another version.
PROTOCOL_VERSION = 16

# gRPC message size limits, set on both ends. Gradient chunks are at most MAX_CHUNK_BYTES; control
# messages (config, batches, prompts) stay well under MAX_MESSAGE_BYTES.
MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20

# Keepalive: an idle channel (between runs, or during a long compile) pings its peer this often,
# so a dead peer or a middlebox that dropped the connection is noticed, and an idle connection is
# not dropped by one. The timeout is generous: a loaded 2-core host can be slow to answer a ping.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                    keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int | str]]:
    """gRPC options for servers and channels alike (one list, so both ends agree): the same
    message limits, keepalive pings, a server that accepts those pings, and a listening port that
    no second process can bind. Options of the other side are ignored by each side. The values
    are integers; a caller may add string-valued ones (a TLS name override)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # Ping idle channels too (no call in flight), without limit: the default stops after 2
        # pings without data, which would end keepalive on an idle channel.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Server side: accept pings at half the clients' interval. The default (5 min, or 2 h with
        # no call in flight) counts each keepalive ping as a strike and answers GOAWAY too_many_pings.
        ("grpc.http2.min_ping_interval_without_data_ms", max(1, keepalive_time_ms // 2)),
        # Server side: gRPC binds with SO_REUSEPORT by default on Linux, so a second worker on the
        # same port would start and silently take half the connections. Without it, it fails to bind.
        ("grpc.so_reuseport", 0),
    ]
