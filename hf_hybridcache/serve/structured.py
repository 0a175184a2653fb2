"""A chat request's ``response_format``, ``tools`` and ``tool_choice``: the grammar its reply follows in the engine
(:mod:`~hf_hybridcache.engine.grammar`), and the reply turned into ``message.tool_calls`` (whole, or as OpenAI's
streamed ``delta.tool_calls``).

- ``response_format``: ``{"type": "text"}`` (free), ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (JSON that validates against it).
- ``tool_choice`` ``{"type": "function", "function": {"name": N}}``: the reply is the arguments of one call to ``N``,
  constrained to its ``parameters`` schema. ``"required"``: the reply is ``[{"name": ..., "arguments": {...}}, ...]``
  (one call at least; one at most with ``parallel_tool_calls: false``), each call's arguments constrained to its
  function's schema. Either is returned as ``tool_calls`` with ``finish_reason: "tool_calls"`` once complete (a
  reply cut by ``max_tokens`` keeps ``"length"`` and the arguments generated so far).
- ``"auto"`` (OpenAI's default when tools are sent): the reply is free text, or text then calls in the model's own
  format (:mod:`~hf_hybridcache.structured.tool_grammar`: the hermes ``<tool_call>`` JSON of Qwen2.5, Qwen3 and
  Qwen3-Next, or Qwen3.5's ``<function=NAME><parameter=KEY>`` markup, known from the tokenizer's
  ``response_template`` or its chat template), each call's arguments constrained to its function's schema; read
  into ``content`` and ``tool_calls`` by :mod:`~hf_hybridcache.serve.tool_calls`. A tokenizer whose format the
  server does not know gets a 400.
  ``"none"`` generates text as without tools.

Tools are passed to the chat template (``tools=``), so a template that describes them does. The fields are read and
checked first (OpenAI's ``strict`` too) by :mod:`~hf_hybridcache.serve.tool_fields`; every schema's objects are closed
where it does not say ``additionalProperties`` (:mod:`~hf_hybridcache.structured.schemas`).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ..structured.tool_grammar import SUPPORTED, ToolCallFormat, call_schema, tool_call_format, tool_call_lark
from .schema import APIError
from .tool_calls import CALL_HEAD, CALL_MID, AutoToolPayloads, Call, tool_call_id, value_end
from .tool_fields import functions_of, named, refuse_raw_strict, response_schema

#: Any tool choice: the reply is a list of calls.
REQUIRED = object()
AUTO_REFUSED = (
    "tool_choice 'auto' (OpenAI's default when tools are sent) lets the model write calls in its own format, and "
    "this model's tokenizer has none the server can constrain and parse: its response_template and chat template "
    f"hold neither {SUPPORTED} (Gemma 4's <|tool_call> is not supported yet). "
    "Send tool_choice 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}, whose replies are "
    "constrained to the tools' schemas, or 'none'."
)


@dataclass(frozen=True)
class Structure:
    """What a chat request asks of its reply's form.

    Attributes:
        grammar: the :class:`~hf_hybridcache.structured.Grammar` it follows (None: free text).
        tool: the function whose call the reply is, :data:`REQUIRED` (calls to any of the tools), the model's
            :class:`~hf_hybridcache.structured.tool_grammar.ToolCallFormat` (``"auto"``: text or calls in it), or
            None (content).
        tools: the tools given to the chat template, or None.
    """

    grammar: object = None
    tool: object = None
    tools: list | None = None

    @property
    def template_kwargs(self) -> dict:
        return {"tools": self.tools} if self.tools else {}

    def payloads(self, payloads):
        """The chat endpoint's payload builders, turning replies into tool calls when the reply is one."""
        if isinstance(self.tool, ToolCallFormat):
            return AutoToolPayloads(payloads, self.tool)
        return payloads if self.tool is None else ToolCallPayloads(payloads, self.tool)


