"""Chat prompts as token ids, such that turn k of a conversation starts with turn k-1's prompt and reply ids.

A client sends the reply back as text; decoding and re-encoding it does not always give the ids the model generated
(a byte tokenizer's invalid UTF-8 becomes U+FFFD, a BPE tokenizer merges differently across the reply's edges, special
tokens are skipped). The server therefore keeps each reply's generated ids (:class:`ReplyMemory`, keyed by tenant
salt, the prompt ids that produced the reply and its text: the text alone does not name the ids, since different
invalid bytes or skipped special tokens decode to the same text) and splices them in: the conversation is rendered with the template once, with a placeholder where
each remembered reply goes, and the text between placeholders is tokenized piece by piece. The pieces of turn k-1's
prompt are the same pieces (rendering is prefix-stable for chat templates), so the token ids are too, and the prefix
cache hits on the previous prompt and the reply. ``benchmarks/reply_roundtrip.py`` measures how often the plain
re-encoding would have given the reply's own ids.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from array import array

#: Placeholder for the i-th remembered reply inside a rendered conversation (private-use code points, which no
#: template rewrites and no client sends).
_MARK = "\ue000{}\ue001"


class ReplyMemory:
    """The generated token ids of recent replies, by ``(salt, prompt ids, reply text, the prompt's images)`` (the
    prompt as a SHA-256 digest, the images as :func:`~hf_hybridcache.serve.images.image_digest` s: equal ids with
    other images are another prompt), least recently used dropped first.

    Args:
        max_replies: replies kept (a few hundred bytes each).
    """

    def __init__(self, max_replies: int = 65536) -> None:
        self.max_replies = max_replies
        self._ids: OrderedDict[tuple, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, salt: str | None, prompt_ids: list[int], text: str, token_ids: list[int],
                 images: bytes = b"") -> None:
        """Keep ``token_ids``, the reply generated after ``prompt_ids`` (with the images whose digests, joined, are
        ``images``) and decoded to ``text``."""
        key = _key(salt, prompt_ids, text, images)
        with self._lock:
            self._ids[key] = list(token_ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.max_replies:
                self._ids.popitem(last=False)

    def lookup(self, salt: str | None, prompt_ids: list[int], text: str, images: bytes = b"") -> list[int] | None:
        """The ids of the reply ``text`` generated after ``prompt_ids`` (and ``images``), or None."""
        key = _key(salt, prompt_ids, text, images)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
            return ids


def _key(salt: str | None, prompt_ids: list[int], text: str, images: bytes) -> tuple:
    return salt, hashlib.sha256(array("q", prompt_ids).tobytes()).digest(), text, hashlib.sha256(images).digest()


class TextPieces:
    """How a conversation becomes text and the text ids: the tokenizer's chat template, then the tokenizer on each
    piece between the reply placeholders (:func:`spliced_prompt`). :class:`~hf_hybridcache.serve.image_chat` 's
    pieces hand each piece the images its image tokens stand for, and run the processor instead."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], template_kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs)

    def start(self) -> None:
        """A new rendering begins: its pieces follow."""

    def encode(self, text: str) -> list[int]:
        # The template writes the special tokens itself (as apply_chat_template(tokenize=True) encodes).
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def images_key(self) -> bytes:
        """The digests of the images of the pieces encoded since :meth:`start`, joined (none: ``b""``)."""
        return b""


def chat_prompt_ids(tokenizer, messages: list[dict], memory: ReplyMemory | None = None, salt: str | None = None,
                    **template_kwargs) -> list[int]:
    """The prompt ids of ``messages`` (``[{"role", "content"}]``, content a string) rendered with the tokenizer's chat
    template and a generation prompt, with the remembered ids of each assistant reply spliced in.

    Raises:
        ValueError: the tokenizer has no chat template (from transformers).
    """
    return spliced_prompt(TextPieces(tokenizer), messages, memory, salt, **template_kwargs)


def spliced_prompt(pieces: TextPieces, messages: list[dict], memory: ReplyMemory | None = None,
                   salt: str | None = None, **template_kwargs) -> list[int]:
    """:func:`chat_prompt_ids` with ``pieces`` rendering the conversation and encoding its pieces."""
    replies: list[list[int]] = []
    rendered: list[dict] = []
    for message in messages:
        ids = None
        if memory is not None and message["role"] == "assistant":
            # The prompt of the turn that generated this reply: the conversation before it, as rendered here.
            before = _spliced(pieces, rendered, replies, template_kwargs)
            ids = None if before is None else memory.lookup(salt, before, message["content"], pieces.images_key())
        if ids is None:
            rendered.append(message)
        else:
            rendered.append({**message, "content": _MARK.format(len(replies))})
            replies.append(ids)
    prompt = _spliced(pieces, rendered, replies, template_kwargs)
    if prompt is None:  # the template changed a reply's content: every reply is re-encoded from its text
        pieces.start()
        return pieces.encode(pieces.render(messages, template_kwargs))
    return prompt


def _spliced(pieces: TextPieces, rendered: list[dict], replies: list[list[int]],
             template_kwargs: dict) -> list[int] | None:
    """``rendered`` with a generation prompt, tokenized piece by piece around the reply placeholders, each replaced
    by its ids; None if a placeholder did not survive the template."""
    pieces.start()
    if not rendered:
        return []
    text = pieces.render(rendered, template_kwargs)
    prompt: list[int] = []
    for i, ids in enumerate(replies):
        before, mark, text = text.partition(_MARK.format(i))
        if not mark:
            return None
        prompt += pieces.encode(before) + ids
    return prompt + pieces.encode(text)
