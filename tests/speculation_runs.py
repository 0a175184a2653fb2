"""The engine and server exactness tests run twice: plainly and with speculation on (issue 44: greedy tokens with
speculation equal cold runs, fp32, every family).

A test of a module in :data:`SPECULATION_MODULES` is parametrized by the module-scoped fixture ``speculation``
(``plain`` / ``spec``). With ``spec``, through public seams only:

- every manager a cache builds (``cache.init_continuous_batching``, and through it ``model.init_continuous_batching``,
  ``generate_batch``, ``continuous_batching_context_manager``) speculates by default with :class:`MixedDrafter`,
  ``k = 4``; a test that passes its own ``speculation=`` keeps it;
- a server made from its command line with :func:`serve_flags` (test_serve_images' server) runs with
  ``--speculative ngram --num-speculative-tokens 4`` (n-gram lookup keeps few drafts on the toy models' replies);
- every other server's :class:`~hf_hybridcache.serve.EngineBackend` (``EngineBackend(cache, ...)`` or
  ``make_app(parse_args([...]))`` given no speculation) speculates with :class:`MixedDrafter`, ``k = 4``, as
  managers do.

The modules whose tests run a few families each run their ``spec`` runs on :data:`SPEC_FAMILIES` (the others are
deselected). Tests that never reach the engine (refused requests, ``--no-cache``) and bf16 tests stay plain
(``@pytest.mark.plain_only(reason)``): issue 44's bar is fp32, and a bf16 verify step rounds like a prefill
(docs/speculative.md, "What stays exact").

A module-scoped fixture that builds a manager or a server must ask for ``speculation`` too, so it is built again for
the ``spec`` runs. Every verify step is counted (``SpeculationStats.count``): each test's drafted and kept tokens go
into its report, the run's summary adds them up and names the ``spec`` tests that verified no draft, and a run whose
``spec`` tests verified at least :data:`MIN_DRAFTS_CHECKED` drafts fails unless some were kept and some rejected (so
both paths of the rollback ran).
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.engine import NgramDrafter, Speculation, SpeculationStats

#: The exactness tests of the engine and the server (they compare greedy tokens with cold generate() runs).
SPECULATION_MODULES = {
    "test_engine_families", "test_engine_faults", "test_engine_generation_fields", "test_engine_isolation",
    "test_engine_reentry", "test_engine_scoring", "test_engine_serving", "test_engine_vision",
    "test_structured_engine", "test_serve", "test_serve_completions", "test_serve_images", "test_serve_lifecycle",
}
#: With speculation on, the modules whose tests run a few families each run these only: the families' rollbacks are
#: test_engine_families' (every family) and test_engine_speculative's; these modules' scenarios (preemption, faults,
#: clear(), scoring, grammars, streaming, sampling) do not depend on the family, and every family more adds about a
#: minute to the suite. Vision-language wrappers: those of under 5 s each (their text models are all in
#: test_engine_families).
SPEC_FAMILIES = {"test_engine_families": None, "test_engine_vision": {"qwen3_5", "lfm2_vl", "lfm3_vl",
                                                                      "nemotron_h_omni"}}
DEFAULT_SPEC_FAMILIES = {"jamba"}
#: Draft tokens per request and step with speculation on.
NUM_SPECULATIVE_TOKENS = 4
#: The server flags of the ``spec`` runs.
SERVE_FLAGS = ["--speculative", "ngram", "--num-speculative-tokens", str(NUM_SPECULATIVE_TOKENS)]
#: Below this many drafts in a run's ``spec`` tests (a targeted run of a few tests) kept and rejected are not checked.
MIN_DRAFTS_CHECKED = 200

_counted = {"segments": 0, "drafted": 0, "accepted": 0}


class MixedDrafter(NgramDrafter):
    """Drafts of which a step keeps 0 to ``k`` (both paths of the rollback): the model's own greedy continuation of the
    request (``generate()`` without a cache, :data:`AHEAD` tokens at a time, computed again from where the request's
    tokens left it: a sampled request, a grammar's), of which the first ``c`` tokens are proposed as they are and the
    rest changed into other tokens, ``c`` drawn in ``0 .. k`` by a generator seeded with the request's tokens. Drafts depend on a request's
    tokens only, as a seeded request's must (its draws follow its drafts). Where that continuation cannot be computed
    (a vision-language wrapper's placeholder ids without their images), or a request left it too often, n-gram
    lookup topped up with tokens drawn from the request's own."""

    #: Continuations computed again at most, per request, after its tokens left the first.
    MAX_RECOMPUTED = 2
    #: Tokens computed ahead at a time (a request of many tokens does not hold the engine's thread for long).
    AHEAD = 8

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.continuations: dict[object, tuple[list[int], int]] = {}

    def start(self, engine) -> None:
        self.model, self.vocab_size = engine.cache.model, engine.cache.model.get_input_embeddings().num_embeddings

    def propose(self, requests, num_tokens):
        return [self._draft(request, n) for request, n in zip(requests, num_tokens)]

    def _draft(self, request, n: int) -> list[int]:
        tokens = request.tokens
        rng = random.Random(len(tokens) * 1_000_003 + sum(tokens[-4:]))
        known = self._continuation(request, tokens, n)
        if known is None:
            draft = self.lookup(request, tokens, n)
            return draft + [rng.choice(tokens) for _ in range(n - len(draft))]
        right = rng.randint(0, n)
        return known[:right] + [(t + 1) % self.vocab_size for t in known[right:n]]

    def _continuation(self, request, tokens: list[int], n: int) -> list[int] | None:
        """The greedy tokens after ``tokens``, at least ``n`` where the request may still emit them (None: not
        computed), from the request's continuation while it still follows it, extended :data:`AHEAD` at a time."""
        whole, recomputed = self.continuations.get(request, (None, 0))
        follows = whole is not None and whole[: len(tokens)] == tokens
        if follows and len(whole) - len(tokens) >= n:
            return whole[len(tokens):]
        if not follows:
            if recomputed > self.MAX_RECOMPUTED:
                return None
            recomputed += 1
        left = request.max_new_tokens - len(request.generated)
        try:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([tokens]), max_new_tokens=max(min(left, self.AHEAD), 1),
                                          do_sample=False, pad_token_id=0)
        except Exception:  # noqa: BLE001 - image placeholder ids without their images: drafts by lookup instead
            self.continuations[request] = (None, self.MAX_RECOMPUTED + 1)
            return None
        self.continuations[request] = (out[0].tolist(), recomputed)
        return out[0, len(tokens):].tolist()

    def release(self, request) -> None:
        super().release(request)
        self.continuations.pop(request, None)


def serve_flags(speculation: str) -> list[str]:
    """The server's speculation flags for a run (none for ``plain``)."""
    return SERVE_FLAGS if speculation == "spec" else []


def parametrize(metafunc) -> None:
    """``pytest_generate_tests``: the modules of :data:`SPECULATION_MODULES` run ``plain`` and ``spec``."""
    name = metafunc.module.__name__.rsplit(".", 1)[-1]
    if "speculation" not in metafunc.fixturenames or name not in SPECULATION_MODULES:
        return  # the fixture's default: plain, and no id
    plain_only = metafunc.definition.get_closest_marker("plain_only") is not None
    runs = ["plain"] if plain_only else ["plain", "spec"]
    metafunc.parametrize("speculation", runs, indirect=True, scope="module")


def left_out(item) -> bool:
    """Whether ``item`` is a ``spec`` run of a family its module does not run with speculation
    (:data:`SPEC_FAMILIES`; deselected, so the run's summary counts it)."""
    params = getattr(item, "callspec", None) and item.callspec.params
    if not params or params.get("speculation") != "spec" or "family" not in params:
        return False
    families = SPEC_FAMILIES.get(item.module.__name__.rsplit(".", 1)[-1], DEFAULT_SPEC_FAMILIES)
    return families is not None and params["family"] not in families


def switch_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make managers and servers speculate by default (see the module's docstring)."""
    from hf_hybridcache.serve import EngineBackend  # the serve extra: imported only where a run speculates

    init_continuous_batching = HybridPrefixCache.init_continuous_batching
    backend_init = EngineBackend.__init__
    signature = inspect.signature(backend_init)
    count = SpeculationStats.count

    def speculating_manager(self, *args, speculation=None, **kwargs):
        if speculation is None:
            speculation = Speculation(MixedDrafter(), NUM_SPECULATIVE_TOKENS)
        return init_continuous_batching(self, *args, speculation=speculation, **kwargs)

    def speculating_backend(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("speculation") is None:
            bound.arguments["speculation"] = Speculation(MixedDrafter(), NUM_SPECULATIVE_TOKENS)
        backend_init(*bound.args, **bound.kwargs)

    def counting(self, num_drafted, num_accepted, num_emitted):
        _counted["segments"] += 1
        _counted["drafted"] += num_drafted
        _counted["accepted"] += num_accepted
        count(self, num_drafted, num_accepted, num_emitted)

    monkeypatch.setattr(HybridPrefixCache, "init_continuous_batching", speculating_manager)
    monkeypatch.setattr(EngineBackend, "__init__", speculating_backend)
    monkeypatch.setattr(SpeculationStats, "count", counting)


def counted() -> tuple[int, int, int]:
    """Verify segments, drafted and kept tokens counted so far in this process."""
    return _counted["segments"], _counted["drafted"], _counted["accepted"]


class Summary:
    """Adds up the ``spec`` tests' counts from their reports (``user_properties``, which pytest-xdist carries)."""

    def __init__(self) -> None:
        self.tests = 0
        self.totals = [0, 0, 0]
        self.idle: list[str] = []

    def add(self, report) -> None:
        counts = dict(report.user_properties).get("speculation")
        if report.when != "teardown" or counts is None:  # the fixture adds them at teardown
            return
        self.tests += 1
        self.totals = [a + b for a, b in zip(self.totals, counts)]
        if counts[0] == 0:
            self.idle.append(report.nodeid)

    def problem(self) -> str | None:
        segments, drafted, accepted = self.totals
        if drafted >= MIN_DRAFTS_CHECKED and not 0 < accepted < drafted:
            return (f"speculation: the spec runs kept {accepted} of {drafted} drafts; both kept and rejected drafts "
                    "must occur for the runs to test both paths (tests/speculation_runs.py's MixedDrafter).")
        return None

    def lines(self) -> list[str]:
        if not self.tests:
            return []
        segments, drafted, accepted = self.totals
        lines = [f"speculation on: {self.tests} tests, {segments} verify steps, {drafted} draft tokens, {accepted} "
                 f"kept, {drafted - accepted} rejected; {len(self.idle)} tests verified no draft"]
        lines += [f"  no draft verified: {nodeid}" for nodeid in self.idle]
        return lines


#: The run's summary (in the controller under pytest-xdist, from the workers' reports).
SUMMARY = Summary()
