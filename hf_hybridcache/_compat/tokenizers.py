"""Whether a tokenizer's ``decode`` can be taken in pieces: the server's streamed text decodes only the ids after the
last point where the text so far can no longer change (:class:`~hf_hybridcache.serve.text.TextStream`).

transformers' fast tokenizer decodes with the ``tokenizers`` backend and then, when ``clean_up_tokenization_spaces``
is on (and the backend is not BPE, or insists), rewrites spaces across the whole text (``TokenizersBackend._decode``);
a subclass may override ``_decode``.
Only the plain path (no override, no clean-up) is splittable, and then only for the backend decoders whose output is
a concatenation of per-token pieces:

- ``ByteLevel`` (GPT-2, Llama 3, Qwen, the package's byte tokenizer): the tokens' bytes are joined and decoded as
  UTF-8 with replacement, so the text of ``a + b`` is the text of ``a`` then that of ``b`` whenever ``a``'s text
  ends in a whole character (not U+FFFD).
- a ``Sequence`` of single-character ``Replace``, ``ByteFallback`` and ``Fuse`` (Llama-style byte fallback without
  a ``Strip``): the same, and a run of ``<0xNN>`` byte tokens is decoded as a whole (one U+FFFD per byte when it is
  not valid UTF-8), so ``a`` must also not end in a byte token or in a special token (skipped: a run of byte
  tokens goes on across it).
"""

from __future__ import annotations

import json
import re

from transformers import PreTrainedTokenizerFast

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def split_decoding(tokenizer) -> frozenset[int] | None:
    """The ids a decoded piece must not end in to be final (``ByteFallback``'s byte and special tokens; none for
    ``ByteLevel``), or None when ``tokenizer.decode(ids, skip_special_tokens=True)`` cannot be taken in pieces (see
    the module docstring): the caller then decodes all ids each time."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if type(tokenizer)._decode is not PreTrainedTokenizerFast._decode:
        return None
    if _cleans_up(tokenizer):
        return None
    backend = tokenizer.backend_tokenizer.decoder
    decoder = {} if backend is None else json.loads(backend.__getstate__())  # its JSON, as tokenizer.json holds it
    if decoder.get("type") == "ByteLevel":
        return frozenset()
    if decoder.get("type") != "Sequence" or not all(_per_token(part) for part in decoder.get("decoders", [])):
        return None
    # A run of byte tokens stays open across the special tokens that decoding skips.
    skipped = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(i for token, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(token) or i in skipped)


def _per_token(decoder: dict) -> bool:
    if decoder.get("type") == "Replace":
        pattern = decoder.get("pattern", {})
        return len(pattern.get("String", "")) == 1  # a piece of one token never meets the next token's
    return decoder.get("type") in ("ByteFallback", "Fuse")


def _cleans_up(tokenizer) -> bool:
    """Whether ``decode`` rewrites spaces across the text: ``clean_up_tokenization_spaces``, which transformers
    5.23 - 5.25 ignore for a BPE backend unless the tokenizer sets
    ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` (Llama 3's tokenizer asks for the
    clean-up and gets none)."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return not bpe or bool(forced)
