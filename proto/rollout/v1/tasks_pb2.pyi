from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MathTask(_message.Message):
    __slots__ = ("id", "question", "answer", "tools", "no_tools", "rel_tol")
    ID_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    NO_TOOLS_FIELD_NUMBER: _ClassVar[int]
    REL_TOL_FIELD_NUMBER: _ClassVar[int]
    id: str
    question: str
    answer: str
    tools: _containers.RepeatedScalarFieldContainer[str]
    no_tools: bool
    rel_tol: float
    def __init__(self, id: _Optional[str] = ..., question: _Optional[str] = ..., answer: _Optional[str] = ..., tools: _Optional[_Iterable[str]] = ..., no_tools: _Optional[bool] = ..., rel_tol: _Optional[float] = ...) -> None: ...

class CodeTask(_message.Message):
    __slots__ = ("id", "prompt", "mode", "entry_point", "solution_file", "tests", "reward_mode", "time_limit_s", "memory_limit_mb", "solution")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[CodeTask.Mode]
        MODE_STDIO: _ClassVar[CodeTask.Mode]
        MODE_FUNCTION: _ClassVar[CodeTask.Mode]
    MODE_UNSPECIFIED: CodeTask.Mode
    MODE_STDIO: CodeTask.Mode
    MODE_FUNCTION: CodeTask.Mode
    class RewardMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REWARD_MODE_UNSPECIFIED: _ClassVar[CodeTask.RewardMode]
        REWARD_MODE_ALL_PASS: _ClassVar[CodeTask.RewardMode]
        REWARD_MODE_FRACTION: _ClassVar[CodeTask.RewardMode]
    REWARD_MODE_UNSPECIFIED: CodeTask.RewardMode
    REWARD_MODE_ALL_PASS: CodeTask.RewardMode
    REWARD_MODE_FRACTION: CodeTask.RewardMode
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    SOLUTION_FILE_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MODE_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_MB_FIELD_NUMBER: _ClassVar[int]
    SOLUTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    mode: CodeTask.Mode
    entry_point: str
    solution_file: str
    tests: _containers.RepeatedCompositeFieldContainer[CodeTest]
    reward_mode: CodeTask.RewardMode
    time_limit_s: float
    memory_limit_mb: int
    solution: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., mode: _Optional[_Union[CodeTask.Mode, str]] = ..., entry_point: _Optional[str] = ..., solution_file: _Optional[str] = ..., tests: _Optional[_Iterable[_Union[CodeTest, _Mapping]]] = ..., reward_mode: _Optional[_Union[CodeTask.RewardMode, str]] = ..., time_limit_s: _Optional[float] = ..., memory_limit_mb: _Optional[int] = ..., solution: _Optional[str] = ...) -> None: ...

class CodeTest(_message.Message):
    __slots__ = ("input", "output", "code")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    input: str
    output: str
    code: str
    def __init__(self, input: _Optional[str] = ..., output: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class SweTask(_message.Message):
    __slots__ = ("instance_id", "repo", "repo_source", "base_commit", "problem_statement", "patch", "test_patch", "fail_to_pass", "pass_to_pass", "test_env", "test_timeout_s", "pytest_plugins", "pytest_plugin_autoload", "version", "spec", "test_runner", "image")
    class TestEnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REPO_FIELD_NUMBER: _ClassVar[int]
    REPO_SOURCE_FIELD_NUMBER: _ClassVar[int]
    BASE_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_STATEMENT_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    TEST_PATCH_FIELD_NUMBER: _ClassVar[int]
    FAIL_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    PASS_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    TEST_ENV_FIELD_NUMBER: _ClassVar[int]
    TEST_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PYTEST_PLUGINS_FIELD_NUMBER: _ClassVar[int]
    PYTEST_PLUGIN_AUTOLOAD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TEST_RUNNER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    repo: str
    repo_source: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: _containers.RepeatedScalarFieldContainer[str]
    pass_to_pass: _containers.RepeatedScalarFieldContainer[str]
    test_env: _containers.ScalarMap[str, str]
    test_timeout_s: float
    pytest_plugins: _containers.RepeatedScalarFieldContainer[str]
    pytest_plugin_autoload: bool
    version: str
    spec: SweEnvSpec
    test_runner: str
    image: str
    def __init__(self, instance_id: _Optional[str] = ..., repo: _Optional[str] = ..., repo_source: _Optional[str] = ..., base_commit: _Optional[str] = ..., problem_statement: _Optional[str] = ..., patch: _Optional[str] = ..., test_patch: _Optional[str] = ..., fail_to_pass: _Optional[_Iterable[str]] = ..., pass_to_pass: _Optional[_Iterable[str]] = ..., test_env: _Optional[_Mapping[str, str]] = ..., test_timeout_s: _Optional[float] = ..., pytest_plugins: _Optional[_Iterable[str]] = ..., pytest_plugin_autoload: _Optional[bool] = ..., version: _Optional[str] = ..., spec: _Optional[_Union[SweEnvSpec, _Mapping]] = ..., test_runner: _Optional[str] = ..., image: _Optional[str] = ...) -> None: ...

class SweEnvSpec(_message.Message):
    __slots__ = ("python", "pre_install", "pip_packages", "install", "test_cmd", "log_parser", "eval_commands")
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    PRE_INSTALL_FIELD_NUMBER: _ClassVar[int]
    PIP_PACKAGES_FIELD_NUMBER: _ClassVar[int]
    INSTALL_FIELD_NUMBER: _ClassVar[int]
    TEST_CMD_FIELD_NUMBER: _ClassVar[int]
    LOG_PARSER_FIELD_NUMBER: _ClassVar[int]
    EVAL_COMMANDS_FIELD_NUMBER: _ClassVar[int]
    python: str
    pre_install: _containers.RepeatedScalarFieldContainer[str]
    pip_packages: _containers.RepeatedScalarFieldContainer[str]
    install: str
    test_cmd: str
    log_parser: str
    eval_commands: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, python: _Optional[str] = ..., pre_install: _Optional[_Iterable[str]] = ..., pip_packages: _Optional[_Iterable[str]] = ..., install: _Optional[str] = ..., test_cmd: _Optional[str] = ..., log_parser: _Optional[str] = ..., eval_commands: _Optional[_Iterable[str]] = ...) -> None: ...
