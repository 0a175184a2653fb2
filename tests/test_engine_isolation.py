"""A forward that raises is isolated by bisection into probe groups with a retry budget per request
(:mod:`hf_hybridcache.engine.isolation`): only the request that makes a forward raise fails, the others of that
forward equal themselves alone and finish about as early as without it, and a request arriving just after it is not
held behind the probes. A request whose decode steps raise while its recompute (a prefill) does not fails within its
budget (issue 43); a grammar that raises fails its request alone, recomputing no one.

The engine is driven step by step from the test (no loop thread), so its step counts are exact."""

import math

import pytest
import torch
from engine_scenarios import alone, config, ids

from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.core import check_store
from hf_hybridcache.engine import EngineLimits
from hf_hybridcache.engine.engine import Engine
from hf_hybridcache.engine.isolation import RETRY_BUDGET
from hf_hybridcache.engine.requests import EngineRequest
from hf_hybridcache.engine.runner import StepRunner

pytestmark = pytest.mark.parametrize("family", ["jamba", "qwen3_5_text", "lfm3"])

POISON = [9, 7, 11]  # a run of tokens only the poisoned prompts hold: a forward that feeds it raises
NEW_TOKENS = 8
MAX_STEPS = 200


@pytest.fixture
def poisoned(model):
    """``model``, whose forward raises when its tokens hold :data:`POISON`."""

    def raise_on_poison(module, args):
        tokens = args[0][0].tolist()
        if any(tokens[i : i + 3] == POISON for i in range(len(tokens) - 2)):
            raise RuntimeError("poisoned input")

    handle = model.get_input_embeddings().register_forward_pre_hook(raise_on_poison)
    yield model
    handle.remove()


class Served:
    """``prompts`` served together by a fresh engine of ``cache``, stepped until it has no work; ``late`` (a prompt)
    is added right after the first step that preempted requests (a forward of several raised). ``new_tokens``: name ->
    its ``max_new_tokens`` (else :data:`NEW_TOKENS`); ``grammars``: name -> the grammar matcher it follows.

    Attributes:
        engine: the engine (``steps``: steps that ran a forward; ``forwards``: forwards run).
        speculating: its steps verify drafts (the manager's speculation, tests/speculation_runs.py).
        requests: name -> its request (``late`` for the late one).
        first_token, finished: name -> the step after which it had its first token / was finished.
        admissions: name -> how many times it was admitted (1 + its recomputes).
        late_added: the steps run when ``late`` was added.
    """

    def __init__(self, cache, prompts: dict[str, list[int]], late: list[int] | None = None,
                 new_tokens: dict[str, int] | None = None, grammars: dict | None = None) -> None:
        cache.clear()
        manager = cache.init_continuous_batching(config(NEW_TOKENS), limits=EngineLimits())  # routes the model
        runner = StepRunner(cache.model, manager.processors, do_sample=False, return_logprobs=False, seed=0)
        # the manager's speculation (tests/speculation_runs.py's spec runs), so these runs verify drafts too
        self.engine = engine = Engine(cache, manager.limits, runner, manager.speculation)
        self.speculating = manager.speculation is not None
        new_tokens = new_tokens or {}
        self.requests = {name: EngineRequest(name, prompt, new_tokens.get(name, NEW_TOKENS),
                                             grammar=(grammars or {}).get(name)) for name, prompt in prompts.items()}
        self.first_token: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.admissions: dict[str, int] = {}
        self.late_added = None
        admit = engine.admit

        def counted_admit(request):
            admitted = admit(request)
            self.admissions[request.request_id] = self.admissions.get(request.request_id, 0) + admitted
            return admitted

        engine.admit = counted_admit
        for request in self.requests.values():
            engine.add(request)
        with torch.no_grad():
            while engine.has_work and engine.steps < MAX_STEPS:
                engine.step()
                if late is not None and self.late_added is None and engine.preempted:
                    self.requests["late"] = EngineRequest("late", late, new_tokens.get("late", NEW_TOKENS))
                    engine.add(self.requests["late"])
                    self.late_added = engine.steps
                for name, request in self.requests.items():
                    if request.generated:
                        self.first_token.setdefault(name, engine.steps)
                    if request.is_finished:
                        self.finished.setdefault(name, engine.steps)
        assert not engine.has_work, f"the requests did not finish within {MAX_STEPS} steps"
        assert engine.slots.num_free == engine.slots.num_slots
        engine.close()


