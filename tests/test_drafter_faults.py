"""A drafter of the user's that returns what the engine cannot verify, or that two engines share: the request or the
second engine gets a sentence saying what to fix, and nothing else is lost (the other requests finish with their
greedy tokens, the engine keeps serving, the store stays consistent)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from engine_scenarios import config, finals, ids
from test_engine_speculative import FaultyDrafter, references

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store
from hf_hybridcache.engine import Draft, DraftModelDrafter, NgramDrafter, Speculation
from hf_hybridcache.toy import VOCAB_SIZE, build_model

K = 4
NEW_TOKENS = 10


def run(drafter, prompts: dict, generation=None) -> tuple[dict, bool]:
    """Every prompt through one manager speculating with ``drafter``, then one more prompt without anything bad;
    returns the outputs by name (the last one ``after``) and whether the loop was still running before it."""
    cache = HybridPrefixCache(build_model("jamba", seed=0))
    manager = cache.init_continuous_batching(generation or config(max_new_tokens=NEW_TOKENS, eos_token_id=-1),
                                             speculation=Speculation(drafter, K))
    manager.start()
    try:
        for name, prompt in prompts.items():
            manager.add_request(prompt, request_id=name)
        outputs = finals(manager, list(prompts))
        running = manager.is_running()
        manager.add_request(ids(19, seed=968), request_id="after")
        outputs.update(finals(manager, ["after"]))
    finally:
        manager.stop()
    check_store(cache)
    return outputs, running


@pytest.fixture(scope="module")
def reference():
    return references(build_model("jamba", seed=0), NEW_TOKENS)


PROMPTS = {"good": ids(20, seed=960), "bad": ids(21, seed=961)}


@pytest.mark.parametrize("bad", [5, "abc", {3: 4}, object()], ids=["int", "str", "dict", "object"])
def test_a_draft_that_is_not_a_list_of_tokens_fails_its_request_and_the_engine_goes_on(bad, reference):
    """Before, ``tuple(draft)`` raised a TypeError outside the per-request check and the engine loop died: every
    request failed and the manager stopped."""
    outputs, running = run(FaultyDrafter(reference, {"bad": bad}), PROMPTS)
    assert running
    assert "propose() returns, per request, a list of token ids, a Draft, or None" in outputs["bad"].error
    assert outputs["good"].error is None and outputs["good"].generated_tokens == reference(PROMPTS["good"])
    assert outputs["after"].generated_tokens == reference(ids(19, seed=968))


def test_none_is_no_draft(reference):
    outputs, running = run(FaultyDrafter(reference, {"bad": None}), PROMPTS)
    assert running
    for name, prompt in PROMPTS.items():
        assert outputs[name].error is None and outputs[name].generated_tokens == reference(prompt)


class HookFaults(FaultyDrafter):
    """Drafts each request's true continuation; its ``observe`` raises for the request ``bad`` (``wants_hidden_states``,
    as an MTP head's), its ``release`` and ``close`` for every request."""

    wants_hidden_states = True

    def __init__(self, reference) -> None:
        super().__init__(reference, {})
        self.closed = 0

    def observe(self, request, past, hidden):
        if request.request_id == "bad":
            raise RuntimeError("the head's cache broke")

    def release(self, request):
        raise RuntimeError("nothing to release")

    def close(self):
        self.closed += 1
        raise RuntimeError("closing broke")


def test_a_drafter_whose_observe_release_or_close_raise_fails_one_request_and_the_engine_goes_on(reference):
    """Before, each of these raised out of the step (or the engine's close) and the engine loop died, failing every
    request; now ``observe`` fails its request at the next step, ``release`` and ``close`` are logged, and the drafter
    serves the next manager."""
    drafter = HookFaults(reference)
    outputs, running = run(drafter, PROMPTS)
    assert running and drafter.closed == 1
    assert "The drafter HookFaults.observe raised RuntimeError: the head's cache broke" in outputs["bad"].error
    assert outputs["good"].error is None and outputs["good"].generated_tokens == reference(PROMPTS["good"])
    assert outputs["after"].generated_tokens == reference(ids(19, seed=968))
    again, _ = run(drafter, {"good": PROMPTS["good"]})
    assert again["good"].generated_tokens == reference(PROMPTS["good"]) and drafter.closed == 2


class ProbsDrafter(FaultyDrafter):
    """Drafts each request's true continuation as a :class:`Draft` whose ``probs`` are one-hot rows (a valid point
    mass), except for the request ``bad``, whose rows ``make(tokens)`` returns."""

    def __init__(self, reference, make) -> None:
        super().__init__(reference, {})
        self.make = make

    def propose(self, requests, num_tokens):
        drafts = []
        for request, tokens in zip(requests, super().propose(requests, num_tokens)):
            probs = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), VOCAB_SIZE).float()
            drafts.append(Draft(tuple(tokens), self.make(tokens) if request.request_id == "bad" else probs))
        return drafts


def _other_token(tokens):
    probs = torch.zeros(len(tokens), VOCAB_SIZE)
    probs[:, [(t + 1) % VOCAB_SIZE for t in tokens]] = 1.0 / len(tokens)
    return probs


