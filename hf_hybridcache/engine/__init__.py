"""Continuous batching for hybrid models with prefix reuse: many requests served at once in packed steps, sharing
the :class:`~hf_hybridcache.HybridPrefixCache`'s store with ``generate()``.

Parts, one job each: ``limits`` (memory bounds), ``requests`` (a request and its running state), ``intake`` (what
``add_request`` checks and makes), ``images`` (a vision-language wrapper's images: keys, encoding, rows per forward,
3D positions), ``scheduler`` (which tokens each step feeds), ``slots`` (running requests' recurrent states), ``plan``
(the packed layout of a step), ``views`` (the caches the model sees in a step), ``grouping`` (stateful modules run
per group), ``runner`` (the forward and sampling), ``storing`` (what a step stores), ``isolation`` (finding the
request that makes a forward raise), ``engine`` (admission, steps, results), ``outputs`` (where outputs go) and
``manager`` (transformers' continuous-batching API, a loop thread); for speculative steps ``speculative`` (drafts in,
what a verified step keeps), ``verify`` (which drafts are accepted), ``drafters`` (the drafter interface, n-gram
lookup), ``draft_model`` (a draft model run by an engine of its own) and ``mtp`` (a checkpoint's MTP head, from the
target's hidden states).
"""

from .draft_model import DraftModelDrafter
from .drafters import Draft, Drafter, NgramDrafter
from .limits import EngineLimits
from .manager import ContinuousBatchingManager
from .mtp import MTPDrafter
from .speculative import Speculation, SpeculationStats

__all__ = ["ContinuousBatchingManager", "Draft", "DraftModelDrafter", "Drafter", "EngineLimits", "MTPDrafter",
           "NgramDrafter", "Speculation", "SpeculationStats"]
