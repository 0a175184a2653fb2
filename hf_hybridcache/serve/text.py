"""Generated token ids -> the text a client sees, streamed in pieces, with OpenAI's ``stop`` strings."""

from __future__ import annotations


class TextStream:
    """Decodes a growing list of generated ids and hands out the new text since the last call.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or could be the start of a stop string,
    so that a streamed piece is never taken back. When a stop string appears, the text ends before it.

    Args:
        tokenizer: decodes ids (special tokens skipped).
        stop: OpenAI's ``stop`` strings (up to 4).
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.sent = ""
        self.stopped = False

    def update(self, token_ids: list[int], finished: bool) -> str:
        """The text not sent yet, given all ``token_ids`` generated so far; sets :attr:`stopped` when a stop string
        ended it (nothing is sent after that)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, ready = True, text[:cut]
        elif finished:
            ready = text
        else:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            ready = text[: len(text) - hold] if hold else text
            ready = ready.rstrip("\ufffd")
        new = ready[len(self.sent):] if ready.startswith(self.sent) else ""
        self.sent += new
        return new