def innocents(count: int, seed: int) -> dict[str, list[int]]:
    return {f"g{i}": ids(24 + 3 * i, seed=seed + i) for i in range(count)}


def check_outputs(served: Served, cold_model, good: dict[str, list[int]], bad: list[str], error: str = "poisoned input",
                  new_tokens: int = NEW_TOKENS) -> None:
    """The ``bad`` requests failed with ``error``; every other one equals itself alone (greedy, no cache, no EOS)."""
    for name in bad:
        assert error in served.requests[name].error, name
    for name, prompt in good.items():
        request = served.requests[name]
        assert request.error is None, (name, request.error)
        assert request.generated == alone(cold_model, prompt, new_tokens, eos_token_id=-1), name


def test_one_poisoned_request_among_five_fails_alone_and_delays_no_one(poisoned, cold_model):
    cache = HybridPrefixCache(poisoned)
    good = innocents(4, seed=960)
    clean = Served(cache, good)
    assert clean.engine.preempted == 0 and max(clean.finished.values()) == clean.engine.steps
    assert clean.engine.steps == NEW_TOKENS or clean.speculating and clean.engine.steps < NEW_TOKENS
    check_store(cache)

    prompts = {"g0": good["g0"], "g1": good["g1"], "bad": [10, *POISON, 12], "g2": good["g2"], "g3": good["g3"]}
    served = Served(cache, prompts)
    check_outputs(served, cold_model, good, ["bad"])
    # the old way (each request of the forward that raised recomputed alone, one at a time) took 34 steps here
    last = max(served.finished[name] for name in good)
    assert last <= 1.5 * clean.engine.steps, (last, clean.engine.steps)
    # bisection: about log2(5) forwards more than steps (one per probe group running beside the shared forward)
    assert served.engine.forwards - served.engine.steps <= 2 * math.ceil(math.log2(len(prompts)))
    check_store(cache)


def test_a_request_arriving_after_a_forward_raised_is_not_held_behind_the_probes(poisoned, cold_model):
    cache = HybridPrefixCache(poisoned)
    good = innocents(4, seed=970)
    prompts = {"g0": good["g0"], "bad": [10, *POISON, 12], "g1": good["g1"], "g2": good["g2"], "g3": good["g3"]}
    late = ids(3, seed=979)
    served = Served(cache, prompts, late=late)
    assert served.late_added == 1  # the first step's forward raised
    # it runs in the next step's shared forward (the old way: after every suspect had run alone, 27 steps later)
    assert served.first_token["late"] - served.late_added <= 2
    check_outputs(served, cold_model, {**good, "late": late}, ["bad"])
    check_store(cache)


def test_two_poisoned_requests_among_six_both_fail_and_the_rest_are_exact(poisoned, cold_model):
    cache = HybridPrefixCache(poisoned)
    good = innocents(4, seed=980)
    clean_steps = Served(cache, good).engine.steps
    prompts = {"g0": good["g0"], "bad0": [10, *POISON, 12], "g1": good["g1"],
               "g2": good["g2"], "bad1": [13, 14, *POISON], "g3": good["g3"]}
    served = Served(cache, prompts)
    check_outputs(served, cold_model, good, ["bad0", "bad1"])
    last = max(served.finished[name] for name in good)
    assert last <= 1.5 * clean_steps, (last, clean_steps)  # the old way: 35 steps
    check_store(cache)


class BadDecodes:
    """A forward pre-hook on ``model`` that, while ``armed``, raises when the forward holds a decode step (or a verify
    step: its last token and drafts) of the request ``bad`` once it has ``after`` tokens (from its 6th token on): a
    prefill of it (its recompute) does not raise. ``raises``: the request names of each forward that raised."""

    def __init__(self, model, after: int = 5) -> None:
        self.armed, self.after, self.raises = False, after, []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        self._cache_kwarg = _compat.cache_kwarg(model)

    def _hook(self, module, args, kwargs):
        plan = getattr(kwargs.get(self._cache_kwarg), "plan", None)
        segments = [] if plan is None or not self.armed else plan.segments
        if any(s.request.request_id == "bad" and (s.is_decode or s.draft) and len(s.request.generated) >= self.after
               for s in segments):
            self.raises.append(sorted(s.request.request_id for s in segments))
            raise RuntimeError("bad decode")

    def remove(self) -> None:
        self._handle.remove()


