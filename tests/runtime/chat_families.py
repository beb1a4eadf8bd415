"""Chat templates of other model families, and tiny tokenizers that carry them.

The templates are condensed from the families' published ones (Llama 3.1 Instruct, Gemma 2/3),
keeping what the agent loop depends on: how tools are announced, how a tool result is rendered
(or refused), and the end-of-turn tokens. Tokenizers are byte-level BPE trained locally on a
small corpus (nothing is downloaded), with the family's special tokens.
"""

from __future__ import annotations

import functools
from typing import Any

# Llama 3.1 Instruct: tools go into the first user message with the instruction to answer in
# bare JSON {"name": ..., "parameters": ...}; tool results come back in the "ipython" role.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}"
    "{%- endif %}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools_in_user_message and not tools is none %}"
    "{%- if messages | length != 0 %}"
    "{%- set first_user_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{{- raise_exception('Cannot put tools in the first user message when "
    "there is no first user message!') }}{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call ' }}"
    "{{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.' }}"
    "{{- 'Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>'}}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

# Gemma 2/3: no system role (folded into the first user turn), roles must alternate
# user/model, and any other role (tool) raises.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{%- set role = 'model' %}"
    "{%- else %}{%- set role = message['role'] %}{%- endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)
GEMMA_SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]

# ChatML whose generation prompt opens the reasoning block (Qwen3 style) unless the
# enable_thinking template argument is false, as Qwen3's own template does.
THINKING_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """
{"name": "echo", "parameters": {"text": "hi"}} {"name": "submit", "arguments": {"answer": "42"}}
The agent runs a command in the sandbox and reads the output of the tool.
You are a helpful assistant. Solve the task by calling the tools. Use the tools. Do it.
Given the following functions, please respond with a JSON for a function call.
echo: hi  result  answer  think  model  user  system  assistant  ipython  Today Date
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > .
"""


def build_tokenizer(specials: list[str], template: str, *, bos: str, eos: str,
                    pad: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   pad_token=pad)
    fast.chat_template = template
    return fast


@functools.cache
def llama31_tokenizer() -> Any:
    return build_tokenizer(LLAMA31_SPECIALS, LLAMA31_TEMPLATE, bos="<|begin_of_text|>",
                           eos="<|eot_id|>", pad="<|end_of_text|>")


@functools.cache
def gemma_tokenizer() -> Any:
    return build_tokenizer(GEMMA_SPECIALS, GEMMA_TEMPLATE, bos="<bos>", eos="<end_of_turn>",
                           pad="<pad>")


@functools.cache
def thinking_chatml_tokenizer() -> Any:
    return build_tokenizer(CHATML_SPECIALS, THINKING_CHATML_TEMPLATE, bos="<|im_start|>",
                           eos="<|im_end|>", pad="<|endoftext|>")


PLAIN_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@functools.cache
def chatml_tokenizer() -> Any:
    return build_tokenizer(CHATML_SPECIALS, PLAIN_CHATML_TEMPLATE, bos="<|im_start|>",
                           eos="<|im_end|>", pad="<|endoftext|>")
