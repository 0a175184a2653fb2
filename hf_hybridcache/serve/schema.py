"""The requests the server accepts (OpenAI's chat and text completion bodies, the fields it honours) and its errors in
OpenAI's JSON shape. Responses are the ``openai`` package's own types, as ``transformers serve`` returns them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


class APIError(Exception):
    """An error a client gets as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _not_bool(value):
    # JSON's true/false are Python ints, so pydantic's lax mode reads `max_tokens: true` as 1
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be an integer, not a boolean")
    return value


#: An integer field: a JSON integer (or a string or float that is one, pydantic's lax reading), never a boolean.
Int = Annotated[int, BeforeValidator(_not_bool)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    """``url``: a ``data:image/...;base64,...`` URL, or an ``http(s)://`` one (``--allow-remote-images``);
    ``detail``: accepted, no effect (the processor decides the resolution). See :mod:`~hf_hybridcache.serve.images`."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[dict] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        # OpenAI lets only an assistant turn (one that called tools) go without content
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs `content` (a string or a list of parts), got null")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def images(self) -> list[ImageURL]:
        """The message's image parts, in order."""
        return [p.image_url for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) else []

    def for_template(self, with_images: bool = False) -> dict:
        """The message as chat templates take it: role and content, and the tool fields it has. ``with_images``: a
        message with image parts keeps its parts, each image as ``{"type": "image"}`` (a processor's chat template)."""
        extra = {key: value for key, value in (("tool_calls", self.tool_calls), ("tool_call_id", self.tool_call_id),
                                               ("name", self.name)) if value is not None}
        content = self.text()
        if with_images and self.images():
            content = [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                       for p in self.content]
        return {"role": self.role, "content": content, **extra}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints honour; others OpenAI defines are accepted and ignored (as most servers do)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    # torch seeds a generator with a value in [-2**63, 2**64); choice k of n samples with seed + k (k < 16)
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, min_length=1)
    # not OpenAI's (vLLM's and SGLang's clients send such fields with extra_body): draft tokens per step at most, 0 to
    # opt out of the server's speculation; checked against --num-speculative-tokens (serve/speculation.py)
    num_speculative_tokens: int | None = Field(None, strict=True)

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop):
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("`stop` takes at most 4 strings")
        if stop == "" or isinstance(stop, list) and "" in stop:
            raise ValueError("a `stop` string must not be empty (it would match before any text); leave it out")
        return stop

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Common):
    """Fields OpenAI defines that this server does not implement, and fields OpenAI does not define, are kept
    (``model_extra``) to be refused by name (:mod:`~hf_hybridcache.serve.chat_fields`)."""

    model_config = ConfigDict(extra="allow")

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    # serve/structured.py reads and checks these four
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    """``max_tokens`` None: OpenAI's default, 16 (``app.COMPLETION_MAX_TOKENS``), capped by the room left; 0 with
    ``echo``: score the prompt, generate nothing. OpenAI's fields this server does not implement, and fields OpenAI
    does not define, are refused by name (:func:`~hf_hybridcache.serve.completions.refuse_unsupported`)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: Int | None = Field(None, ge=0, le=5)
    best_of: Int | None = None
    suffix: str | None = None
    logit_bias: dict | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_bool_token_ids(cls, prompt):
        # before the union, which would report each branch's failure instead of this one
        rows = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
        if any(isinstance(row, list) and any(isinstance(t, bool) for t in row) for row in rows):
            raise PydanticCustomError("int_type", "Token ids should be integers, not booleans")
        return prompt
