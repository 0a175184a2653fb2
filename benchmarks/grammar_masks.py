"""Which grammar library to put behind structured output: xgrammar, llguidance and outlines-core, side by side on this
CPU, for the toy byte vocabulary (262 tokens) and byte-level vocabularies of 32k and 128k tokens. Needs all three
(``pip install xgrammar llguidance outlines-core``; only llguidance is a dependency of the package, its ``structured``
extra).

    PYTHONPATH=. python benchmarks/grammar_masks.py [--vocabs 262 32000 128000] [--steps 64] [--batch 20]

Per library and vocabulary: the tokenizer setup (once per server), the compile of a small JSON schema and of "any JSON"
(once per request or per distinct schema), and the per-token cost of the engine's use: fill one row's token bitmask (p50
and p99 over a walk), fill 20 rows' bitmasks in one step (one by one, and with the library's batch call where it has
one: xgrammar's ``BatchGrammarMatcher``, llguidance's thread pool ``fill_next_token_bitmask_par``), and apply the masks
to ``[20, V]`` float32 logits (xgrammar's own applier; for llguidance and outlines-core
:func:`~hf_hybridcache.structured.apply_token_bitmask`, the engine's). The walk samples each token from random logits
under the mask (as a random toy model does) for ``--steps`` tokens, so the states are those a served model passes
through (inside strings, where most tokens are allowed, is the costly case for a large vocabulary). Last, the share of
random walks on the toy vocabulary whose JSON parses with ``json.loads`` (a random model is the adversarial case: it
emits any byte the mask allows, so a grammar that lets a raw control character into a string shows at once).

The large vocabularies are made in code (no downloads): the most frequent GPT-2-style byte-level pre-tokens of this
Python's standard library (words, identifiers with their leading space, punctuation runs) and, up to the size, their
most frequent prefixes, over the 256 byte tokens; a BPE model without merges (the libraries read only the tokens'
bytes). Training a real BPE of 128k tokens on the same text takes about 3 minutes here.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import statistics
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hf_hybridcache.structured import apply_token_bitmask
from hf_hybridcache.toy import SPECIAL_TOKENS, byte_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def large_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of ``vocab_size`` tokens from the standard library's text (see the module doc)."""
    pieces = collections.Counter()
    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False)
    stdlib = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(f"{stdlib}/*.py") + glob.glob(f"{stdlib}/*/*.py")):
        with open(path, encoding="utf-8", errors="replace") as file:
            pieces.update(p for p, _ in splitter.pre_tokenize_str(file.read()))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    prefixes = collections.Counter()
    for piece, count in pieces.items():
        for end in range(2, len(piece)):
            prefixes[piece[:end]] += count
    for piece, _ in [*pieces.most_common(), *prefixes.most_common()]:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema):
        return (self.compiler.compile_builtin_json_grammar() if schema is None
                else self.compiler.compile_json_schema(json.dumps(schema)))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int, vocab_size: int):
        return self.xgr.allocate_token_bitmask(rows, vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_all(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.torch_api = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema if schema is not None else {})
        self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, rows: int, vocab_size: int):
        return self.torch_api.allocate_token_bitmask(rows, vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.torch_api.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_all(self, matchers, bitmask) -> None:
        self.torch_api.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()

    def apply(self, logits, bitmask) -> None:
        apply_token_bitmask(logits, bitmask)  # the engine's (llguidance's own is a torch.compile kernel)


class OutlinesCore:
    """outlines-core: a regex from the schema, an index of every (DFA state, token) built ahead, then lookups."""

    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import outlines_core

        self.oc, self.vocab_size = outlines_core, vocab_size
        eos = tokenizer.eos_token_id
        byte_of = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        for token, i in tokenizer.get_vocab().items():  # byte-level symbols -> the bytes they stand for
            if i != eos and token not in SPECIAL_TOKENS:
                tokens.setdefault(bytes(byte_of[symbol] for symbol in token), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        # No "any JSON" grammar: outlines uses a bounded regex for JSON objects; a schema of any object stands in.
        regex = build_regex_from_schema(json.dumps(schema if schema is not None else {"type": "object"}))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def bitmask(self, rows: int, vocab_size: int):
        return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.write_mask_into(bitmask[row].data_ptr(), bitmask[row].numel(), bitmask.element_size())

    def fill_all(self, matchers, bitmask) -> None:
        for row, matcher in enumerate(matchers):
            self.fill(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        matcher.advance(token)
        return True

    def done(self, matcher) -> bool:
        return matcher.is_finished()

    def apply(self, logits, bitmask) -> None:
        apply_token_bitmask(logits, bitmask)


def walk(lib, compiled, vocab_size: int, steps: int, rows: int, seed: int = 0) -> dict:
    """``rows`` matchers advanced together for up to ``steps`` tokens, each token sampled from random logits under its
    row's mask; per-step times in ms. The library's batch call is timed in a second walk of its own (llguidance's
    thread pool keeps both cores busy for a while after each call, which would slow everything timed after it)."""
    one, loop, apply = [], [], []
    for matchers, bitmask, logits in _steps(lib, compiled, vocab_size, steps, rows, seed):
        start = time.perf_counter()
        lib.fill(matchers[0], bitmask, 0)
        one.append(time.perf_counter() - start)
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            lib.fill(matcher, bitmask, row)
        loop.append(time.perf_counter() - start)
        start = time.perf_counter()
        lib.apply(logits, bitmask[: len(matchers)])
        apply.append(time.perf_counter() - start)
    batch = []
    for matchers, bitmask, logits in _steps(lib, compiled, vocab_size, steps, rows, seed):
        start = time.perf_counter()
        lib.fill_all(matchers, bitmask[: len(matchers)])
        batch.append(time.perf_counter() - start)
        lib.apply(logits, bitmask[: len(matchers)])
    ms = [1000 * x for x in one]
    return {"tokens": len(one), "fill_p50": statistics.median(ms),
            "fill_p99": sorted(ms)[min(len(ms) - 1, int(0.99 * len(ms)))],
            "loop_fill": 1000 * statistics.median(loop), "batch_fill": 1000 * statistics.median(batch),
            "apply": 1000 * statistics.median(apply)}


def _steps(lib, compiled, vocab_size: int, steps: int, rows: int, seed: int):
    """Yields ``(live matchers, bitmask, logits)`` per step; the caller fills the masks and applies them to the logits,
    then each live matcher takes a token sampled from its row."""
    generator = torch.Generator().manual_seed(seed)
    matchers = [lib.matcher(compiled) for _ in range(rows)]
    bitmask = lib.bitmask(rows, vocab_size)
    for _ in range(steps):
        live = [m for m in matchers if not lib.done(m)]
        if not live:
            return
        logits = torch.randn(len(live), vocab_size, generator=generator)
        yield live, bitmask, logits
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0].tolist()
        for matcher, token in zip(live, tokens):
            assert lib.accept(matcher, token), f"{lib.name} refused a token its own mask allowed"


def parse_rate(lib, tokenizer, vocab_size: int, walks: int) -> tuple[int, int]:
    """Of ``walks`` random walks under a one-string schema (to the grammar's end, at most 200 tokens): how many
    decode to valid UTF-8 and parse with ``json.loads`` (strict: no raw control characters in strings)."""
    byte_of = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"],
              "additionalProperties": False}
    compiled = lib.compile(schema)
    parsed = 0
    for seed in range(walks):
        generator, matcher = torch.Generator().manual_seed(seed), lib.matcher(compiled)
        bitmask, tokens = lib.bitmask(1, vocab_size), []
        while not lib.done(matcher) and len(tokens) < 200:
            lib.fill(matcher, bitmask, 0)
            logits = torch.randn(1, vocab_size, generator=generator)
            lib.apply(logits, bitmask)
            tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
            lib.accept(matcher, tokens[-1])
        pieces = tokenizer.convert_ids_to_tokens([t for t in tokens if t != tokenizer.eos_token_id])
        try:
            json.loads(bytes(byte_of[c] for piece in pieces for c in piece).decode("utf-8"))
            parsed += 1
        except (UnicodeDecodeError, ValueError, KeyError):
            pass
    return parsed, walks


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return value, 1000 * (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[262, 32000, 128000])
    parser.add_argument("--libraries", nargs="+", default=["xgrammar", "llguidance", "outlines-core"])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--walks", type=int, default=100, help="random walks of the parse check (toy vocabulary)")
    args = parser.parse_args(argv)
    libraries = {lib.name: lib for lib in (XGrammar, LLGuidance, OutlinesCore)}
    for name in args.libraries:  # imports (seconds: llguidance.torch imports torch's compiler) are not setup time
        libraries[name](byte_tokenizer(), len(SPECIAL_TOKENS) + 256)
    print(f"torch threads {torch.get_num_threads()}; {args.steps} steps, batch {args.batch}; times in ms\n")
    print("| vocab | library | tokenizer setup | compile schema | compile any JSON | walk tokens | "
          f"fill 1 row p50 / p99 | fill {args.batch} rows one by one / batch call | apply [{args.batch}, V] |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for vocab_size in args.vocabs:
        tokenizer = byte_tokenizer() if vocab_size == len(SPECIAL_TOKENS) + 256 else large_tokenizer(vocab_size)
        for name in args.libraries:
            lib, setup = timed(libraries[name], tokenizer, vocab_size)
            compiled, compile_ms = timed(lib.compile, SCHEMA)
            _, any_ms = timed(lib.compile, None)
            run = walk(lib, compiled, vocab_size, args.steps, args.batch)
            print(f"| {vocab_size:,} | {name} | {setup:.0f} | {compile_ms:.1f} | {any_ms:.1f} | {run['tokens']} | "
                  f"{run['fill_p50']:.3f} / {run['fill_p99']:.3f} | {run['loop_fill']:.3f} / {run['batch_fill']:.3f} | "
                  f"{run['apply']:.3f} |", flush=True)
    print(f"\nJSON that parses, of {args.walks} random walks under {{s: string, maxLength 8}} (toy vocabulary):")
    for name in args.libraries:
        lib = libraries[name](byte_tokenizer(), len(SPECIAL_TOKENS) + 256)
        parsed, walks = parse_rate(lib, byte_tokenizer(), len(SPECIAL_TOKENS) + 256, args.walks)
        print(f"- {name}: {parsed} of {walks}", flush=True)


if __name__ == "__main__":
    main()