class Grammars:
    """Compiles the grammars of one server's requests (llguidance's tokenizer view made once, at first use; the last
    256 schemas kept compiled).

    Args:
        tokenizer: the served tokenizer; vocab_size: the model's; eos_token_ids: the ids that end a reply.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], max_kept: int = 256) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.max_kept = max_kept
        self.tool_format = tool_call_format(tokenizer)  # what "auto" constrains and reads (None: refused)
        self._compiler = None
        self._kept: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, schema: dict | None, param: str):
        """The grammar of JSON that validates against ``schema`` (None: any object).

        Raises:
            APIError: 400 naming ``param`` when the schema does not compile or llguidance is missing.
        """
        return self._compiled(json.dumps(schema, sort_keys=True), lambda compiler: compiler.json_schema(schema), param)

    def lark(self, grammar: str, param: str):
        """The grammar of a Lark text (llguidance's dialect); raises as :meth:`compile`."""
        return self._compiled(f"lark:{grammar}", lambda compiler: compiler.lark(grammar), param)

    def _compiled(self, key: str, build, param: str):
        from ..structured import GrammarCompiler

        with self._lock:
            try:
                if self._compiler is None:
                    self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
                if key not in self._kept:
                    self._kept[key] = build(self._compiler)
                    while len(self._kept) > self.max_kept:
                        self._kept.popitem(last=False)
            except ImportError as error:
                raise APIError(400, f"This server cannot constrain replies: {error}", param=param) from error
            except ValueError as error:
                raise APIError(400, str(error), param=param) from error
            self._kept.move_to_end(key)
            return self._kept[key]


async def structure_of(body, grammars: Grammars) -> Structure:
    """The :class:`Structure` of a chat request (its grammar compiled in a worker thread).

    Raises:
        APIError: 400 for a malformed ``response_format`` / ``tools`` / ``tool_choice``, ``"auto"``, a schema that
            does not compile, or no grammar library.
    """
    tools, strict = functions_of(body.tools)
    choice = body.tool_choice
    if tools and choice is None:
        choice = "auto"
    if choice is not None and choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools: send the functions the reply may call.", param="tool_choice")
    if choice == "auto":
        if grammars.tool_format is None:
            raise APIError(400, AUTO_REFUSED, param="tool_choice")
        refuse_raw_strict(grammars.tool_format, tools, strict)
        try:
            lark = tool_call_lark(grammars.tool_format, tools, body.parallel_tool_calls is not False)
        except ValueError as error:
            raise APIError(400, str(error), param="tools") from error
        grammar = await asyncio.to_thread(grammars.lark, lark, "tools")
        return Structure(grammar, replace(grammars.tool_format, functions=tools), body.tools)
    if choice in (None, "none"):
        schema, param = response_schema(body.response_format)
        if param is None:
            return Structure(tools=body.tools)
        return Structure(await asyncio.to_thread(grammars.compile, schema, param), tools=body.tools)
    if choice == "required":
        schema = {"type": "array", "items": call_schema(tools, "/items"), "minItems": 1,
                  **({} if body.parallel_tool_calls is not False else {"maxItems": 1})}
        return Structure(await asyncio.to_thread(grammars.compile, schema, "tools"), REQUIRED, body.tools)
    name = named(choice)
    if name not in tools:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                       f"({', '.join(tools)}).", param="tool_choice")
    return Structure(await asyncio.to_thread(grammars.compile, tools[name], "tools"), name, body.tools)


def calls_in(text: str, tool) -> tuple[list[Call], bool]:
    """The calls in a reply's text so far, and whether the reply is whole (every call, and the list, closed)."""
    if tool is not REQUIRED:
        whole = value_end(text, 0) == len(text)
        return [Call(tool, text, whole)], whole
    calls, at = [], 1
    while text.startswith(CALL_HEAD, at):
        mid = text.find(CALL_MID, at + len(CALL_HEAD))
        if mid < 0:
            break
        start = mid + len(CALL_MID)
        end = value_end(text, start)
        calls.append(Call(text[at + len(CALL_HEAD):mid], text[start:end or len(text)], end is not None))
        if end is None:
            break
        at = end + 1 + (2 if text.startswith(", ", end + 1) else 0)
    return calls, bool(calls) and calls[-1].complete and text.endswith("}]")


class ToolCallPayloads:
    """Wraps the chat endpoint's payload builders (``whole``, ``opening``, ``chunk``, ``usage_chunk``): a reply's text
    becomes ``message.tool_calls``, streamed as OpenAI streams them (the first delta of a call carries its ``index``,
    ``id``, ``type`` and ``function.name``, later ones ``function.arguments`` pieces)."""

    def __init__(self, payloads, tool) -> None:
        self.payloads, self.tool = payloads, tool
        self._texts: dict[int, str] = {}
        self._sent: dict[int, list[int]] = {}

    def whole(self, request_id, choices, usage) -> ChatCompletion:
        data = self.payloads.whole(request_id, choices, usage).model_dump()
        for choice, pieces in zip(data["choices"], choices):
            calls, whole = calls_in("".join(p.text for p in pieces), self.tool)
            choice["message"].update(content=None, tool_calls=[
                {"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls] or None)
            choice["finish_reason"] = _finish(choice["finish_reason"], whole)
        return ChatCompletion.model_validate(data)

    def opening(self, request_id, index) -> ChatCompletionChunk:
        data = self.payloads.opening(request_id, index).model_dump()
        data["choices"][0]["delta"] = {"role": "assistant"}
        return ChatCompletionChunk.model_validate(data)

    def chunk(self, request_id, piece) -> ChatCompletionChunk:
        text = self._texts[piece.index] = self._texts.get(piece.index, "") + piece.text
        sent = self._sent.setdefault(piece.index, [])
        calls, whole = calls_in(text, self.tool)
        deltas = []
        for k, call in enumerate(calls):
            if k == len(sent):
                deltas.append({"index": k, "id": tool_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                sent.append(len(call.arguments))
            elif len(call.arguments) > sent[k]:
                deltas.append({"index": k, "function": {"arguments": call.arguments[sent[k]:]}})
                sent[k] = len(call.arguments)
        data = self.payloads.chunk(request_id, replace(piece, text="")).model_dump()
        data["choices"][0]["delta"] = {"tool_calls": deltas} if deltas else {}
        if piece.finish_reason is not None:
            data["choices"][0]["finish_reason"] = _finish(piece.finish_reason, whole)
        return ChatCompletionChunk.model_validate(data)

    def usage_chunk(self, request_id, usage) -> ChatCompletionChunk:
        return self.payloads.usage_chunk(request_id, usage)


def _finish(reason: str, whole: bool) -> str:
    """``"tool_calls"`` for a reply that ended (end of sequence) with its calls whole, else its own reason."""
    return "tool_calls" if reason == "stop" and whole else reason
