"""Every transformers and accelerate internal the package relies on (hf_hybridcache/_compat/hook_points.py), checked on
the installed transformers: one test per hook point, whose failure names the internal, the version and the package
module that relies on it. Run this first when raising the supported window's ceiling (docs/usage.md).

The power tests break one internal on purpose and check that exactly its hook point reports it."""

import ast
import inspect
import re
import types
from pathlib import Path

import pytest
import transformers
from packaging.specifiers import SpecifierSet
from transformers import cache_utils
from transformers.generation.utils import GenerationMixin

from hf_hybridcache._compat.hook_checks import INSTALLED, broken, resolve
from hf_hybridcache._compat.hook_points import HOOK_POINTS, MANAGER_CALLS
from hf_hybridcache._compat.hook_points_models import FAMILIES
from hf_hybridcache.engine.manager import ContinuousBatchingManager

MODELS = Path(__file__).parent.parent / "hf_hybridcache" / "models"
#: The hook points that exist on the installed transformers (the others name internals of other versions).
APPLICABLE = [p for p in HOOK_POINTS if p.applies()]


def test_hook_point_names_are_unique():
    names = [p.name for p in HOOK_POINTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("point", APPLICABLE, ids=[p.name for p in APPLICABLE])
def test_hook_point(point):
    problem = point.problem()
    assert problem is None, point.describe(problem)


def _failing(monkeypatch, action) -> set[str]:
    """The names of the hook points that fail after ``action(monkeypatch)`` (undone afterwards)."""
    action(monkeypatch)
    try:
        return {line.split(": ", 1)[0] for line in broken(HOOK_POINTS)}
    finally:
        monkeypatch.undo()


def _swap_signature(module: str, name: str):
    def action(monkeypatch):
        def reordered(conv_state, hidden_states, weight, bias=None, activation=None):  # the first two swapped
            raise AssertionError("never called")

        monkeypatch.setattr(resolve(module), name, reordered)

    return action


def _with_new_field(monkeypatch):
    init = cache_utils.LinearAttentionLayer.__init__

    def with_new_field(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.tokens_seen = 0

    monkeypatch.setattr(cache_utils.LinearAttentionLayer, "__init__", with_new_field)


_M = "transformers.models"
#: (what is broken, how, the hook points that must name it and no others, the versions that have the internal).
BREAKS = [
    ("generate()'s _prefill renamed", lambda mp: mp.delattr(GenerationMixin, "_prefill"),
     {"transformers.generation.utils.GenerationMixin._prefill"}, ""),
    ("the mixer class Jamba's module patches renamed",
     lambda mp: mp.delattr(resolve(f"{_M}.jamba.modeling_jamba"), "JambaMambaMixer"),
     {f"{_M}.jamba.modeling_jamba.JambaMambaMixer"}, ""),
    ("a routed kernel's parameters reordered", _swap_signature(f"{_M}.qwen3_next.modeling_qwen3_next",
                                                               "causal_conv1d_update"),
     {f"{_M}.qwen3_next.modeling_qwen3_next.causal_conv1d_update"}, ""),
    ("use_gqa_in_sdpa gone", lambda mp: mp.delattr(resolve("transformers.integrations.sdpa_attention"),
                                                   "use_gqa_in_sdpa"),
     {"transformers.integrations.sdpa_attention.use_gqa_in_sdpa"}, ""),
    ("a field a restore does not write added to the linear layers", _with_new_field,
     {"transformers.cache_utils.LinearAttentionLayer[every field]"}, ""),
    ("a method added to Cache", lambda mp: mp.setattr(cache_utils.Cache, "tokens_seen", lambda self: 0, raising=False),
     {"transformers.cache_utils.Cache[methods]"}, ""),
    ("the 5.25 linear layers' increase_count removed",
     lambda mp: mp.delattr(cache_utils.LinearAttentionCacheLayerMixin, "increase_count"),
     {"transformers.cache_utils.LinearAttentionCacheLayerMixin.increase_count",
      "transformers.cache_utils.LinearAttentionCacheLayerMixin[methods]"}, ">=5.25.0"),
]


@pytest.mark.parametrize("action, names, versions", [b[1:] for b in BREAKS], ids=[b[0] for b in BREAKS])
def test_a_broken_internal_is_named_by_its_hook_point_alone(monkeypatch, action, names, versions):
    if not SpecifierSet(versions).contains(INSTALLED):
        pytest.skip(f"needs transformers {versions} (the internal broken here is new there): run it with such a "
                    "transformers, as CI's main pass does")
    assert _failing(monkeypatch, action) == names
    assert broken(HOOK_POINTS) == []  # undone


def test_a_failure_names_the_internal_the_version_and_the_package_module(monkeypatch):
    monkeypatch.delattr(GenerationMixin, "_prefill")
    assert broken(HOOK_POINTS) == [
        "transformers.generation.utils.GenerationMixin._prefill: missing (AttributeError: type object "
        f"'GenerationMixin' has no attribute '_prefill') (transformers {transformers.__version__}; relied on by "
        "hf_hybridcache._compat.generation (wraps it per instance: a request's lookup and restore run before "
        "generate() slices the prompt))"
    ]


def test_the_engine_answers_every_call_transformers_makes_on_its_manager():
    instance_fields = ContinuousBatchingManager.__init__.__code__.co_names
    missing = [name for name in MANAGER_CALLS if not hasattr(ContinuousBatchingManager, name)
               and name not in instance_fields]
    assert not missing, f"generate_batch calls manager.{missing} on the engine's manager, which lacks them"


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", node.value)}


def _modeling_names() -> set[str]:
    """The non-module attributes of the families' modeling modules on this transformers, and the kernel names their
    "falling back" notices use."""
    names = set()
    for family in FAMILIES:
        if not all(p.applies() for p in family.hook_points()):
            continue
        module = resolve(family.module)
        names |= {n for n in dir(module) if not isinstance(getattr(module, n), types.ModuleType)}
        names |= set(re.findall(r'use_kernel_func_from_hub_with_fallback\(\s*"(\w+)"', inspect.getsource(module)))
    return names


def test_every_transformers_name_the_model_modules_hold_is_a_hook_point():
    """A class or module function of transformers that hf_hybridcache/models/ names (to patch, route or find it) has
    a hook point, so a new one cannot be added without its check."""
    listed = {token for p in HOOK_POINTS for token in re.findall(r"\w+", p.name)}
    held = set().union(*(_string_constants(path) for path in MODELS.glob("*.py")))
    camel = {name for name in held if re.fullmatch(r"[A-Z][a-z]+[A-Za-z0-9_]*[a-z0-9]", name)} - {"Triton"}
    unlisted = sorted((camel | (held & _modeling_names())) - listed)
    assert not unlisted, f"hf_hybridcache/models names {unlisted}: give each a hook point in _compat/hook_points*.py"
