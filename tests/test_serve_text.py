"""The server's streamed text (:class:`~hf_hybridcache.serve.text.TextStream`): decoding only the ids after the last
final piece gives, piece by piece, the text that decoding every id so far gives, on random ids (multi-byte
characters split across tokens, invalid UTF-8, special tokens between the bytes of a character), in random chunk
sizes (a verified draft delivers several ids at once), with and without stop strings."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from benchmarks.llama_cpp import letter_tokenizer
from hf_hybridcache._compat.tokenizers import split_decoding
from hf_hybridcache.serve.text import TextStream
from hf_hybridcache.toy import byte_tokenizer


class WholeDecode:
    """The tokenizer behind a face that is not a fast tokenizer: TextStream decodes every id each call (the
    reference)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def byte_fallback_tokenizer(strip: bool = False) -> PreTrainedTokenizerFast:
    """Llama-style: specials, the 256 ``<0xNN>`` byte tokens, a few words and letters; ``strip``: Llama 2's decoder,
    which strips the text's first space (not splittable)."""
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁the", "a", "é", "▁x", "ß", "中"]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + pieces)}, merges=[],
                                   unk_token="<unk>", byte_fallback=True))
    parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(parts + ([decoders.Strip(" ", 1, 0)] if strip else []))
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def cleaning(tokenizer, force: bool):
    """``tokenizer`` with ``clean_up_tokenization_spaces`` on (a BPE tokenizer gets it only when ``force``d)."""
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = force
    return tokenizer


#: name: (the tokenizer, whether its ids can split a character); "letters" is the llama-server benchmarks' tokenizer
TOKENIZERS = {"byte-level": (byte_tokenizer, True), "byte-fallback": (byte_fallback_tokenizer, True),
              "letters": (lambda: letter_tokenizer(300), False),
              "strip (whole decode)": (lambda: byte_fallback_tokenizer(True), True),
              "byte-level asking for a clean-up (ignored for BPE)": (lambda: cleaning(byte_tokenizer(), False), True),
              "byte-level, clean-up forced (whole decode)": (lambda: cleaning(byte_tokenizer(), True), True)}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    make, splits_characters = TOKENIZERS[request.param]
    tokenizer = make()
    tokenizer.test_splits_characters = splits_characters
    return tokenizer


def random_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Ids of text with multi-byte characters, random ids (lone bytes of a character: invalid UTF-8) and specials."""
    text = "".join(rng.choice(["a", " the", "é", "中", "😀", "ß", "x", "\n", " .", " 's"]) for _ in range(length))
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = tokenizer.all_special_ids
    for _ in range(length // 4):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([rng.randrange(len(tokenizer)), rng.choice(specials)]))
    return ids


def rewrites(tokenizer, ids: list[int]) -> bool:
    """Whether decoding more of ``ids`` changes text already decoded (byte fallback's run that turns invalid)."""
    texts = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
    return any(not later.startswith(earlier.rstrip("\ufffd")) for earlier, later in zip(texts, texts[1:]))


def stream(tokenizer, ids: list[int], stop: list[str], rng: random.Random) -> tuple:
    """The pieces of ``ids`` arriving in chunks of 1-5 ids (the same chunks for every ``rng`` of one seed), whether a
    stop string ended them and the ids counted."""
    text, pieces, end = TextStream(tokenizer, stop), [], 0
    while end < len(ids) and not text.stopped:
        end = min(len(ids), end + rng.randint(1, 5))
        pieces.append(text.update(ids[:end], end == len(ids)))
    return pieces, text.stopped, text.stop_tokens


@pytest.mark.parametrize("with_stop", [False, True])
def test_pieces_equal_decoding_every_id_so_far(tokenizer, with_stop):
    splits = 0
    for seed in range(40):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, rng.randint(1, 40))
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        splits += "\ufffd" in whole
        start = rng.randrange(len(whole) + 1)
        stop = [whole[start:start + rng.randint(1, 3)], "zz"] if with_stop else []
        pieces, stopped, stop_tokens = stream(tokenizer, ids, stop, random.Random(seed))
        reference, *ended = stream(WholeDecode(tokenizer), ids, stop, random.Random(seed))
        assert (stopped, stop_tokens) == tuple(ended), (seed, ids)
        split, rewritten = split_decoding(tokenizer) is not None, rewrites(tokenizer, ids)
        if not rewritten:
            assert "".join(pieces) == "".join(reference), (seed, ids)
            assert pieces == reference or split, (seed, ids)  # a split decode holds open runs a little longer
        if not stopped and (split or not rewritten):  # nothing sent was rewritten on the way
            assert "".join(pieces) == whole, (seed, ids)
    assert splits >= 5 or not tokenizer.test_splits_characters  # the ids broke characters apart often enough


def test_a_byte_run_that_turns_invalid_does_not_silence_the_stream():
    """ByteFallback decodes a run of byte tokens together: ``<0xC3><0xA9>`` is "é", one more ``<0xA9>`` makes the
    whole run three U+FFFD. The stream holds an open run's text back (before, it sent "é" and then, its text no longer
    starting with what was sent, nothing more: the reply ended at "é"); a tokenizer decoded whole each time goes on
    after the characters already sent."""
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "<0xA9>", "a", "▁the"])
    for face, expected in ((tokenizer, "\ufffd\ufffd\ufffda the"), (WholeDecode(tokenizer), "é\ufffd\ufffda the")):
        text = TextStream(face, [])
        pieces = [text.update(ids[:n], n == len(ids)) for n in range(1, len(ids) + 1)]
        assert "".join(pieces) == expected, pieces
