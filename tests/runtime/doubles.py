"""Shared test doubles for the agent loop: a pool-free LLM client and chat templates."""

from __future__ import annotations

import functools
from typing import Any

from rollout.runtime.llm import GenerateRequest, GenerateResult, LLMUnavailable
from rollout.server.llm.engine import Engine, EngineError

# Qwen2.5-Instruct's chat template (tools rendered by the template, tool results grouped into
# one user turn of <tool_response> blocks). Written out here: nothing is downloaded in tests.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    "{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\" }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Like Qwen3: earlier assistant turns lose their <think> block when the history is re-rendered,
# so rendering is NOT append-only.
THINK_STRIPPING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.cache
def smollm2_tokenizer() -> Any:
    """The real SmolLM2-135M-Instruct tokenizer (converted once from the bundled GGUF)."""
    from transformers import AutoTokenizer

    from rollout.server.llm.smollm2 import smollm2_dir

    return AutoTokenizer.from_pretrained(str(smollm2_dir()))


class EngineClient:
    """``runtime.llm.LLMClient`` over one engine, without the backend pool (no retries)."""

    def __init__(self, engine: Engine, *, context_length: int | None = None) -> None:
        self.engine = engine
        self.context_length = context_length
        self.ended: list[str] = []

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        try:
            return await self.engine.generate(request)
        except EngineError as e:
            raise LLMUnavailable(str(e)) from e

    async def end_session(self, session_id: str) -> None:
        self.ended.append(session_id)
        await self.engine.release_session(session_id)
