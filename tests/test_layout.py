"""The package's layout, read from its source (docs/design.md, "Where the code is"): every import goes down the table
of layers, no modules import each other in a circle (outside ``kernels/``, whose kernels may import their Triton
twins), a handful of modules sit directly under ``hf_hybridcache/``, and modules, classes and the README stay short.

Every ``import`` counts: at module level, under ``if TYPE_CHECKING:`` and inside functions, since each one is an arrow
a reader follows (a lazy import that runs up a layer is still an arrow up). Importing ``a.b.c`` is an arrow to
``a.b.c`` only, not to the packages above it that Python also runs (every arrow would reach the top face otherwise).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_hybridcache"

#: Each unit (a package or a module directly under hf_hybridcache/, "__init__" for the package's face) and its layer:
#: a unit imports only units of lower layers. Units in one layer are siblings and do not import each other.
LAYERS = {
    "serve": 9,  # the OpenAI-compatible server
    "__init__": 8,  # what a user imports
    "post_training": 8,  # a trainer's rollouts and weights steps
    "cache": 7,  # HybridPrefixCache, the object a user keeps
    "generate": 6,  # the life of one generate() call
    "engine": 6,  # the continuous-batching engine
    "core": 5,  # what the cache, its views and the engine share
    "remote": 4,  # the tier processes share
    "sizing": 4,  # what an entry of a model costs
    "store": 3,  # what is stored and what keeps it
    "models": 3,  # the supported families and their patched mixers
    "multimodal": 3,  # images in a vision-language wrapper's prompt: their keys and their encoding
    "structured": 2,  # grammars for structured output
    "toy": 2,  # small seeded models for tests and examples
    "config": 2,
    "hashing": 2,
    "stats": 2,
    "_version": 2,
    "_compat": 1,  # transformers' internals
    "kernels": 0,  # scans, delta rules and copies with their torch references
}
MAX_TOP_LEVEL_MODULES = 10  # .py files directly under hf_hybridcache/, __init__.py included
MAX_MODULE_LINES = 350  # outside kernels/
MAX_CLASS_LINES = 300
MAX_README_LINES = 250


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in SOURCES.items()}


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules an import statement in module ``name`` names (the closest module for an attribute)."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if SOURCES[name].name == "__init__.py" else name.split(".")[:-1]
            anchor = package[: len(package) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        wanted = [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for target in wanted:
        while target not in SOURCES and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in SOURCES and target != name:
            found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    return {
        name: set().union(*(_targets(name, node) for node in ast.walk(tree)
                            if isinstance(node, (ast.Import, ast.ImportFrom))))
        for name, tree in TREES.items()
    }


GRAPH = _graph()


def _unit(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_every_package_and_top_level_module_has_a_layer():
    units = {_unit(name) for name in SOURCES}
    missing = sorted(units - LAYERS.keys())
    assert not missing, f"{missing} have no layer: add each to LAYERS here and to docs/design.md's table"


def test_imports_only_go_down_the_layers():
    wrong = sorted(
        f"{name} -> {target} ({_unit(name)} is layer {LAYERS[_unit(name)]}, {_unit(target)} layer "
        f"{LAYERS[_unit(target)]})"
        for name, targets in GRAPH.items()
        for target in targets
        if _unit(name) != _unit(target) and LAYERS[_unit(target)] >= LAYERS[_unit(name)]
    )
    assert not wrong, "imports that run up or sideways (move what both need down):\n" + "\n".join(wrong)


def test_no_circles_outside_kernels():
    circles = [c for c in _circles(GRAPH) if any(_unit(name) != "kernels" for name in c)]
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_the_checks_see_every_kind_of_arrow():
    # The checks have power: the graph holds a lazy import inside a function (cache -> engine), an import under
    # TYPE_CHECKING (core.sharing -> remote) and a relative import of a sibling, and finds a planted circle.
    assert "hf_hybridcache.engine" in GRAPH["hf_hybridcache.cache"]
    assert "hf_hybridcache.remote" in GRAPH["hf_hybridcache.core.sharing"]
    assert "hf_hybridcache.core.calls" in GRAPH["hf_hybridcache.core.sharing"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_handful_of_modules_directly_under_the_package():
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"{len(modules)} modules under hf_hybridcache/: {modules}"


def test_modules_and_classes_are_short():
    long_modules = {
        name: len(path.read_text(encoding="utf-8").splitlines())
        for name, path in SOURCES.items()
        if _unit(name) != "kernels"
    }
    long_modules = {name: lines for name, lines in long_modules.items() if lines > MAX_MODULE_LINES}
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    long_classes = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    }
    assert not long_classes, f"classes over {MAX_CLASS_LINES} lines: {long_classes}"


def test_the_cache_is_a_thin_face():
    tree = TREES["hf_hybridcache.cache"]
    (face,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "HybridPrefixCache"]
    assert face.end_lineno - face.lineno + 1 < 300
    assert len(SOURCES["hf_hybridcache.cache"].read_text(encoding="utf-8").splitlines()) < 350


def test_the_readme_is_a_few_screens():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md is {lines} lines; move detail into docs/"
