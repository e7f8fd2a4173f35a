from asymptote.contracts.v1 import rollout_pb2 as _rollout_pb2
from asymptote.contracts.v1 import tensors_pb2 as _tensors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("service", "instance_id", "ready", "detail", "policy_version", "gauges")
    class GaugesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GAUGES_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance_id: str
    ready: bool
    detail: str
    policy_version: int
    gauges: _containers.ScalarMap[str, float]
    def __init__(self, service: _Optional[str] = ..., instance_id: _Optional[str] = ..., ready: _Optional[bool] = ..., detail: _Optional[str] = ..., policy_version: _Optional[int] = ..., gauges: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "sampling")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    sampling: _rollout_pb2.SamplingParams
    def __init__(self, prompt: _Optional[str] = ..., sampling: _Optional[_Union[_rollout_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "policy_version", "prompt_token_ids")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.Completion]
    policy_version: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, completions: _Optional[_Iterable[_Union[_rollout_pb2.Completion, _Mapping]]] = ..., policy_version: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NextBatchRequest(_message.Message):
    __slots__ = ("learner_version", "num_groups", "timeout_s", "packed")
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    learner_version: int
    num_groups: int
    timeout_s: float
    packed: bool
    def __init__(self, learner_version: _Optional[int] = ..., num_groups: _Optional[int] = ..., timeout_s: _Optional[float] = ..., packed: _Optional[bool] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("batch_id", "num_groups", "num_zero_variance", "num_stale_dropped", "oldest_group_age_s", "keep_zero_variance", "num_completions", "num_interrupted", "num_truncated")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ZERO_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    NUM_STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_GROUP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_ZERO_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_INTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    num_groups: int
    num_zero_variance: int
    num_stale_dropped: int
    oldest_group_age_s: float
    keep_zero_variance: bool
    num_completions: int
    num_interrupted: int
    num_truncated: int
    def __init__(self, batch_id: _Optional[str] = ..., num_groups: _Optional[int] = ..., num_zero_variance: _Optional[int] = ..., num_stale_dropped: _Optional[int] = ..., oldest_group_age_s: _Optional[float] = ..., keep_zero_variance: _Optional[bool] = ..., num_completions: _Optional[int] = ..., num_interrupted: _Optional[int] = ..., num_truncated: _Optional[int] = ...) -> None: ...

class RolloutGroups(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.RolloutGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[_rollout_pb2.RolloutGroup, _Mapping]]] = ...) -> None: ...

class BatchPart(_message.Message):
    __slots__ = ("header", "group", "groups")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    header: BatchHeader
    group: _rollout_pb2.RolloutGroup
    groups: RolloutGroups
    def __init__(self, header: _Optional[_Union[BatchHeader, _Mapping]] = ..., group: _Optional[_Union[_rollout_pb2.RolloutGroup, _Mapping]] = ..., groups: _Optional[_Union[RolloutGroups, _Mapping]] = ...) -> None: ...

