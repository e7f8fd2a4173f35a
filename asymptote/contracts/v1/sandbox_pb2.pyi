from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SandboxLimits(_message.Message):
    __slots__ = ("timeout_s", "memory_mib", "num_processes", "file_size_mib", "open_files", "output_bytes")
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_MIB_FIELD_NUMBER: _ClassVar[int]
    OPEN_FILES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    memory_mib: int
    num_processes: int
    file_size_mib: int
    open_files: int
    output_bytes: int
    def __init__(self, timeout_s: _Optional[float] = ..., memory_mib: _Optional[int] = ..., num_processes: _Optional[int] = ..., file_size_mib: _Optional[int] = ..., open_files: _Optional[int] = ..., output_bytes: _Optional[int] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("program", "stdin", "limits")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    program: str
    stdin: bytes
    limits: SandboxLimits
    def __init__(self, program: _Optional[str] = ..., stdin: _Optional[bytes] = ..., limits: _Optional[_Union[SandboxLimits, _Mapping]] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("backend", "exit_code", "signal", "killed", "stdout", "stderr", "stdout_bytes", "time_s")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    KILLED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    backend: str
    exit_code: int
    signal: int
    killed: str
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    time_s: float
    def __init__(self, backend: _Optional[str] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., killed: _Optional[str] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stdout_bytes: _Optional[int] = ..., time_s: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SandboxPoolInfo(_message.Message):
    __slots__ = ("backend", "default_limits", "max_limits", "max_program_bytes", "max_stdin_bytes", "max_concurrent_runs", "max_queued_runs", "num_runs", "max_runs")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MAX_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROGRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STDIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_RUNS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_RUNS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    default_limits: SandboxLimits
    max_limits: SandboxLimits
    max_program_bytes: int
    max_stdin_bytes: int
    max_concurrent_runs: int
    max_queued_runs: int
    num_runs: int
    max_runs: int
    def __init__(self, backend: _Optional[str] = ..., default_limits: _Optional[_Union[SandboxLimits, _Mapping]] = ..., max_limits: _Optional[_Union[SandboxLimits, _Mapping]] = ..., max_program_bytes: _Optional[int] = ..., max_stdin_bytes: _Optional[int] = ..., max_concurrent_runs: _Optional[int] = ..., max_queued_runs: _Optional[int] = ..., num_runs: _Optional[int] = ..., max_runs: _Optional[int] = ...) -> None: ...
