"""The wire contract: gRPC messages and services (generated stubs), and the tensor codec."""

# Bumped on any incompatible change to multipod.proto or to what a field means. A worker refuses a
# controller or peer that speaks another version.
PROTOCOL_VERSION = 4

# gRPC message size limits, set on both ends. Gradient chunks are at most MAX_CHUNK_BYTES; control
# messages (config, batches, prompts) stay well under MAX_MESSAGE_BYTES.
MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options for servers and channels: the same message limits on both ends."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