class AckedBatch(_message.Message):
    __slots__ = ("batch_id", "group_ids", "duplicate_group_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    duplicate_group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, batch_id: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ..., duplicate_group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("batch_ids", "release_unacked", "batches")
    BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_UNACKED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batch_ids: _containers.RepeatedScalarFieldContainer[str]
    release_unacked: bool
    batches: _containers.RepeatedCompositeFieldContainer[AckedBatch]
    def __init__(self, batch_ids: _Optional[_Iterable[str]] = ..., release_unacked: _Optional[bool] = ..., batches: _Optional[_Iterable[_Union[AckedBatch, _Mapping]]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("num_acked", "unknown_batch_ids")
    NUM_ACKED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    num_acked: int
    unknown_batch_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_acked: _Optional[int] = ..., unknown_batch_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PullWeightsRequest(_message.Message):
    __slots__ = ("version", "base_version", "base_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    base_digest: str
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., base_digest: _Optional[str] = ...) -> None: ...

class CurvePoint(_message.Message):
    __slots__ = ("compute", "pass_rate", "policy_version")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    compute: float
    pass_rate: float
    policy_version: int
    def __init__(self, compute: _Optional[float] = ..., pass_rate: _Optional[float] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Interval(_message.Message):
    __slots__ = ("low", "high")
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    low: float
    high: float
    def __init__(self, low: _Optional[float] = ..., high: _Optional[float] = ...) -> None: ...

class ProjectedValue(_message.Message):
    __slots__ = ("compute", "pass_rate", "interval")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    compute: float
    pass_rate: float
    interval: Interval
    def __init__(self, compute: _Optional[float] = ..., pass_rate: _Optional[float] = ..., interval: _Optional[_Union[Interval, _Mapping]] = ...) -> None: ...

class Projection(_message.Message):
    __slots__ = ("ok", "reason", "a", "b", "c_mid", "r0", "a_interval", "b_interval", "c_mid_interval", "num_points_used", "rmse", "projections", "fitted_unix_s", "at_bound", "identifiable", "recommendation", "recommendation_reason", "planned_compute", "determined", "why_not_determined", "not_determined", "compute_unit")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    C_MID_FIELD_NUMBER: _ClassVar[int]
    R0_FIELD_NUMBER: _ClassVar[int]
    A_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    B_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    C_MID_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    NUM_POINTS_USED_FIELD_NUMBER: _ClassVar[int]
    RMSE_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    FITTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    AT_BOUND_FIELD_NUMBER: _ClassVar[int]
    IDENTIFIABLE_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDATION_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDATION_REASON_FIELD_NUMBER: _ClassVar[int]
    PLANNED_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    DETERMINED_FIELD_NUMBER: _ClassVar[int]
    WHY_NOT_DETERMINED_FIELD_NUMBER: _ClassVar[int]
    NOT_DETERMINED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UNIT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    a: float
    b: float
    c_mid: float
    r0: float
    a_interval: Interval
    b_interval: Interval
    c_mid_interval: Interval
    num_points_used: int
    rmse: float
    projections: _containers.RepeatedCompositeFieldContainer[ProjectedValue]
    fitted_unix_s: float
    at_bound: _containers.RepeatedScalarFieldContainer[str]
    identifiable: bool
    recommendation: str
    recommendation_reason: str
    planned_compute: float
    determined: bool
    why_not_determined: str
    not_determined: _containers.RepeatedScalarFieldContainer[str]
    compute_unit: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., a: _Optional[float] = ..., b: _Optional[float] = ..., c_mid: _Optional[float] = ..., r0: _Optional[float] = ..., a_interval: _Optional[_Union[Interval, _Mapping]] = ..., b_interval: _Optional[_Union[Interval, _Mapping]] = ..., c_mid_interval: _Optional[_Union[Interval, _Mapping]] = ..., num_points_used: _Optional[int] = ..., rmse: _Optional[float] = ..., projections: _Optional[_Iterable[_Union[ProjectedValue, _Mapping]]] = ..., fitted_unix_s: _Optional[float] = ..., at_bound: _Optional[_Iterable[str]] = ..., identifiable: _Optional[bool] = ..., recommendation: _Optional[str] = ..., recommendation_reason: _Optional[str] = ..., planned_compute: _Optional[float] = ..., determined: _Optional[bool] = ..., why_not_determined: _Optional[str] = ..., not_determined: _Optional[_Iterable[str]] = ..., compute_unit: _Optional[str] = ...) -> None: ...

class SubmitPointsRequest(_message.Message):
    __slots__ = ("run", "points")
    RUN_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    run: str
    points: _containers.RepeatedCompositeFieldContainer[CurvePoint]
    def __init__(self, run: _Optional[str] = ..., points: _Optional[_Iterable[_Union[CurvePoint, _Mapping]]] = ...) -> None: ...

class GetProjectionRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...
