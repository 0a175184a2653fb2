"""Log-probabilities in OpenAI's two shapes, from the engine's per-token scores
(:class:`~hf_hybridcache.engine.scoring.TokenScore`: the model's raw log-softmax in float32, before temperature and
top-p, as vLLM returns them by default).

- Completions (``logprobs: k``, 0-5): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per
  token; ``top_logprobs`` maps token text to logprob for the ``k`` most likely tokens and the chosen one (so up to
  ``k + 1`` entries, as OpenAI's); a prompt's first token (with ``echo``) has ``None`` for both.
- Chat (``logprobs: true``, ``top_logprobs: k``, 0-20): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}``.

A token's text is the tokenizer's decoding of that one id (special tokens kept), its bytes that text's UTF-8 (as
vLLM's): a byte-level token that ends inside a multi-byte character reads as U+FFFD. ``text_offset`` counts
characters of those texts from the start of the choice's ``text`` (its prompt, with ``echo``), so it matches the text
wherever the tokens' texts add up to it.
"""

from __future__ import annotations

from collections.abc import Sequence


class TokenTexts:
    """Token id -> its text (the decoding of the one id, special tokens kept), remembered per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], scores: Sequence, k: int,
                        offset: int = 0) -> tuple[dict, int]:
    """OpenAI's completion ``logprobs`` of ``token_ids`` (``scores[i]`` of token ``i``; None: unscored, a prompt's
    first token) with ``k`` alternatives each, their text offsets counted from ``offset``; and the offset after
    them (a stream's next chunk starts there)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, score in zip(token_ids, scores, strict=True):
        text = texts(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if score is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(score.logprob)
        top: dict[str, float] = {}
        for alternative, value in zip(score.top_ids[:k], score.top_logprobs[:k]):
            top.setdefault(texts(alternative), value)  # two ids of one text: the likelier one's
        top.setdefault(text, score.logprob)  # the chosen token is always there, as OpenAI's
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], scores: Sequence, k: int) -> list[dict]:
    """OpenAI's chat ``logprobs.content`` entries of ``token_ids`` (scored by ``scores``) with ``k`` alternatives."""
    return [
        {**_entry(texts(token_id), score.logprob),
         "top_logprobs": [_entry(texts(i), v) for i, v in zip(score.top_ids[:k], score.top_logprobs[:k])]}
        for token_id, score in zip(token_ids, scores, strict=True)
    ]


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
