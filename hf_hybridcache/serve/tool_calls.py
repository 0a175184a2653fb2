"""``tool_choice: "auto"``: a reply that is text, or text then calls in the model's own format
(:class:`~hf_hybridcache.structured.tool_grammar.ToolCallFormat`, which the reply's grammar follows), read into
OpenAI's ``message.content`` and ``message.tool_calls``, whole or streamed (text as ``delta.content``, calls as
``delta.tool_calls``: the first delta of a call carries its ``index``, ``id``, ``type`` and ``function.name``, later
ones ``function.arguments`` pieces).

The reading mirrors transformers' response template for the format (``tokenizer.parse_response``; the text before
the first call, trailing whitespace left out, is the content), and also reads a reply cut by ``max_tokens`` (the
calls so far, the last one's arguments cut), which transformers' parser refuses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ..structured.tool_grammar import is_raw_string

#: A call as the grammars write it, in ``"required"``'s list and in ``"auto"``'s hermes blocks (keys in this order,
#: ``json.dumps``' separators).
CALL_HEAD, CALL_MID = '{"name": "', '", "arguments": '


@dataclass(frozen=True)
class Call:
    """One tool call read from a reply: its function, its arguments' JSON text so far, and whether they are whole."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class Reply:
    """A reply read so far: the content that can be sent (never a piece of an opening tag), the calls, and whether
    the calls are whole (the last one closed)."""

    content: str
    calls: list[Call]
    whole: bool


def read_reply(text: str, fmt, final: bool) -> Reply:
    """Read ``text`` (a reply so far; ``final``: the whole of it) in the format ``fmt`` (its calls' bodies read by
    the reader of ``fmt.kind``)."""
    at = text.find(fmt.open)
    if at < 0:
        if final:
            return Reply(text, [], False)
        held = next((k for k in range(min(len(fmt.open) - 1, len(text)), 0, -1) if text.endswith(fmt.open[:k])), 0)
        return Reply(text[:len(text) - held].rstrip(), [], False)
    calls, pos, whole = [], at + len(fmt.open), False
    while True:
        call, after = _READERS[fmt.kind](text, pos, fmt)
        if call is None:
            break
        calls.append(call)
        if after is None:
            break
        if text.startswith(fmt.close + fmt.separator + fmt.open, after):
            pos = after + len(fmt.close + fmt.separator + fmt.open)
            continue
        whole = text.startswith(fmt.close, after)
        break
    return Reply(text[:at].rstrip(), calls, whole)


def _json_call(text: str, pos: int, fmt) -> tuple[Call | None, int | None]:
    """The call at ``pos`` written ``{"name": N, "arguments": A}`` (None until its name is whole), and where it ends
    (None: not yet)."""
    if not text.startswith(CALL_HEAD, pos):
        return None, None
    mid = text.find(CALL_MID, pos + len(CALL_HEAD))
    if mid < 0:
        return None, None
    start = mid + len(CALL_MID)
    end = value_end(text, start)
    call = Call(text[pos + len(CALL_HEAD):mid], text[start:end or len(text)], end is not None)
    return call, end + 1 if end is not None and text.startswith("}", end) else None


_FUNCTION, _PARAMETER = re.compile(r"<function=([^>\n]+)>"), re.compile(r"\s*<parameter=([^>\n]+)>")
_PARAMETER_END, _FUNCTION_END = "</parameter>", re.compile(r"\s*</function>")


def _xml_call(text: str, pos: int, fmt) -> tuple[Call | None, int | None]:
    """The call at ``pos`` written ``<function=N>`` + ``<parameter=K>\\nVALUE\\n</parameter>`` ... + ``</function>``,
    its arguments JSON (a string parameter's raw text, trimmed as transformers' ``xml-inline`` parser trims it, as
    a JSON string; another's value as JSON), streamed as the prefix of the whole: an open string value's text so
    far (less a tail that may be its closing tag or trimmed whitespace), other values once closed."""
    head = _FUNCTION.match(text, pos)
    if head is None:
        return None, None
    name, pos, parts = head.group(1), head.end(), []
    properties = ((fmt.functions or {}).get(head.group(1)) or {}).get("properties") or {}
    while (parameter := _PARAMETER.match(text, pos)) is not None:
        key, start = parameter.group(1), parameter.end()
        end = text.find(_PARAMETER_END, start)
        if end < 0:
            if is_raw_string(properties.get(key)):
                value = text[start:]
                held = next((k for k in range(min(len(_PARAMETER_END), len(value)), 0, -1)
                             if value.endswith(_PARAMETER_END[:k])), 0)
                parts.append(f"{json.dumps(key)}: {json.dumps(value[:len(value) - held].strip())[:-1]}")
            return Call(name, "{" + ", ".join(parts), False), None
        parts.append(f"{json.dumps(key)}: {_value(text[start:end].strip(), properties.get(key))}")
        pos = end + len(_PARAMETER_END)
    close = _FUNCTION_END.match(text, pos)
    arguments = "{" + ", ".join(parts)
    return (Call(name, arguments + "}", True), close.end()) if close else (Call(name, arguments, False), None)


