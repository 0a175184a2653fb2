"""What a hook point is and the kinds of checks one runs (the list itself is :mod:`.hook_points`).

A hook point is one transformers or accelerate internal this package relies on: a class or function it patches,
wraps, rebinds or mirrors, a signature it binds arguments by, the fields of an object it writes. Its check looks at the
installed code (nothing runs a model) and says what differs from what the package relies on, or None.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import transformers
from packaging.specifiers import SpecifierSet

from .modeling import python_function

#: ``() -> None`` when the internal is as the package relies on, else a phrase saying what differs.
Check = Callable[[], "str | None"]
#: The transformers actually installed (hook points describe its code, whatever version string a test pretends).
INSTALLED = transformers.__version__


@dataclass(frozen=True)
class HookPoint:
    """One internal the package relies on.

    Attributes:
        name: the internal's dotted path (``transformers.cache_utils.LinearAttentionLayer.increase_count``), with a
            bracketed qualifier where one internal has several checks; the test id.
        check: what to look at (:data:`Check`).
        used_by: the package module that relies on it and how.
        versions: a PEP 440 specifier of the transformers versions that have it ("" for all).
        at_construction: cheap and needed by every request: :func:`~hf_hybridcache._compat.check_version` runs it
            whenever a cache is built; the others run in tests/test_hook_points.py.
    """

    name: str
    check: Check
    used_by: str
    versions: str = ""
    at_construction: bool = False

    def applies(self, version: str = INSTALLED) -> bool:
        return SpecifierSet(self.versions).contains(version, prereleases=True)

    def problem(self) -> str | None:
        """What differs on the installed transformers, or None."""
        try:
            return self.check()
        except (ImportError, AttributeError) as error:
            return f"missing ({type(error).__name__}: {error})"

    def describe(self, problem: str, version: str = INSTALLED) -> str:
        return f"{self.name}: {problem} (transformers {version}; relied on by {self.used_by})"


def broken(points: Iterable[HookPoint], version: str = INSTALLED) -> list[str]:
    """A line per applicable hook point whose internal moved (:meth:`HookPoint.describe`), in list order."""
    lines = []
    for point in points:
        if point.applies(version) and (problem := point.problem()) is not None:
            lines.append(point.describe(problem, version))
    return lines


def resolve(target: str):
    """The object at ``"package.module:Qual.name"``.

    Raises:
        ImportError, AttributeError: it does not exist.
    """
    module_name, _, qualname = target.partition(":")
    found = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        found = getattr(found, part)
    return found


def dotted(target: str) -> str:
    return target.replace(":", ".")


def named_parameters(function) -> list[str]:
    """The parameter names of ``function`` without ``self``, ``*args`` and ``**kwargs`` (a kernel that transformers 5.25
    wraps into a ``kernelize``-able module, or that this package routes, is read through the function inside)."""
    function = python_function(function)
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind not in kinds and p.name != "self"]


def exists(target: str) -> Check:
    def check():
        resolve(target)

    return check


def parameters(target: str, *names: str, leading: bool = False) -> Check:
    """The callable at ``target`` takes ``names`` (``leading``: as its first parameters, in this order, because the
    package passes them by position)."""

    def check():
        found = named_parameters(resolve(target))
        if leading and found[: len(names)] != list(names):
            return f"takes ({', '.join(found)}), not ({', '.join(names)}, ...) first"
        missing = [name for name in names if name not in found]
        return f"takes no {', '.join(missing)} (it takes {', '.join(found)})" if missing else None

    return check


def fields(factory: Callable[[], object], names: Iterable[str], exact: bool = False) -> Check:
    """A fresh object from ``factory()`` has the attributes ``names`` (``exact``: and no others, since a restore
    that sets fields by hand would leave a new one stale)."""

    def check():
        found = set(vars(factory()))
        missing, new = sorted(set(names) - found), sorted(found - set(names))
        problems = [f"has no {', '.join(missing)}"] if missing else []
        if exact and new:
            problems.append(f"has new fields {', '.join(new)} that a restore does not write")
        return "; ".join(problems) or None

    return check


def methods(target: str, names: Iterable[str]) -> Check:
    """The class at ``target`` defines exactly the public methods and properties ``names`` (a new one may be what the
    modeling code now calls on a cache, which the package's caches must then answer)."""

    def check():
        found = {name for name in vars(resolve(target)) if not name.startswith("_")}
        new, gone = sorted(found - set(names)), sorted(set(names) - found)
        problems = []
        if new:
            problems.append(f"has new {', '.join(new)}: should the package's caches answer them?")
        if gone:
            problems.append(f"has no {', '.join(gone)}")
        return "; ".join(problems) or None

    return check


def refers_to(target: str, *names: str) -> Check:
    """The code of the function at ``target`` names ``names`` (a global it calls, an attribute it reads)."""

    def check():
        code = inspect.unwrap(resolve(target)).__code__
        seen = set(code.co_names) | {c for const in code.co_consts if inspect.iscode(const) for c in const.co_names}
        missing = [name for name in names if name not in seen]
        return f"no longer refers to {', '.join(missing)}" if missing else None

    return check


def source_mentions(target: str, *texts: str) -> Check:
    """The source of the module or function at ``target`` contains ``texts``."""

    def check():
        source = inspect.getsource(resolve(target))
        missing = [text for text in texts if text not in source]
        return f"its source has no {', '.join(repr(t) for t in missing)}" if missing else None

    return check
