"""``/v1/completions`` as OpenAI defines it: which fields are refused, the prompts of a request, and its payloads.

- ``prompt`` is a string, a list of strings, a list of token ids or a list of lists of ids; each prompt is its own
  request in the engine (so prompts that share a prefix share it through the cache), and choice ``k`` of prompt ``p``
  is ``choices[p * n + k]`` (OpenAI's numbering).
- ``echo``: a choice's text starts with its prompt (a string prompt as sent, token ids decoded with their special
  tokens), and with ``logprobs`` its prompt tokens' logprobs come first, the first token's ``None``.
- ``logprobs: k`` (0-5): :func:`~hf_hybridcache.serve.logprobs.completion_logprobs` of the generated tokens (and the
  prompt's with ``echo``); ``max_tokens: 0`` with ``echo`` scores the prompt and generates nothing.
- OpenAI fields this server does not implement (``best_of`` other than ``n``, ``suffix``, ``logit_bias``, non-zero
  penalties) and fields OpenAI does not define are a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import time

from .choices import Piece
from .logprobs import TokenTexts, completion_logprobs
from .schema import APIError, CompletionRequest

#: OpenAI completion fields this server does not implement, with the value at which each does nothing.
UNSUPPORTED = {"suffix": None, "logit_bias": None, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def refuse_unsupported(body: CompletionRequest) -> None:
    """Raise a 400 naming the first field ``body`` sets that the server does not implement or does not know.

    Raises:
        APIError: 400 with ``param`` the field.
    """
    for name in body.model_extra or {}:
        raise APIError(400, f"Unknown field {name!r}: OpenAI's completions API has no such field, and this server "
                       "does not ignore fields; remove it.", param=name)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of={body.best_of} is not implemented (every choice is returned, best_of = n); "
                       "remove it or set it to n.", param="best_of")
    for name, off in UNSUPPORTED.items():
        value = getattr(body, name)
        if value != off and not (name == "logit_bias" and value == {}):
            raise APIError(400, f"{name} is not implemented by this server; remove it (or send {off!r}).", param=name)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 generates nothing: send echo: true (with logprobs) to score the prompt, "
                       "or max_tokens of at least 1.", param="max_tokens")


def prompts_of(body: CompletionRequest, tokenizer, vocab_size: int) -> list[tuple[list[int], str]]:
    """``(token ids, text)`` of each prompt of ``body`` (a string prompt's text as sent; ids decoded with their
    special tokens).

    Raises:
        APIError: 400 for an empty prompt or a token id outside the vocabulary.
    """
    prompt = body.prompt
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if many else [prompt]
    out = []
    for item in prompts:
        if isinstance(item, str):
            ids, text = tokenizer(item, add_special_tokens=False)["input_ids"], item
        else:
            if item and (min(item) < 0 or max(item) >= vocab_size):
                raise APIError(400, f"Token ids must lie in the vocabulary [0, {vocab_size}).", param="prompt")
            ids, text = list(item), tokenizer.decode(item, skip_special_tokens=False)
        if not ids:
            raise APIError(400, "The prompt is empty; send at least one token.", param="prompt")
        out.append((ids, text))
    return out


class CompletionPayloads:
    """The response and stream chunks of one completions request.

    Args:
        model: the model name the response names.
        prompts: ``(ids, text)`` of each prompt (:func:`prompts_of`).
        n: choices per prompt.
        echo: each choice's text (and logprobs) start with its prompt.
        logprobs: alternatives per token of the logprobs returned, or None for none.
        texts: token id -> text.
    """

    def __init__(self, model: str, prompts: list[tuple[list[int], str]], n: int, echo: bool, logprobs: int | None,
                 texts: TokenTexts) -> None:
        self.model, self.created = model, int(time.time())
        self.prompts, self.n, self.echo, self.logprobs, self.texts = prompts, n, echo, logprobs, texts
        self._offsets: dict[int, int] = {}  # a stream's next text offset, by choice

    def whole(self, request_id: str, choices: list[list[Piece]], usage) -> dict:
        out = []
        for index, pieces in enumerate(choices):
            text = "".join(piece.text for piece in pieces)
            parts = [(text, [i for p in pieces for i in p.token_ids], [s for p in pieces for s in p.scores or ()])]
            out.append(self._choice(index, parts, pieces, pieces[-1].finish_reason))
        return self._body(request_id, out, usage.model_dump(exclude_none=True))

    def opening(self, request_id: str, index: int) -> None:
        return None

    def chunk(self, request_id: str, piece: Piece) -> dict:
        parts = [(piece.text, piece.token_ids, piece.scores or [])]
        return self._body(request_id, [self._choice(piece.index, parts, [piece], piece.finish_reason)])

    def usage_chunk(self, request_id: str, usage) -> dict:
        return self._body(request_id, [], usage.model_dump(exclude_none=True))

    def _choice(self, index: int, parts: list, pieces: list[Piece], finish_reason: str | None) -> dict:
        """A choice of ``parts`` ``[(text, token ids, scores)]``, after its prompt when echoed and not yet sent."""
        if self.echo and index not in self._offsets:
            ids, prompt_text = self.prompts[index // self.n]
            prompt_scores = next((p.prompt_scores for p in pieces if p.prompt_scores is not None), None)
            parts = [(prompt_text, ids, prompt_scores if self.logprobs is not None else None), *parts]
        choice = {"index": index, "text": "".join(part[0] for part in parts), "finish_reason": finish_reason,
                  "logprobs": None}
        offset = self._offsets.get(index, 0)
        if self.logprobs is not None:
            ids = [i for part in parts for i in part[1]]
            scores = [s for part in parts for s in part[2]]
            choice["logprobs"], offset = completion_logprobs(self.texts, ids, scores, self.logprobs, offset)
        self._offsets[index] = offset
        return choice

    def _body(self, request_id: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body