def test_a_request_whose_decode_steps_raise_fails_within_its_budget(model, cold_model):
    """Issue 43's scenario: ``bad`` makes every decode forward it is in raise from its 6th token on while its
    recompute (a prefill) succeeds, beside three innocent requests, and one arrives just after the first raise. Before
    the budget (a suspect rejoined the shared forward after its recompute) it finished with no error or failed only
    when bisection happened to leave it alone, after 6-9 raising forwards that recomputed each innocent 6-7 times and
    finished them 6-8 steps late (jamba, qwen3_5_text)."""
    hook = BadDecodes(model)
    cache = HybridPrefixCache(model)
    good = innocents(3, seed=990)
    prompts = {"g0": good["g0"], "g1": good["g1"], "bad": ids(22, seed=993), "g2": good["g2"]}
    lengths = {**dict.fromkeys([*good, "late"], 16), "bad": 12}  # the innocents outlive it: it is never left alone
    try:
        clean = Served(cache, prompts, new_tokens=lengths)
        hook.armed = True
        served = Served(cache, prompts, late=ids(9, seed=994), new_tokens=lengths)
    finally:
        hook.remove()
    assert clean.engine.isolation.raised_forwards == 0
    assert clean.engine.steps == 16 or clean.speculating and clean.engine.steps < 16
    # it fails with its own error, alone, after at most its budget of raises beside others
    assert served.requests["bad"].error == "RuntimeError: bad decode"
    assert hook.raises[-1] == ["bad"] and len(hook.raises) <= RETRY_BUDGET + 1, hook.raises
    assert served.engine.isolation.raised_forwards == len(hook.raises)
    # each innocent is recomputed at most the budget's times and finishes within it of its undisturbed finish
    for name in good:
        assert served.admissions[name] - 1 <= RETRY_BUDGET, (name, served.admissions)
        # a suspect decodes plainly until it leaves its probe group (docs/speculative.md), so with speculation the
        # bound is a token a step from the first, not the speculating run's finish
        undisturbed = lengths[name] if served.speculating else clean.finished[name]
        assert served.finished[name] <= undisturbed + RETRY_BUDGET, (name, served.finished, clean.finished)
    # the late one is never in a forward that raises and is not held behind the probes: the engine keeps serving
    assert served.late_added is not None and not any("late" in names for names in hook.raises)
    assert served.admissions["late"] == 1 and served.first_token["late"] - served.late_added <= 2
    check_outputs(served, cold_model, {**good, "late": ids(9, seed=994)}, ["bad"], "bad decode", new_tokens=16)
    check_store(cache)


class RaisingMatcher:
    """A grammar matcher that allows every token and raises at its mask once it has taken ``after`` tokens."""

    eos_token_ids = frozenset()

    def __init__(self, vocab_size: int, after: int) -> None:
        self.vocab_size, self.after, self.tokens = vocab_size, after, []

    def fill(self, bitmask, row: int) -> None:
        if len(self.tokens) >= self.after:
            raise RuntimeError("the matcher lost its state")

    def accept(self, token: int) -> bool:
        self.tokens.append(token)
        return True


def test_a_grammar_that_raises_fails_its_request_alone_and_recomputes_no_one(model, cold_model):
    """A grammar's mask that raises (at a decode row here) is its request's fault: it fails in that step, and the
    other rows of the forward keep their tokens (before: the whole forward failed and was bisected, recomputing the
    others)."""
    cache = HybridPrefixCache(model)
    good = innocents(3, seed=1000)
    prompts = {"g0": good["g0"], "bad": ids(22, seed=1003), "g1": good["g1"], "g2": good["g2"]}
    clean = Served(cache, prompts)
    matcher = RaisingMatcher(model.get_input_embeddings().num_embeddings, after=5)
    served = Served(cache, prompts, grammars={"bad": matcher})
    bad = served.requests["bad"]
    assert bad.error == "The grammar raised RuntimeError: the matcher lost its state" and len(bad.generated) == 5
    assert served.engine.isolation.raised_forwards == 0 and served.engine.preempted == 0
    assert served.admissions == dict.fromkeys(prompts, 1)
    assert {name: served.finished[name] for name in good} == {name: clean.finished[name] for name in good}
    check_outputs(served, cold_model, good, [])
    check_store(cache)
