"""Finding the request that makes a forward raise, by bisection into probe groups while everyone else keeps running,
with a retry budget per request.

A step runs one forward for the requests in no probe group (the *shared* forward) and one forward per probe group
(:func:`forwards`), each with its own plan and cache, so a forward that raises touches only its own requests' slots
and pages. When a forward raises (:meth:`Isolation.judge`):

- if it held one request, that request fails with the forward's error;
- if it held several, each of them counts the forward against its retry budget (:data:`RETRY_BUDGET`). A request over
  its budget fails with the error. The others are preempted (the forward may have written part of their states, so
  they are recomputed through the store), put back first in the waiting queue in their order, and split into probe
  groups: a request that has now been in :data:`RETRY_BUDGET` forwards that raised gets a group of its own (it runs
  alone), the rest two groups, the first half and the rest. Each member stays in its group until a forward of its
  group that succeeds has run it past the tokens it fed in the forward that raised (``suspect_until``), *in the mode
  it raised in*: a request whose decode step raised must pass a decode step (:func:`probe_after`), since the prefill
  that recomputes it runs other code (a chunked scan, a prefill attention path, other shapes) and succeeding there
  says nothing about its decode. Then it rejoins the shared forward.
- When a request fails for a raise, the forwards that raised with it are explained: the others of those forwards get
  them back (:meth:`Isolation.acquit`), so an innocent request's budget is spent only by raises nobody explained.

One request whose every decode step raises, among four, and a new one (``x``) arriving just after the first raise::

    step k     [ a b c d ]                  d raises: 1 raise each, [ a b ] [ c d ]
    step k+1   [ x ]  [ a b ]  [ c d ]      recomputed by prefill (succeeds; they stay suspect of their decode)
    step k+2   [ x ]  [ a b ]  [ c d ]      [ a b ] decode: they rejoin; [ c d ] raises: 2 each, [ c ] [ d ]
    step k+3   [ x a b ]  [ c ]  [ d ]      recomputed alone
    step k+4   [ x a b ]  [ c ]  [ d ]      d raises alone and fails; c has its raises back, decodes and rejoins
    step k+5   [ x a b c ]

Why the budget is 2: each forward that raises costs every request in it one recompute (a prefill of its prompt and
tokens so far, from its longest stored prefix) and one step without a token, so the budget is the most an innocent
request loses to one bad neighbour; at 2 the first raise still halves the suspects (a batch of 32 is not run as 32
single forwards at once), and the second leaves each suspect alone, where its own raise is its own. A budget of 1 would
run every request of a raising forward alone at once (as many forwards in a step as requests in it); 3 would let an
innocent lose a third recompute to save a quarter of those single forwards. A request whose raise does not happen
alone (it raises only beside others) passes alone, rejoins, and fails at its next raise (over budget), as does every
request whose budget went with it: such a raise cannot be pinned on one of them.

So isolating one request among ``n`` costs at most :data:`RETRY_BUDGET` recomputes of each innocent request in its
forward and about ``n / 2`` single forwards for a step or two, and a forward of innocent requests succeeds at once.
Requests outside the forward that raised and new arrivals are never held behind a probe group: they run in the shared
forward of the same steps. Source: adaptive group testing by binary splitting (Hwang, "A method for detecting all
defective members in a population by group testing", JASA 1972); a retry budget per request as vLLM and SGLang abort
the request whose step keeps failing.
"""

from __future__ import annotations

import itertools

from .plan import Segment
from .requests import EngineRequest

#: Forwards that raised a request may be in (unexplained) and be retried after; it runs alone once it has been in this
#: many, and fails at the next one (see the module docstring for why 2).
RETRY_BUDGET = 2


def forwards(segments: list[Segment]) -> list[list[Segment]]:
    """The forwards of a step: the segments of requests in no probe group (the shared forward) first, when there are
    any, then one forward per probe group; the scheduler's order is kept inside each."""
    by_probe: dict[int | None, list[Segment]] = {None: []}
    for segment in segments:
        by_probe.setdefault(segment.request.probe, []).append(segment)
    return [group for group in by_probe.values() if group]


def probe_after(segment: Segment) -> int | None:
    """Its request's probe group after a forward that succeeded ran ``segment``: None (it rejoins the shared forward)
    once it is past every token it fed in a forward that raised, by a decode step when it raised in one."""
    request = segment.request
    if segment.end < request.suspect_until or (request.suspect_decode and not segment.is_decode):
        return request.probe
    request.suspect_until, request.suspect_decode = 0, False
    return None


class Isolation:
    """Judges forwards that raised: who fails, who is retried in which probe group (ids unique per engine).

    Attributes:
        raised_forwards: forwards that raised so far.
    """

    def __init__(self, budget: int = RETRY_BUDGET) -> None:
        self.budget = budget
        self.raised_forwards = 0
        self._ids = itertools.count()

    def judge(self, segments: list[Segment], error: Exception) -> tuple[dict[EngineRequest, str], list[EngineRequest]]:
        """The requests of a forward that raised ``error`` that fail (with their error message) and those retried, in
        order, each put in its probe group."""
        self.raised_forwards += 1
        message = f"{type(error).__name__}: {error}"
        requests = list(dict.fromkeys(segment.request for segment in segments))
        if len(requests) == 1:
            return {requests[0]: message}, []
        forward = next(self._ids)
        for segment in segments:
            request = segment.request
            request.raised.add(forward)
            request.suspect_until = max(request.suspect_until, segment.end)
            request.suspect_decode = request.suspect_decode or segment.is_decode
        failed = {r: f"{message} (in {len(r.raised)} forwards that raised; its retry budget is {self.budget})"
                  for r in requests if len(r.raised) > self.budget}
        retried = [r for r in requests if r not in failed]
        rest = [r for r in retried if len(r.raised) < self.budget]
        groups = [[r] for r in retried if len(r.raised) == self.budget]
        for members in (*groups, rest[: len(rest) // 2], rest[len(rest) // 2 :]):
            probe = next(self._ids)
            for request in members:
                request.probe = probe
        return failed, retried

    @staticmethod
    def acquit(culprits, requests) -> None:
        """``culprits`` failed for their raises: the forwards they raised in are explained, so ``requests`` (the
        engine's others) get them back."""
        explained = set().union(*(culprit.raised for culprit in culprits))
        for request in requests:
            request.raised -= explained
