from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PartState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PART_STATE_UNSPECIFIED: _ClassVar[PartState]
    PART_STATE_MISSING: _ClassVar[PartState]
    PART_STATE_UNFINISHED: _ClassVar[PartState]
    PART_STATE_UNREADABLE: _ClassVar[PartState]
    PART_STATE_CORRUPT: _ClassVar[PartState]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_IDLE: _ClassVar[WorkerState]
    WORKER_STATE_CONFIGURING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_STEPPING: _ClassVar[WorkerState]
    WORKER_STATE_RESTORING: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
PART_STATE_UNSPECIFIED: PartState
PART_STATE_MISSING: PartState
PART_STATE_UNFINISHED: PartState
PART_STATE_UNREADABLE: PartState
PART_STATE_CORRUPT: PartState
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_IDLE: WorkerState
WORKER_STATE_CONFIGURING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_STEPPING: WorkerState
WORKER_STATE_RESTORING: WorkerState
WORKER_STATE_FAILED: WorkerState

class ConfigureRequest(_message.Message):
    __slots__ = ("protocol_version", "pod_index", "num_pods", "peer_addresses", "worker_config_json", "run_id", "dcn_addresses", "keep_state", "host_index", "hosts_per_pod", "standby", "evaluates", "generation_only", "awaits_state")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PODS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    WORKER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DCN_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    KEEP_STATE_FIELD_NUMBER: _ClassVar[int]
    HOST_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOSTS_PER_POD_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    EVALUATES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ONLY_FIELD_NUMBER: _ClassVar[int]
    AWAITS_STATE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    pod_index: int
    num_pods: int
    peer_addresses: _containers.RepeatedScalarFieldContainer[str]
    worker_config_json: str
    run_id: str
    dcn_addresses: _containers.RepeatedScalarFieldContainer[str]
    keep_state: bool
    host_index: int
    hosts_per_pod: int
    standby: bool
    evaluates: bool
    generation_only: bool
    awaits_state: bool
    def __init__(self, protocol_version: _Optional[int] = ..., pod_index: _Optional[int] = ..., num_pods: _Optional[int] = ..., peer_addresses: _Optional[_Iterable[str]] = ..., worker_config_json: _Optional[str] = ..., run_id: _Optional[str] = ..., dcn_addresses: _Optional[_Iterable[str]] = ..., keep_state: _Optional[bool] = ..., host_index: _Optional[int] = ..., hosts_per_pod: _Optional[int] = ..., standby: _Optional[bool] = ..., evaluates: _Optional[bool] = ..., generation_only: _Optional[bool] = ..., awaits_state: _Optional[bool] = ...) -> None: ...

