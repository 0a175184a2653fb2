"""Toy chat templates that describe tools and write tool calls as Qwen2.5 / Qwen3 / Qwen3-Next do (hermes style:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``) or as Qwen3.5 does
(``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``), on the byte
tokenizer's roles, and the ``response_template`` transformers parses such replies with (``tokenizer.parse_response``):
what the server's ``tool_choice: "auto"`` is tested on without a hub download. The byte tokenizer's own template is
left as it is.
"""

from __future__ import annotations

from . import byte_tokenizer

#: The tools block of Qwen3's template, on the toy roles (``<|system|>`` ... ``</s>``).
_TOOLS = (
    "<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call></s>"
)
_CALLS = (
    "{% for call in message['tool_calls'] or [] %}{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>{% endfor %}"
)


def _chat_template(tools: str, calls: str) -> str:
    return (
        "{% if tools %}" + tools + "{% elif messages[0]['role'] == 'system' %}<|system|>"
        "{{ messages[0]['content'] }}</s>{% endif %}{% for message in messages %}"
        "{% if message['role'] == 'system' and loop.first %}"
        "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] or '' }}" + calls + "</s>"
        "{% elif message['role'] == 'tool' %}<|user|><tool_response>\n{{ message['content'] }}\n</tool_response></s>"
        "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


HERMES_CHAT_TEMPLATE = _chat_template(_TOOLS, _CALLS)
#: transformers serve's fallback for the Qwen2/Qwen3 families (``cli/serving/utils.py``) on the toy roles.
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*</s>", "content": "text"},
    },
}


#: The tools block of Qwen3.5's template, on the toy roles.
_QWEN3_5_TOOLS = (
    "<|system|># Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n"
    "</tool_call>{% if messages[0]['role'] == 'system' %}\n\n{{ messages[0]['content'] }}{% endif %}</s>"
)
#: Qwen3.5's calls: a mapping or list argument as JSON, any other as its text.
_QWEN3_5_CALLS = (
    "{% for call in message['tool_calls'] or [] %}{% if not loop.first %}{{ '\\n' }}"
    "{% elif message['content'] %}{{ '\\n\\n' }}{% endif %}"
    "<tool_call>\n<function={{ call['function']['name'] }}>\n"
    "{% for key, value in call['function']['arguments'] | items %}<parameter={{ key }}>\n"
    "{% if value is mapping or (value is sequence and value is not string) %}{{ value | tojson }}"
    "{% else %}{{ value | string }}{% endif %}{{ '\\n' }}</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}"
)
QWEN3_5_CHAT_TEMPLATE = _chat_template(_QWEN3_5_TOOLS, _QWEN3_5_CALLS)
#: transformers serve's fallback for the Qwen3.5 family (``cli/serving/utils.py``) on the toy roles.
QWEN3_5_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
                       "close_pattern": r"</function>\s*</tool_call>", "repeats": True, "content": "xml-inline",
                       "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>"},
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
        "content": {"close_pattern": r"\s*</s>", "content": "text"},
    },
}


def _tool_tokenizer(chat_template: str, response_template: dict | None):
    """The byte tokenizer with ``chat_template`` and, unless None, ``response_template``."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = chat_template
    if response_template is not None:
        tokenizer.response_template = response_template
    return tokenizer


def qwen3_5_tool_tokenizer(response_template: bool = True):
    """The byte tokenizer with :data:`QWEN3_5_CHAT_TEMPLATE`, and :data:`QWEN3_5_RESPONSE_TEMPLATE` as its
    ``response_template`` (False: none, as Qwen3.5 checkpoints ship; the format is then read from the chat template)."""
    return _tool_tokenizer(QWEN3_5_CHAT_TEMPLATE, QWEN3_5_RESPONSE_TEMPLATE if response_template else None)


def hermes_tool_tokenizer(response_template: bool = True):
    """The byte tokenizer with :data:`HERMES_CHAT_TEMPLATE`, and :data:`HERMES_RESPONSE_TEMPLATE` as its
    ``response_template`` (False: none, as most Qwen checkpoints ship; the format is then read from the chat
    template)."""
    return _tool_tokenizer(HERMES_CHAT_TEMPLATE, HERMES_RESPONSE_TEMPLATE if response_template else None)
