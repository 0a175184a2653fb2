"""The engine's retry budget (:mod:`hf_hybridcache.engine.isolation`) on its own, without a model: who fails and who
is retried in which probe group when forwards raise, when a suspect leaves its group (a decode suspect only by a decode
step), and how a request's failure gives its neighbours their raises back. Exact bookkeeping; the engine scenarios
are in tests/test_engine_isolation.py."""

import pytest

from hf_hybridcache.engine.isolation import RETRY_BUDGET, Isolation, forwards, probe_after
from hf_hybridcache.engine.plan import Segment
from hf_hybridcache.engine.requests import EngineRequest

ERROR = RuntimeError("bad decode")


def requests(*names: str) -> list[EngineRequest]:
    return [EngineRequest(name, [5] * 20, 16, generated=[7] * 5) for name in names]


def decode(request: EngineRequest) -> Segment:
    """Its decode step: one token over its past."""
    return Segment(request, [request.tokens[-1]], len(request.tokens) - 1, fresh=False)


def recompute(request: EngineRequest) -> Segment:
    """Its recompute after a preemption: one prefill of every token from a fresh slot."""
    return Segment(request, list(request.tokens), 0, fresh=True, samples=True)


def groups(members: list[EngineRequest]) -> list[list[str]]:
    return [[s.request.request_id for s in forward] for forward in forwards([decode(r) for r in members])]


def test_the_budget_is_two():
    assert RETRY_BUDGET == 2


def test_a_first_raise_halves_a_second_leaves_each_alone_a_third_fails():
    isolation = Isolation()
    a, b, c, d = requests("a", "b", "c", "d")
    failed, retried = isolation.judge([decode(r) for r in (a, b, c, d)], ERROR)
    assert failed == {} and retried == [a, b, c, d]
    assert [r.raised for r in (a, b, c, d)] == [{0}] * 4
    assert groups([a, b, c, d]) == [["a", "b"], ["c", "d"]]
    assert all(r.suspect_decode and r.suspect_until == 25 for r in (a, b, c, d))

    failed, retried = isolation.judge([decode(c), decode(d)], ERROR)
    assert failed == {} and retried == [c, d]
    assert groups([c, d]) == [["c"], ["d"]]  # at the budget: alone

    failed, retried = isolation.judge([decode(d)], ERROR)  # alone: its own error, as it is
    assert failed == {d: "RuntimeError: bad decode"} and retried == []
    Isolation.acquit(failed, [a, b, c])
    assert [r.raised for r in (a, b, c)] == [set(), set(), set()]
    assert isolation.raised_forwards == 3


def test_a_request_over_its_budget_fails_and_only_it():
    """One whose raise does not happen alone passes alone and rejoins: the next raise it is in spends its budget."""
    isolation = Isolation()
    a, b, c = requests("a", "b", "c")
    isolation.judge([decode(a), decode(b)], ERROR)
    isolation.judge([decode(a), decode(b)], ERROR)
    a.probe = b.probe = None  # both passed alone and rejoined the shared forward
    failed, retried = isolation.judge([decode(a), decode(c)], ERROR)
    assert failed == {a: f"RuntimeError: bad decode (in 3 forwards that raised; its retry budget is {RETRY_BUDGET})"}
    assert retried == [c] and c.probe is not None
    Isolation.acquit(failed, [b, c])
    assert b.raised == set() and c.raised == set()


def test_a_decode_suspect_leaves_its_group_by_a_decode_step_only():
    a, b = requests("a", "b")
    Isolation().judge([decode(a), decode(b)], ERROR)
    probe = a.probe
    assert probe_after(recompute(a)) == probe  # its recompute reached the token that raised, by a prefill
    a.generated.append(8)  # the recompute sampled one more
    assert probe_after(decode(a)) is None  # a decode step past it
    assert (a.suspect_until, a.suspect_decode) == (0, False)


def test_a_prefill_suspect_leaves_its_group_once_a_prefill_reaches_the_end_of_its_chunk():
    a, b = (EngineRequest(name, [5] * 40, 8) for name in ("a", "b"))
    Isolation().judge([Segment(r, [5] * 16, 16, fresh=False) for r in (a, b)], ERROR)
    assert (a.suspect_until, a.suspect_decode) == (32, False)
    assert probe_after(Segment(a, [5] * 16, 0, fresh=True)) == a.probe
    assert probe_after(Segment(a, [5] * 32, 0, fresh=True)) is None


@pytest.mark.parametrize("size", [2, 3, 8, 32])
def test_an_innocent_request_is_in_at_most_budget_forwards_that_raise_with_one_bad_neighbour(size):
    """Bisection with the budget against one request that makes every forward it is in raise: it fails after at most
    budget + 1 raises, and no other is in more than budget of them."""
    isolation = Isolation()
    everyone = requests(*(f"r{i}" for i in range(size)))
    bad = everyone[size // 2]
    raises = {r.request_id: 0 for r in everyone}
    for _ in range(2 * size):
        if bad.status.name == "FAILED":
            break
        forward = next(f for f in forwards([decode(r) for r in everyone if r.status.name != "FAILED"])
                       if any(s.request is bad for s in f))
        for segment in forward:
            raises[segment.request.request_id] += 1
        failed, _ = isolation.judge(forward, ERROR)
        for request in failed:
            request.status = type(request.status).FAILED
        Isolation.acquit(failed, everyone)
    assert bad.status.name == "FAILED" and raises.pop(bad.request_id) <= RETRY_BUDGET + 1
    assert max(raises.values()) <= RETRY_BUDGET