class ConfigureReply(_message.Message):
    __slots__ = ("protocol_version", "pod_index", "mesh_shape", "num_devices", "config_hash", "fingerprint", "param_count", "device_kind", "step", "hardware_flops_per_step", "memory_argument_bytes", "memory_output_bytes", "memory_temp_bytes", "memory_peak_bytes", "base_fingerprint")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_INDEX_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARAM_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FLOPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ARGUMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TEMP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    pod_index: int
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    num_devices: int
    config_hash: str
    fingerprint: str
    param_count: int
    device_kind: str
    step: int
    hardware_flops_per_step: float
    memory_argument_bytes: int
    memory_output_bytes: int
    memory_temp_bytes: int
    memory_peak_bytes: int
    base_fingerprint: str
    def __init__(self, protocol_version: _Optional[int] = ..., pod_index: _Optional[int] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., num_devices: _Optional[int] = ..., config_hash: _Optional[str] = ..., fingerprint: _Optional[str] = ..., param_count: _Optional[int] = ..., device_kind: _Optional[str] = ..., step: _Optional[int] = ..., hardware_flops_per_step: _Optional[float] = ..., memory_argument_bytes: _Optional[int] = ..., memory_output_bytes: _Optional[int] = ..., memory_temp_bytes: _Optional[int] = ..., memory_peak_bytes: _Optional[int] = ..., base_fingerprint: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step", "tokens", "global_tokens", "take_fingerprint", "extra_shards", "loss_mask", "run_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAKE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    tokens: bytes
    global_tokens: int
    take_fingerprint: bool
    extra_shards: _containers.RepeatedCompositeFieldContainer[Shard]
    loss_mask: bytes
    run_id: str
    def __init__(self, step: _Optional[int] = ..., tokens: _Optional[bytes] = ..., global_tokens: _Optional[int] = ..., take_fingerprint: _Optional[bool] = ..., extra_shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ..., loss_mask: _Optional[bytes] = ..., run_id: _Optional[str] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("slot", "tokens", "loss_mask", "microbatch_hosts")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_HOSTS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    tokens: bytes
    loss_mask: bytes
    microbatch_hosts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[int] = ..., tokens: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., microbatch_hosts: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardResult(_message.Message):
    __slots__ = ("slot", "loss_sum", "z_loss_sum", "tokens")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    Z_LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    loss_sum: float
    z_loss_sum: float
    tokens: int
    def __init__(self, slot: _Optional[int] = ..., loss_sum: _Optional[float] = ..., z_loss_sum: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("wait_s", "compute_s", "exchange_s", "update_s", "checksum_s", "idle_s", "exposed_exchange_s", "fingerprint_s", "peer_wait_s", "wire_wait_s")
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_S_FIELD_NUMBER: _ClassVar[int]
    UPDATE_S_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_EXCHANGE_S_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_S_FIELD_NUMBER: _ClassVar[int]
    PEER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WIRE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    compute_s: float
    exchange_s: float
    update_s: float
    checksum_s: float
    idle_s: float
    exposed_exchange_s: float
    fingerprint_s: float
    peer_wait_s: float
    wire_wait_s: float
    def __init__(self, wait_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., exchange_s: _Optional[float] = ..., update_s: _Optional[float] = ..., checksum_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., exposed_exchange_s: _Optional[float] = ..., fingerprint_s: _Optional[float] = ..., peer_wait_s: _Optional[float] = ..., wire_wait_s: _Optional[float] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step", "pod_index", "loss_sum", "z_loss_sum", "tokens", "grad_norm", "learning_rate", "skipped", "checksum", "timings", "dcn_bytes_sent", "dcn_bytes_received", "fingerprint", "shards", "outer", "dcn_packed")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POD_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    Z_LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DCN_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DCN_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    DCN_PACKED_FIELD_NUMBER: _ClassVar[int]
    step: int
    pod_index: int
    loss_sum: float
    z_loss_sum: float
    tokens: int
    grad_norm: float
    learning_rate: float
    skipped: bool
    checksum: str
    timings: StepTimings
    dcn_bytes_sent: int
    dcn_bytes_received: int
    fingerprint: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardResult]
    outer: OuterStep
    dcn_packed: bool
    def __init__(self, step: _Optional[int] = ..., pod_index: _Optional[int] = ..., loss_sum: _Optional[float] = ..., z_loss_sum: _Optional[float] = ..., tokens: _Optional[int] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ..., skipped: _Optional[bool] = ..., checksum: _Optional[str] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., dcn_bytes_sent: _Optional[int] = ..., dcn_bytes_received: _Optional[int] = ..., fingerprint: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardResult, _Mapping]]] = ..., outer: _Optional[_Union[OuterStep, _Mapping]] = ..., dcn_packed: _Optional[bool] = ...) -> None: ...

class OuterStep(_message.Message):
    __slots__ = ("sync", "fragment", "started_step", "seconds", "exposed_s", "pods")
    SYNC_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    STARTED_STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    sync: int
    fragment: int
    started_step: int
    seconds: float
    exposed_s: float
    pods: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sync: _Optional[int] = ..., fragment: _Optional[int] = ..., started_step: _Optional[int] = ..., seconds: _Optional[float] = ..., exposed_s: _Optional[float] = ..., pods: _Optional[_Iterable[int]] = ...) -> None: ...