BAD_PROBS = {
    "zeros": (lambda tokens: torch.zeros(len(tokens), VOCAB_SIZE), "not a probability distribution"),
    "nan": (lambda tokens: torch.full((len(tokens), VOCAB_SIZE), float("nan")), "not a probability distribution"),
    "negative": (lambda tokens: torch.full((len(tokens), VOCAB_SIZE), 2.0 / VOCAB_SIZE)
                 - torch.eye(len(tokens), VOCAB_SIZE) * (1.0 + 1.0 / VOCAB_SIZE), "not a probability distribution"),
    "token_has_zero": (lambda tokens: torch.stack([_other_token([t])[0] for t in tokens]), "probability 0"),
    "rows": (lambda tokens: torch.full((len(tokens) + 1, VOCAB_SIZE), 1.0 / VOCAB_SIZE), "must be ["),
    "width": (lambda tokens: torch.full((len(tokens), 10), 0.1), "must be ["),
    "ints": (lambda tokens: torch.ones(len(tokens), VOCAB_SIZE, dtype=torch.long), "float32 tensor"),
    "list": (lambda tokens: [[1.0 / VOCAB_SIZE] * VOCAB_SIZE] * len(tokens), "float32 tensor"),
}


@pytest.mark.parametrize("what", list(BAD_PROBS))
def test_draft_probs_that_are_not_the_drafts_distributions_fail_their_request(what, reference):
    """Before, rows of zeros (or NaN, or of the wrong length) were verified as given: at temperature 1 a draft token
    whose row gave it 0 came out at 20% against the model's 0.4%, silently; a row of the wrong width raised a bare
    size mismatch from the verify step."""
    make, expected = BAD_PROBS[what]
    outputs, running = run(ProbsDrafter(reference, make), PROMPTS)
    assert running
    assert "The drafter ProbsDrafter's Draft.probs" in outputs["bad"].error and expected in outputs["bad"].error
    assert outputs["good"].error is None and outputs["good"].generated_tokens == reference(PROMPTS["good"])
    assert outputs["after"].generated_tokens == reference(ids(19, seed=968))


def test_valid_draft_probs_are_verified(reference):
    """The check's other side: one-hot rows for every request pass, and greedy replies equal the cold ones."""
    outputs, _ = run(ProbsDrafter(reference, lambda tokens: torch.nn.functional.one_hot(
        torch.tensor(tokens, dtype=torch.long), VOCAB_SIZE).float()), PROMPTS)
    for name, prompt in PROMPTS.items():
        assert outputs[name].error is None and outputs[name].generated_tokens == reference(prompt)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_a_drafter_serves_one_running_engine(drafter, reference):
    """A second manager started with the drafter of a running one is refused with a sentence; the first keeps serving
    exactly, and once it stops the second starts and serves exactly. Before, the second started, and its requests
    failed with the draft model's internal errors (``list.remove(x): x not in list``)."""
    shared = NgramDrafter() if drafter == "ngram" else DraftModelDrafter(HybridPrefixCache(build_model("jamba",
                                                                                                       seed=0)))
    speculation = Speculation(shared, K)
    generation = config(max_new_tokens=NEW_TOKENS, eos_token_id=-1)
    first, second = (HybridPrefixCache(build_model("jamba", seed=0)).init_continuous_batching(
        generation, speculation=speculation) for _ in range(2))
    first.start()
    try:
        with pytest.raises(ValueError, match="already serves another running engine"):
            second.start()
        assert not second.is_running()
        first.add_request(PROMPTS["good"], request_id="one")
        assert finals(first, ["one"])["one"].generated_tokens == reference(PROMPTS["good"])
    finally:
        first.stop()
    second.start()
    try:
        second.add_request(PROMPTS["bad"], request_id="two")
        assert finals(second, ["two"])["two"].generated_tokens == reference(PROMPTS["bad"])
    finally:
        second.stop()


def test_the_docs_example_runs(capsys):
    """docs/speculative.md's first example, as written: n-gram lookup, a request that opts out, a draft model."""
    text = (Path(__file__).parents[1] / "docs" / "speculative.md").read_text(encoding="utf-8")
    exec(re.search(r"```python\n(from transformers import GenerationConfig.*?)```", text, re.S).group(1), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 4 and all(line.startswith("[") for line in (printed[0], printed[1], printed[3]))


class RollbackFaults:
    """A grammar of one's own (any object with ``matcher()``, ``eos_token_ids`` and ``vocab_size``) whose matcher
    allows every token and takes drafts (``try_accept``) but whose ``rollback`` raises."""

    eos_token_ids = frozenset()
    vocab_size = VOCAB_SIZE

    def matcher(self):
        return self

    def fill(self, bitmask, row: int) -> None:
        bitmask[row] = -1

    def accept(self, token: int) -> bool:
        return True

    def try_accept(self, token: int) -> bool:
        return True

    def rollback(self, num_tokens: int) -> None:
        raise RuntimeError("cannot roll back")


def test_a_grammar_whose_rollback_raises_fails_its_request_alone(reference):
    """A verify step rolls a grammar's matcher back over the drafts it masked; a ``rollback`` that raised escaped
    the per-request handling of the grammar's other calls (a sibling of the drafter faults above)."""
    cache = HybridPrefixCache(build_model("jamba", seed=0))
    manager = cache.init_continuous_batching(config(max_new_tokens=NEW_TOKENS, eos_token_id=-1),
                                             speculation=Speculation(FaultyDrafter(reference, {}), K))
    manager.start()
    try:
        manager.add_request(PROMPTS["bad"], request_id="bad", grammar=RollbackFaults())
        manager.add_request(PROMPTS["good"], request_id="good")
        outputs = finals(manager, list(PROMPTS))
        assert manager.is_running()
    finally:
        manager.stop()
    assert "The grammar raised RuntimeError: cannot roll back" in outputs["bad"].error
    assert outputs["good"].error is None and outputs["good"].generated_tokens == reference(PROMPTS["good"])
    check_store(cache)
