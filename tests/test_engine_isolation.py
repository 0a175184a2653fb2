"""A forward that raises is isolated by bisection into probe groups (:mod:`hf_hybridcache.engine.isolation`): only the
request that makes a forward raise fails, the others of that forward equal themselves alone and finish about as
early as without it, and a request arriving just after it is not held behind the probes.

The engine is driven step by step from the test (no loop thread), so its step counts are exact."""

import math

import pytest
import torch
from engine_scenarios import alone, config, ids

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store
from hf_hybridcache.engine import EngineLimits
from hf_hybridcache.engine.engine import Engine
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
    is added right after the first step that preempted requests (a forward of several raised).

    Attributes:
        engine: the engine (``steps``: steps that ran a forward; ``forwards``: forwards run).
        requests: name -> its request (``late`` for the late one).
        first_token, finished: name -> the step after which it had its first token / was finished.
        late_added: the steps run when ``late`` was added.
    """

    def __init__(self, cache, prompts: dict[str, list[int]], late: list[int] | None = None) -> None:
        cache.clear()
        manager = cache.init_continuous_batching(config(NEW_TOKENS), limits=EngineLimits())  # routes the model
        runner = StepRunner(cache.model, manager.processors, do_sample=False, return_logprobs=False, seed=0)
        self.engine = engine = Engine(cache, manager.limits, runner)
        self.requests = {name: EngineRequest(name, prompt, NEW_TOKENS) for name, prompt in prompts.items()}
        self.first_token: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.late_added = None
        for request in self.requests.values():
            engine.add(request)
        with torch.no_grad():
            while engine.has_work and engine.steps < MAX_STEPS:
                engine.step()
                if late is not None and self.late_added is None and engine.preempted:
                    self.requests["late"] = EngineRequest("late", late, NEW_TOKENS)
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


def check_outputs(served: Served, cold_model, good: dict[str, list[int]], bad: list[str]) -> None:
    """The ``bad`` requests failed on the poison; every other one equals itself alone (greedy, no cache, no EOS)."""
    for name in bad:
        assert "poisoned input" in served.requests[name].error, name
    for name, prompt in good.items():
        request = served.requests[name]
        assert request.error is None, (name, request.error)
        assert request.generated == alone(cold_model, prompt, NEW_TOKENS, eos_token_id=-1), name


def test_one_poisoned_request_among_five_fails_alone_and_delays_no_one(poisoned, cold_model):
    cache = HybridPrefixCache(poisoned)
    good = innocents(4, seed=960)
    clean = Served(cache, good)
    assert clean.engine.preempted == 0 and max(clean.finished.values()) == clean.engine.steps == NEW_TOKENS
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
