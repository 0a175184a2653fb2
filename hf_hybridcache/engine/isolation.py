"""Finding the request that makes a forward raise, by bisection into probe groups, while everyone else keeps running.

A step runs one forward for the requests in no probe group (the *shared* forward) and one forward per probe group
(:func:`forwards`), each with its own plan and cache, so a forward that raises touches only its own requests' slots
and pages. When a forward raises:

- if it held one request, that request fails (the engine's job);
- if it held several, they are preempted (the forward may have written part of their states, so they are recomputed
  through the store), put back first in the waiting queue in their order, and split into two new probe groups, the
  first half and the rest (:meth:`Probes.split`). Each member stays in its group until a forward of its group that
  succeeds has run it to the end of the tokens it fed in the forward that raised (``suspect_until``): then it
  rejoins the shared forward (:func:`probe_after`).

One poisoned request among five, arriving with a new one (``x``) just after the forward that raised::

    step k     [ a b c d e ]                    raises
    step k+1   [ x ]  [ a b ]  [ c d e ]        the last one raises: [ c ] [ d e ]
    step k+2   [ x a b ]  [ c ]  [ d e ]        the last one raises: [ d ] [ e ]
    step k+3   [ x a b c ]  [ d ]  [ e ]        e raises alone and fails
    step k+4   [ x a b c d ]

So isolating one request among ``n`` costs about ``log2(n)`` extra forwards, and a forward of innocent requests
succeeds at once. Requests outside the forward that raised and new arrivals are never held behind a probe group: they
run in the shared forward of the same steps. Source: adaptive group testing by binary splitting (Hwang, "A method
for detecting all defective members in a population by group testing", JASA 1972).
"""

from __future__ import annotations

import itertools

from .plan import Segment
from .requests import EngineRequest


def forwards(segments: list[Segment]) -> list[list[Segment]]:
    """The forwards of a step: the segments of requests in no probe group (the shared forward) first, when there are
    any, then one forward per probe group; the scheduler's order is kept inside each."""
    by_probe: dict[int | None, list[Segment]] = {None: []}
    for segment in segments:
        by_probe.setdefault(segment.request.probe, []).append(segment)
    return [group for group in by_probe.values() if group]


def probe_after(request: EngineRequest, end: int) -> int | None:
    """``request``'s probe group after a forward that succeeded ran it to ``end`` tokens: None (it rejoins the shared
    forward) once it is past every token it fed in a forward that raised."""
    return request.probe if end < request.suspect_until else None


class Probes:
    """Splits the requests of a forward that raised into probe groups, whose ids it hands out (unique per engine)."""

    def __init__(self) -> None:
        self._ids = itertools.count()

    def split(self, segments: list[Segment]) -> list[EngineRequest]:
        """Make the requests of ``segments`` (a forward of several that raised) suspect up to the end of their
        segments, in two new probe groups: the first half (rounded down) and the rest. Returns them in order."""
        requests = list(dict.fromkeys(segment.request for segment in segments))
        assert len(requests) > 1, "a forward of one request that raises fails that request, it is not split"
        for segment in segments:
            segment.request.suspect_until = max(segment.request.suspect_until, segment.end)
        half = len(requests) // 2
        for members in (requests[:half], requests[half:]):
            probe = next(self._ids)
            for request in members:
                request.probe = probe
        return requests