class MembershipRequest(_message.Message):
    __slots__ = ("run_id", "hosts", "num_pods", "dcn_addresses")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PODS_FIELD_NUMBER: _ClassVar[int]
    DCN_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    hosts: _containers.RepeatedScalarFieldContainer[int]
    num_pods: int
    dcn_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., hosts: _Optional[_Iterable[int]] = ..., num_pods: _Optional[int] = ..., dcn_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class MembershipReply(_message.Message):
    __slots__ = ("step", "checksum", "fingerprint", "config_hash", "aborted_step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    ABORTED_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    checksum: str
    fingerprint: str
    config_hash: str
    aborted_step: bool
    def __init__(self, step: _Optional[int] = ..., checksum: _Optional[str] = ..., fingerprint: _Optional[str] = ..., config_hash: _Optional[str] = ..., aborted_step: _Optional[bool] = ...) -> None: ...

class AdoptSlotRequest(_message.Message):
    __slots__ = ("slot", "checkpoint_path", "tokens")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    checkpoint_path: str
    tokens: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, slot: _Optional[int] = ..., checkpoint_path: _Optional[str] = ..., tokens: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AdoptSlotReply(_message.Message):
    __slots__ = ("step", "fingerprint")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    step: int
    fingerprint: str
    def __init__(self, step: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class SendStateRequest(_message.Message):
    __slots__ = ("transfer_id", "to_pod", "to_address")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TO_POD_FIELD_NUMBER: _ClassVar[int]
    TO_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    to_pod: int
    to_address: str
    def __init__(self, transfer_id: _Optional[str] = ..., to_pod: _Optional[int] = ..., to_address: _Optional[str] = ...) -> None: ...

class ReceiveStateRequest(_message.Message):
    __slots__ = ("transfer_id", "from_pod")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_POD_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    from_pod: int
    def __init__(self, transfer_id: _Optional[str] = ..., from_pod: _Optional[int] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("step", "fingerprint", "bytes", "seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    fingerprint: str
    bytes: int
    seconds: float
    def __init__(self, step: _Optional[int] = ..., fingerprint: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("step", "directory", "metadata_json", "background", "keep", "slot")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    step: int
    directory: str
    metadata_json: str
    background: bool
    keep: int
    slot: int
    def __init__(self, step: _Optional[int] = ..., directory: _Optional[str] = ..., metadata_json: _Optional[str] = ..., background: _Optional[bool] = ..., keep: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class WaitSaveRequest(_message.Message):
    __slots__ = ("step", "directory")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    step: int
    directory: str
    def __init__(self, step: _Optional[int] = ..., directory: _Optional[str] = ...) -> None: ...

class SaveReply(_message.Message):
    __slots__ = ("path", "fingerprint", "pending")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    path: str
    fingerprint: str
    pending: bool
    def __init__(self, path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., pending: _Optional[bool] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("path", "directory", "run_id", "parts", "before_step", "warm_start_directory", "warm_start", "diloco_directories")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    BEFORE_STEP_FIELD_NUMBER: _ClassVar[int]
    WARM_START_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    WARM_START_FIELD_NUMBER: _ClassVar[int]
    DILOCO_DIRECTORIES_FIELD_NUMBER: _ClassVar[int]
    path: str
    directory: str
    run_id: str
    parts: _containers.RepeatedScalarFieldContainer[str]
    before_step: int
    warm_start_directory: str
    warm_start: bool
    diloco_directories: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., directory: _Optional[str] = ..., run_id: _Optional[str] = ..., parts: _Optional[_Iterable[str]] = ..., before_step: _Optional[int] = ..., warm_start_directory: _Optional[str] = ..., warm_start: _Optional[bool] = ..., diloco_directories: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("step", "fingerprint", "metadata_json", "path", "skipped", "warm_start")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    WARM_START_FIELD_NUMBER: _ClassVar[int]
    step: int
    fingerprint: str
    metadata_json: str
    path: str
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedCheckpoint]
    warm_start: bool
    def __init__(self, step: _Optional[int] = ..., fingerprint: _Optional[str] = ..., metadata_json: _Optional[str] = ..., path: _Optional[str] = ..., skipped: _Optional[_Iterable[_Union[SkippedCheckpoint, _Mapping]]] = ..., warm_start: _Optional[bool] = ...) -> None: ...

class SkippedCheckpoint(_message.Message):
    __slots__ = ("step", "problems")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    step: int
    problems: _containers.RepeatedCompositeFieldContainer[PartProblem]
    def __init__(self, step: _Optional[int] = ..., problems: _Optional[_Iterable[_Union[PartProblem, _Mapping]]] = ...) -> None: ...

class PartProblem(_message.Message):
    __slots__ = ("directory", "state", "detail")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    directory: str
    state: PartState
    detail: str
    def __init__(self, directory: _Optional[str] = ..., state: _Optional[_Union[PartState, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("tokens", "loss_mask")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    loss_mask: bytes
    def __init__(self, tokens: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ...) -> None: ...

class EvaluateReply(_message.Message):
    __slots__ = ("loss_sum", "tokens")
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    loss_sum: float
    tokens: int
    def __init__(self, loss_sum: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "num_tokens", "temperature", "seed", "prompts", "top_k", "top_p", "eos_id", "shift_context")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    SHIFT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    prompt: bytes
    num_tokens: int
    temperature: float
    seed: int
    prompts: _containers.RepeatedScalarFieldContainer[bytes]
    top_k: int
    top_p: float
    eos_id: int
    shift_context: bool
    def __init__(self, prompt: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., prompts: _Optional[_Iterable[bytes]] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., eos_id: _Optional[int] = ..., shift_context: _Optional[bool] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("tokens", "lengths")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[bytes] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("index", "rows", "tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    rows: _containers.RepeatedScalarFieldContainer[int]
    tokens: bytes
    def __init__(self, index: _Optional[int] = ..., rows: _Optional[_Iterable[int]] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("protocol_version", "pod_index", "configured", "step", "num_devices", "state", "pid", "dcn_address", "config_hash", "checksum", "run_id", "host_index", "hosts_per_pod", "pod_coordinator", "local_devices", "spare")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DCN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOSTS_PER_POD_FIELD_NUMBER: _ClassVar[int]
    POD_COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DEVICES_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    pod_index: int
    configured: bool
    step: int
    num_devices: int
    state: WorkerState
    pid: int
    dcn_address: str
    config_hash: str
    checksum: str
    run_id: str
    host_index: int
    hosts_per_pod: int
    pod_coordinator: str
    local_devices: int
    spare: bool
    def __init__(self, protocol_version: _Optional[int] = ..., pod_index: _Optional[int] = ..., configured: _Optional[bool] = ..., step: _Optional[int] = ..., num_devices: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., pid: _Optional[int] = ..., dcn_address: _Optional[str] = ..., config_hash: _Optional[str] = ..., checksum: _Optional[str] = ..., run_id: _Optional[str] = ..., host_index: _Optional[int] = ..., hosts_per_pod: _Optional[int] = ..., pod_coordinator: _Optional[str] = ..., local_devices: _Optional[int] = ..., spare: _Optional[bool] = ...) -> None: ...

class ProbeLinkRequest(_message.Message):
    __slots__ = ("protocol_version", "run_id", "pod_index", "dcn_addresses", "bytes", "streams", "chunk_bytes", "rounds", "compression", "prepare", "measure_encryption", "encryption_seconds")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POD_INDEX_FIELD_NUMBER: _ClassVar[int]
    DCN_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    MEASURE_ENCRYPTION_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    pod_index: int
    dcn_addresses: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    streams: int
    chunk_bytes: int
    rounds: int
    compression: str
    prepare: bool
    measure_encryption: bool
    encryption_seconds: float
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., pod_index: _Optional[int] = ..., dcn_addresses: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., streams: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., rounds: _Optional[int] = ..., compression: _Optional[str] = ..., prepare: _Optional[bool] = ..., measure_encryption: _Optional[bool] = ..., encryption_seconds: _Optional[float] = ...) -> None: ...

class ProbeLinkReply(_message.Message):
    __slots__ = ("seconds", "bytes_sent", "encrypted", "curve_bytes_per_s", "plain_bytes_per_s")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    CURVE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PLAIN_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    bytes_sent: int
    encrypted: bool
    curve_bytes_per_s: float
    plain_bytes_per_s: float
    def __init__(self, seconds: _Optional[_Iterable[float]] = ..., bytes_sent: _Optional[int] = ..., encrypted: _Optional[bool] = ..., curve_bytes_per_s: _Optional[float] = ..., plain_bytes_per_s: _Optional[float] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
