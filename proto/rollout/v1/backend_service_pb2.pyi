import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BackendKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_KIND_UNSPECIFIED: _ClassVar[BackendKind]
    BACKEND_KIND_HTTP: _ClassVar[BackendKind]
    BACKEND_KIND_IN_PROCESS: _ClassVar[BackendKind]
    BACKEND_KIND_MANAGED_VLLM: _ClassVar[BackendKind]
    BACKEND_KIND_SCRIPTED: _ClassVar[BackendKind]

class HttpProtocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HTTP_PROTOCOL_UNSPECIFIED: _ClassVar[HttpProtocol]
    HTTP_PROTOCOL_GENERATE: _ClassVar[HttpProtocol]
    HTTP_PROTOCOL_COMPLETIONS: _ClassVar[HttpProtocol]
BACKEND_KIND_UNSPECIFIED: BackendKind
BACKEND_KIND_HTTP: BackendKind
BACKEND_KIND_IN_PROCESS: BackendKind
BACKEND_KIND_MANAGED_VLLM: BackendKind
BACKEND_KIND_SCRIPTED: BackendKind
HTTP_PROTOCOL_UNSPECIFIED: HttpProtocol
HTTP_PROTOCOL_GENERATE: HttpProtocol
HTTP_PROTOCOL_COMPLETIONS: HttpProtocol

class Backend(_message.Message):
    __slots__ = ("name", "kind", "address", "model", "weight", "state", "in_flight", "policy_version", "served_turns", "failures", "last_error", "sessions", "add_time")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Backend.State]
        STATE_HEALTHY: _ClassVar[Backend.State]
        STATE_EJECTED: _ClassVar[Backend.State]
        STATE_DRAINING: _ClassVar[Backend.State]
    STATE_UNSPECIFIED: Backend.State
    STATE_HEALTHY: Backend.State
    STATE_EJECTED: Backend.State
    STATE_DRAINING: Backend.State
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_TURNS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ADD_TIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: BackendKind
    address: str
    model: str
    weight: float
    state: Backend.State
    in_flight: int
    policy_version: int
    served_turns: int
    failures: int
    last_error: str
    sessions: int
    add_time: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[BackendKind, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., weight: _Optional[float] = ..., state: _Optional[_Union[Backend.State, str]] = ..., in_flight: _Optional[int] = ..., policy_version: _Optional[int] = ..., served_turns: _Optional[int] = ..., failures: _Optional[int] = ..., last_error: _Optional[str] = ..., sessions: _Optional[int] = ..., add_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class HttpBackendSource(_message.Message):
    __slots__ = ("url", "model", "protocol", "policy_version")
    URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    url: str
    model: str
    protocol: HttpProtocol
    policy_version: int
    def __init__(self, url: _Optional[str] = ..., model: _Optional[str] = ..., protocol: _Optional[_Union[HttpProtocol, str]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class InProcessBackendSource(_message.Message):
    __slots__ = ("model_path", "device")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    device: str
    def __init__(self, model_path: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class ManagedVllmBackendSource(_message.Message):
    __slots__ = ("model", "port", "extra_args", "startup_timeout")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_ARGS_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    model: str
    port: int
    extra_args: _containers.RepeatedScalarFieldContainer[str]
    startup_timeout: _duration_pb2.Duration
    def __init__(self, model: _Optional[str] = ..., port: _Optional[int] = ..., extra_args: _Optional[_Iterable[str]] = ..., startup_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class AddBackendRequest(_message.Message):
    __slots__ = ("name", "weight", "http", "in_process", "managed_vllm")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    IN_PROCESS_FIELD_NUMBER: _ClassVar[int]
    MANAGED_VLLM_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    http: HttpBackendSource
    in_process: InProcessBackendSource
    managed_vllm: ManagedVllmBackendSource
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., http: _Optional[_Union[HttpBackendSource, _Mapping]] = ..., in_process: _Optional[_Union[InProcessBackendSource, _Mapping]] = ..., managed_vllm: _Optional[_Union[ManagedVllmBackendSource, _Mapping]] = ...) -> None: ...

class AddBackendResponse(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    def __init__(self, backend: _Optional[_Union[Backend, _Mapping]] = ...) -> None: ...

class RemoveBackendRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveBackendResponse(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    def __init__(self, backend: _Optional[_Union[Backend, _Mapping]] = ...) -> None: ...

class ListBackendsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("backends", "next_page_token")
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    next_page_token: str
    def __init__(self, backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("checkpoint_path", "policy_version", "backend_names")
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NAMES_FIELD_NUMBER: _ClassVar[int]
    checkpoint_path: str
    policy_version: int
    backend_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, checkpoint_path: _Optional[str] = ..., policy_version: _Optional[int] = ..., backend_names: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("backends", "duration")
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    duration: _duration_pb2.Duration
    def __init__(self, backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class SetPolicyVersionRequest(_message.Message):
    __slots__ = ("policy_version", "backend_names")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NAMES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    backend_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy_version: _Optional[int] = ..., backend_names: _Optional[_Iterable[str]] = ...) -> None: ...

class SetPolicyVersionResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    def __init__(self, backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ...) -> None: ...
