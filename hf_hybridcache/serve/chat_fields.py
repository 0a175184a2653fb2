"""Which ``/v1/chat/completions`` fields the server refuses: OpenAI's fields it does not implement, and fields OpenAI
does not define, are a 400 naming the field, never silently dropped (a client that asks for audio, penalties or a
predicted output would otherwise get a plain reply and no error). Fields that only label a request for OpenAI's own
bookkeeping are accepted and have no effect here: :data:`ACCEPTED`."""

from __future__ import annotations

from .schema import APIError, ChatRequest

#: OpenAI chat fields this server does not implement, with the value at which each does nothing (sent with that
#: value, they are accepted).
UNSUPPORTED = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None, "audio": None, "modalities": None,
    "prediction": None, "functions": None, "function_call": None, "web_search_options": None,
    "reasoning_effort": None, "verbosity": None, "store": False,
}
#: Text is all this server returns: ``modalities`` ``["text"]`` asks for nothing else.
TEXT_ONLY = ["text"]
#: OpenAI fields that label a request for OpenAI's own services (stored completions, billing tiers, caching keys):
#: accepted, no effect on the reply.
ACCEPTED = {"metadata", "service_tier", "prompt_cache_key", "safety_identifier"}


def refuse_unsupported_chat(body: ChatRequest) -> None:
    """Raise a 400 naming the first field ``body`` sets that the server does not implement or does not know.

    Raises:
        APIError: 400 with ``param`` the field.
    """
    extra = dict(body.model_extra or {})
    for name, value in extra.items():
        if name in ACCEPTED:
            continue
        if name not in UNSUPPORTED:
            raise APIError(400, f"Unknown field {name!r}: OpenAI's chat completions API has no such field, and this "
                           "server does not ignore fields; remove it.", param=name)
        off = UNSUPPORTED[name]
        if value in (off, {}, []) or (name == "modalities" and value == TEXT_ONLY):
            continue
        hint = " (use tools and tool_choice)" if name in ("functions", "function_call") else ""
        raise APIError(400, f"{name} is not implemented by this server{hint}; remove it (or send {off!r}).",
                       param=name)
