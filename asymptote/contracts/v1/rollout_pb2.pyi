from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_UNSPECIFIED: _ClassVar[TaskKind]
    TASK_KIND_TRAIN: _ClassVar[TaskKind]
    TASK_KIND_EVAL: _ClassVar[TaskKind]

class RoutingDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTING_DTYPE_UNSPECIFIED: _ClassVar[RoutingDtype]
    ROUTING_DTYPE_UINT8: _ClassVar[RoutingDtype]
    ROUTING_DTYPE_UINT16: _ClassVar[RoutingDtype]

class LedgerEvent(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEDGER_EVENT_UNSPECIFIED: _ClassVar[LedgerEvent]
    LEDGER_EVENT_ISSUED: _ClassVar[LedgerEvent]
    LEDGER_EVENT_TRAINED: _ClassVar[LedgerEvent]
    LEDGER_EVENT_FILTERED: _ClassVar[LedgerEvent]
    LEDGER_EVENT_DEADLETTERED: _ClassVar[LedgerEvent]
    LEDGER_EVENT_DUPLICATE: _ClassVar[LedgerEvent]
TASK_KIND_UNSPECIFIED: TaskKind
TASK_KIND_TRAIN: TaskKind
TASK_KIND_EVAL: TaskKind
ROUTING_DTYPE_UNSPECIFIED: RoutingDtype
ROUTING_DTYPE_UINT8: RoutingDtype
ROUTING_DTYPE_UINT16: RoutingDtype
LEDGER_EVENT_UNSPECIFIED: LedgerEvent
LEDGER_EVENT_ISSUED: LedgerEvent
LEDGER_EVENT_TRAINED: LedgerEvent
LEDGER_EVENT_FILTERED: LedgerEvent
LEDGER_EVENT_DEADLETTERED: LedgerEvent
LEDGER_EVENT_DUPLICATE: LedgerEvent

class SamplingParams(_message.Message):
    __slots__ = ("num_samples", "temperature", "top_p", "max_tokens", "seed")
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    num_samples: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    def __init__(self, num_samples: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerationTask(_message.Message):
    __slots__ = ("task_id", "kind", "task_name", "prompt_id", "prompt", "reference", "sampling", "issued_at_version", "issued_unix_s", "epoch", "eval_id", "eval_num_prompts", "require_version", "ledger_seq", "task_digest")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TASK_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    EVAL_NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SEQ_FIELD_NUMBER: _ClassVar[int]
    TASK_DIGEST_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    kind: TaskKind
    task_name: str
    prompt_id: str
    prompt: str
    reference: str
    sampling: SamplingParams
    issued_at_version: int
    issued_unix_s: float
    epoch: int
    eval_id: str
    eval_num_prompts: int
    require_version: int
    ledger_seq: int
    task_digest: str
    def __init__(self, task_id: _Optional[str] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., task_name: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt: _Optional[str] = ..., reference: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., issued_at_version: _Optional[int] = ..., issued_unix_s: _Optional[float] = ..., epoch: _Optional[int] = ..., eval_id: _Optional[str] = ..., eval_num_prompts: _Optional[int] = ..., require_version: _Optional[int] = ..., ledger_seq: _Optional[int] = ..., task_digest: _Optional[str] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "version_spans", "reward", "truncated", "finish_reason", "text", "loss_mask", "interrupted", "prompt_token_ids", "continues_episode", "routing", "prompt_routing")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_EPISODE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    reward: float
    truncated: bool
    finish_reason: str
    text: str
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    interrupted: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    continues_episode: bool
    routing: bytes
    prompt_routing: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., reward: _Optional[float] = ..., truncated: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., loss_mask: _Optional[_Iterable[int]] = ..., interrupted: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., continues_episode: _Optional[bool] = ..., routing: _Optional[bytes] = ..., prompt_routing: _Optional[bytes] = ...) -> None: ...

class RoutingLayout(_message.Message):
    __slots__ = ("num_moe_layers", "top_k", "num_experts", "dtype")
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_moe_layers: int
    top_k: int
    num_experts: int
    dtype: RoutingDtype
    def __init__(self, num_moe_layers: _Optional[int] = ..., top_k: _Optional[int] = ..., num_experts: _Optional[int] = ..., dtype: _Optional[_Union[RoutingDtype, str]] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("group_id", "task", "prompt_token_ids", "completions", "generator_id", "started_unix_s", "finished_unix_s", "min_version", "max_version", "routing", "prompt_routing")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTING_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    task: GenerationTask
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    generator_id: str
    started_unix_s: float
    finished_unix_s: float
    min_version: int
    max_version: int
    routing: RoutingLayout
    prompt_routing: bytes
    def __init__(self, group_id: _Optional[str] = ..., task: _Optional[_Union[GenerationTask, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., generator_id: _Optional[str] = ..., started_unix_s: _Optional[float] = ..., finished_unix_s: _Optional[float] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., routing: _Optional[_Union[RoutingLayout, _Mapping]] = ..., prompt_routing: _Optional[bytes] = ...) -> None: ...

class CompletionLogprobRuns(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, logprobs: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RolloutGroupLogprobRuns(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: CompletionLogprobRuns
    def __init__(self, completions: _Optional[_Union[CompletionLogprobRuns, _Mapping]] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("eval_id", "task_id", "prompt_id", "num_samples", "num_correct", "eval_version", "min_version", "max_version", "eval_num_prompts", "generator_id", "finished_unix_s", "num_tokens", "tokens_by_version", "task")
    class TokensByVersionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRECT_FIELD_NUMBER: _ClassVar[int]
    EVAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    eval_id: str
    task_id: str
    prompt_id: str
    num_samples: int
    num_correct: int
    eval_version: int
    min_version: int
    max_version: int
    eval_num_prompts: int
    generator_id: str
    finished_unix_s: float
    num_tokens: int
    tokens_by_version: _containers.ScalarMap[int, int]
    task: str
    def __init__(self, eval_id: _Optional[str] = ..., task_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., num_correct: _Optional[int] = ..., eval_version: _Optional[int] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., eval_num_prompts: _Optional[int] = ..., generator_id: _Optional[str] = ..., finished_unix_s: _Optional[float] = ..., num_tokens: _Optional[int] = ..., tokens_by_version: _Optional[_Mapping[int, int]] = ..., task: _Optional[str] = ...) -> None: ...

class PolicyVersion(_message.Message):
    __slots__ = ("version", "weights_endpoint", "digest", "num_bytes", "num_tensors", "published_unix_s", "samples_trained", "step", "final")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_endpoint: str
    digest: str
    num_bytes: int
    num_tensors: int
    published_unix_s: float
    samples_trained: int
    step: int
    final: bool
    def __init__(self, version: _Optional[int] = ..., weights_endpoint: _Optional[str] = ..., digest: _Optional[str] = ..., num_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., published_unix_s: _Optional[float] = ..., samples_trained: _Optional[int] = ..., step: _Optional[int] = ..., final: _Optional[bool] = ...) -> None: ...

class BestRound(_message.Message):
    __slots__ = ("policy_version", "pass_rate", "num_rounds", "published_unix_s")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    pass_rate: float
    num_rounds: int
    published_unix_s: float
    def __init__(self, policy_version: _Optional[int] = ..., pass_rate: _Optional[float] = ..., num_rounds: _Optional[int] = ..., published_unix_s: _Optional[float] = ...) -> None: ...

class ComputeTelemetry(_message.Message):
    __slots__ = ("service", "instance_id", "device_kind", "num_devices", "device_seconds_total", "busy_seconds_total", "unix_s", "policy_version", "num_tokens_total", "eval_device_seconds_total", "flops_total", "eval_flops_total", "num_params")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVAL_DEVICE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FLOPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVAL_FLOPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance_id: str
    device_kind: str
    num_devices: int
    device_seconds_total: float
    busy_seconds_total: float
    unix_s: float
    policy_version: int
    num_tokens_total: int
    eval_device_seconds_total: float
    flops_total: float
    eval_flops_total: float
    num_params: int
    def __init__(self, service: _Optional[str] = ..., instance_id: _Optional[str] = ..., device_kind: _Optional[str] = ..., num_devices: _Optional[int] = ..., device_seconds_total: _Optional[float] = ..., busy_seconds_total: _Optional[float] = ..., unix_s: _Optional[float] = ..., policy_version: _Optional[int] = ..., num_tokens_total: _Optional[int] = ..., eval_device_seconds_total: _Optional[float] = ..., flops_total: _Optional[float] = ..., eval_flops_total: _Optional[float] = ..., num_params: _Optional[int] = ...) -> None: ...

class CurriculumState(_message.Message):
    __slots__ = ("epoch", "cursor", "pass_rates", "num_issued", "seed", "last_eval_version", "eval_issued", "epoch_order", "ledger_seq", "sub_tasks")
    class PassRatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class SubTasksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CurriculumState
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CurriculumState, _Mapping]] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    PASS_RATES_FIELD_NUMBER: _ClassVar[int]
    NUM_ISSUED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_ISSUED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_ORDER_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SEQ_FIELD_NUMBER: _ClassVar[int]
    SUB_TASKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    cursor: int
    pass_rates: _containers.ScalarMap[str, float]
    num_issued: int
    seed: int
    last_eval_version: int
    eval_issued: bool
    epoch_order: _containers.RepeatedScalarFieldContainer[int]
    ledger_seq: int
    sub_tasks: _containers.MessageMap[str, CurriculumState]
    def __init__(self, epoch: _Optional[int] = ..., cursor: _Optional[int] = ..., pass_rates: _Optional[_Mapping[str, float]] = ..., num_issued: _Optional[int] = ..., seed: _Optional[int] = ..., last_eval_version: _Optional[int] = ..., eval_issued: _Optional[bool] = ..., epoch_order: _Optional[_Iterable[int]] = ..., ledger_seq: _Optional[int] = ..., sub_tasks: _Optional[_Mapping[str, CurriculumState]] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("task_id", "event", "reason", "policy_version", "batch_id", "unix_s", "service")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    event: LedgerEvent
    reason: str
    policy_version: int
    batch_id: str
    unix_s: float
    service: str
    def __init__(self, task_id: _Optional[str] = ..., event: _Optional[_Union[LedgerEvent, str]] = ..., reason: _Optional[str] = ..., policy_version: _Optional[int] = ..., batch_id: _Optional[str] = ..., unix_s: _Optional[float] = ..., service: _Optional[str] = ...) -> None: ...

class LedgerBatch(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ...) -> None: ...
