"""Chat prompts as token ids, such that turn k of a conversation starts with turn k-1's prompt and reply ids.

A client sends the reply back as text; decoding and re-encoding it does not always give the ids the model generated
(a byte tokenizer's invalid UTF-8 becomes U+FFFD, a BPE tokenizer merges differently across the reply's edges, special
tokens are skipped). The server therefore keeps each reply's generated ids (:class:`ReplyMemory`, keyed by tenant
salt and text) and splices them in: the conversation is rendered with the template once, with a placeholder where
each remembered reply goes, and the text between placeholders is tokenized piece by piece. The pieces of turn k-1's
prompt are the same pieces (rendering is prefix-stable for chat templates), so the token ids are too, and the prefix
cache hits on the previous prompt and the reply. ``benchmarks/reply_roundtrip.py`` measures how often the plain
re-encoding would have given the reply's own ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

#: Placeholder for the i-th remembered reply inside a rendered conversation (private-use code points, which no
#: template rewrites and no client sends).
_MARK = "\ue000{}\ue001"


class ReplyMemory:
    """The generated token ids of recent replies, by ``(salt, reply text)``, least recently used dropped first.

    Args:
        max_replies: replies kept (a few hundred bytes each).
    """

    def __init__(self, max_replies: int = 65536) -> None:
        self.max_replies = max_replies
        self._ids: OrderedDict[tuple[str | None, str], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, salt: str | None, text: str, token_ids: list[int]) -> None:
        with self._lock:
            self._ids[(salt, text)] = list(token_ids)
            self._ids.move_to_end((salt, text))
            while len(self._ids) > self.max_replies:
                self._ids.popitem(last=False)

    def lookup(self, salt: str | None, text: str) -> list[int] | None:
        with self._lock:
            ids = self._ids.get((salt, text))
            if ids is not None:
                self._ids.move_to_end((salt, text))
            return ids


def chat_prompt_ids(tokenizer, messages: list[dict], memory: ReplyMemory | None = None, salt: str | None = None,
                    **template_kwargs) -> list[int]:
    """The prompt ids of ``messages`` (``[{"role", "content"}]``, content a string) rendered with the tokenizer's chat
    template and a generation prompt, with the remembered ids of each assistant reply spliced in.

    Raises:
        ValueError: the tokenizer has no chat template (from transformers).
    """
    replies = []
    rendered = []
    for message in messages:
        ids = None
        if memory is not None and message["role"] == "assistant":
            ids = memory.lookup(salt, message["content"])
        if ids is None:
            rendered.append(message)
        else:
            rendered.append({**message, "content": _MARK.format(len(replies))})
            replies.append(ids)
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **template_kwargs)
    prompt: list[int] = []
    for i, ids in enumerate(replies):
        before, mark, text = text.partition(_MARK.format(i))
        if not mark:  # the template changed the content: the reply is re-encoded from its text
            return _encode(tokenizer, tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **template_kwargs))
        prompt += _encode(tokenizer, before) + ids
    return prompt + _encode(tokenizer, text)


def _encode(tokenizer, text: str) -> list[int]:
    # The template writes the special tokens itself (as apply_chat_template(tokenize=True) encodes).
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