def _value(text: str, schema) -> str:
    """A parameter's value as JSON: a string's raw text; another's JSON (Python's ``True`` / ``False`` / ``None``,
    which a template's ``| string`` writes, read as JSON's), or its text as a string when it is not JSON."""
    if not is_raw_string(schema):
        try:
            return json.dumps(json.loads({"True": "true", "False": "false", "None": "null"}.get(text, text)))
        except ValueError:
            pass
    return json.dumps(text)


_READERS = {"json": _json_call, "xml": _xml_call}


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value at ``start`` ends, or None when it is not whole yet."""
    try:
        return json.JSONDecoder().raw_decode(text, start)[1] if start < len(text) else None
    except ValueError:
        return None


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class AutoToolPayloads:
    """Wraps the chat endpoint's payload builders (``whole``, ``opening``, ``chunk``, ``usage_chunk``) for a reply
    in format ``fmt``: ``finish_reason`` is ``"tool_calls"`` for a reply that ended (end of sequence) with calls."""

    def __init__(self, payloads, fmt) -> None:
        self.payloads, self.fmt = payloads, fmt
        self._texts: dict[int, str] = {}
        self._content: dict[int, int] = {}
        self._sent: dict[int, list[int]] = {}

    def whole(self, request_id, choices, usage) -> ChatCompletion:
        data = self.payloads.whole(request_id, choices, usage).model_dump()
        for choice, pieces in zip(data["choices"], choices):
            reply = read_reply("".join(p.text for p in pieces), self.fmt, final=True)
            if reply.calls:
                choice["message"].update(content=reply.content or None, tool_calls=[
                    {"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in reply.calls])
            choice["finish_reason"] = _finish(choice["finish_reason"], reply)
        return ChatCompletion.model_validate(data)

    def opening(self, request_id, index) -> ChatCompletionChunk:
        return self.payloads.opening(request_id, index)

    def chunk(self, request_id, piece) -> ChatCompletionChunk:
        text = self._texts[piece.index] = self._texts.get(piece.index, "") + piece.text
        reply = read_reply(text, self.fmt, final=piece.finish_reason is not None)
        delta: dict = {}
        content_sent = self._content.get(piece.index, 0)
        if len(reply.content) > content_sent:
            delta["content"] = reply.content[content_sent:]
            self._content[piece.index] = len(reply.content)
        sent = self._sent.setdefault(piece.index, [])
        calls = []
        for k, call in enumerate(reply.calls):
            if k == len(sent):
                calls.append({"index": k, "id": tool_call_id(), "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
                sent.append(len(call.arguments))
            elif len(call.arguments) > sent[k]:
                calls.append({"index": k, "function": {"arguments": call.arguments[sent[k]:]}})
                sent[k] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        data = self.payloads.chunk(request_id, replace(piece, text="")).model_dump()
        data["choices"][0]["delta"] = delta
        if piece.finish_reason is not None:
            data["choices"][0]["finish_reason"] = _finish(piece.finish_reason, reply)
        return ChatCompletionChunk.model_validate(data)

    def usage_chunk(self, request_id, usage) -> ChatCompletionChunk:
        return self.payloads.usage_chunk(request_id, usage)


def _finish(reason: str, reply: Reply) -> str:
    """``"tool_calls"`` for a reply that ended (end of sequence) with its calls whole, else its own reason."""
    return "tool_calls" if reason == "stop" and reply.calls and reply.whole else reason
