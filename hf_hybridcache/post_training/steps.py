"""A trainer's optimizer step, as the cache sees it: the weights changed, and those before never come back.

A ``HybridPrefixCache`` reads the weights at every request by default (:mod:`hf_hybridcache.core.weights`): a walk of
every tensor per request, and a read of every element once they changed. A trainer changes every weight at every
step, so it declares its steps instead (:func:`weights_step`): each is a new weights state, named without reading
a weight, and nothing reads the weights between two steps. With ``retire`` (the default), the entries stored under
the steps before are dropped at once, so the store holds one step's entries however many steps run.
"""

from __future__ import annotations

from .. import _compat
from ..generate import end_live_requests


def weights_step(cache, retire: bool = True) -> int:
    """Tell ``cache`` (a :class:`~hf_hybridcache.HybridPrefixCache`) that its model's weights just changed and how:
    call it after every optimizer step (``post_training.attach`` does, and once when training begins).

    From the first call on, the weights state is the number of the last declared step (O(1), nothing read), and
    requests read no weight: an edit between two calls is not seen, so declare every change. ``cache.clear()`` (which
    ``attach`` calls when training ends) and ``cache.save()`` read every weight again and return to reading them at
    every request. Waits for a running call in another thread.

    Args:
        retire: drop every stored entry now: all were computed under earlier weights, which a training run does not
            come back to. False keeps them until the budget evicts them (no request can hit them).

    Returns:
        The step's number (1 for the first call since the weights were last read).

    Raises:
        RuntimeError: called from inside a running ``generate()`` or engine step in this thread.
    """
    with cache.core.idle("weights_step()"):
        end_live_requests(cache)  # the live requests' chains are unpinned, so every entry can be dropped
        cache.layers = _compat.new_live_layers(cache.model.config)
        return cache.core.weights_step(retire)
