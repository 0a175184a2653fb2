"""JSON schemas as the grammars read them: objects closed where the schema does not say, OpenAI's strict-mode rules,
and references moved with a schema embedded in a larger one.

**Closed by default** (:func:`closed_schema`). JSON Schema lets an object hold any key its ``properties`` do not name
unless it says ``additionalProperties: false``; a grammar that follows that lets a model invent keys (a random toy
model wrote a 200-token key and ran out of tokens; llama.cpp made closed objects its grammar default for the same
reason, PR#8180, and vLLM's default backend, xgrammar, compiles schemas in its ``strict_mode``). So every object that
declares its keys (``properties`` or ``patternProperties``) and does not say ``additionalProperties`` is closed; an
object that declares none (``{"type": "object"}``) stays any object, as in llama.cpp and outlines, and
``additionalProperties: true`` or a schema keeps an object open. A key named only in ``required`` is declared too (any
value), as the Qwen3.5 tool format reads it. Branches that describe one instance together (``allOf``, and
``anyOf`` / ``oneOf`` beside the object's own ``properties``) each allow the keys the others declare, which is what
``unevaluatedProperties: false`` would say (llguidance does not implement it): an ``allOf`` of two closed halves
would otherwise allow only ``{}``. Tuples (``prefixItems``, or a list ``items``) get no items past their own, as in
llama.cpp and xgrammar.

**Strict mode** (:func:`strict_violation`): OpenAI's rules for ``"strict": true`` schemas (the Structured Outputs
guide, "Supported schemas"), refused in OpenAI's words: the root is an object, not ``anyOf``; every object says
``additionalProperties: false`` and lists every property in ``required``; ``allOf``, ``oneOf``, ``not``,
``if`` / ``then`` / ``else``, ``dependentRequired`` and ``dependentSchemas`` are not permitted. Its size limits
(properties, nesting, enum values) are not checked: the grammar has none.
"""

from __future__ import annotations

import copy

#: Keywords whose values are maps of schemas, one schema, or lists of schemas, each for another instance.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "items", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("prefixItems", "items")
#: Keywords whose schemas apply to the same instance as the schema holding them.
_BRANCHES = ("allOf", "anyOf", "oneOf")
#: Keywords whose values are data, never schemas.
_DATA = ("const", "enum", "default", "examples")
#: Annotations a ``$ref`` may carry beside it and still be inlined.
_ANNOTATIONS = {"$ref", "description", "title", "$comment"}
STRICT_REFUSED = ("allOf", "oneOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas")


def closed_schema(schema: dict) -> dict:
    """A copy of ``schema`` whose objects hold only the keys it declares (module docstring), where it does not say
    otherwise. Idempotent; ``schema`` is not changed."""
    closed = copy.deepcopy(schema)
    _Closer(schema).close(closed, frozenset())
    return closed


class _Closer:
    def __init__(self, root: dict) -> None:
        self.root = root  # as given: references resolve here, to schemas not closed yet
        self.inlining: list[str] = []

    def close(self, node, outer: frozenset | None) -> None:
        """Close ``node`` in place. ``outer``: the keys the branches around it declare for the same instance (None:
        a schema around it leaves the instance open)."""
        if not isinstance(node, dict):
            return
        for child in _subschemas(node):
            self.close(child, frozenset())
        if "prefixItems" in node:
            node.setdefault("items", False)
        if isinstance(node.get("items"), list):
            node.setdefault("additionalItems", False)
        if isinstance(node.get("$ref"), str) and _declared(node):  # its target's keys join its own: make it a branch
            node["allOf"] = [{"$ref": node.pop("$ref")}, *_branches(node, "allOf")]
        opened = outer is None or node.get("additionalProperties", False) is not False
        every = frozenset().union(*(self.keys(b) for b in _branches(node, "allOf")))
        some = frozenset().union(*(self.keys(b) for k in ("anyOf", "oneOf") for b in _branches(node, k)))
        base = None if opened else outer | _declared(node) | every
        for key in _BRANCHES:
            for i, branch in enumerate(_branches(node, key)):
                context = base if base is None or key != "allOf" else base | some
                self.close_branch(node[key], i, context)
        if not opened and "additionalProperties" not in node and ("properties" in node or "patternProperties" in node):
            properties = node.get("properties") or {}
            extra = (outer | _declared(node) | every | some) - set(properties)
            node["properties"] = {**properties, **{key: {} for key in sorted(extra)}}
            node["additionalProperties"] = False

    def close_branch(self, branches: list, i: int, context: frozenset | None) -> None:
        """Close ``branches[i]``; a bare reference to a schema that declares keys is inlined first, so that its copy
        allows the keys of the branches beside it (the target itself is closed on its own)."""
        ref = branches[i].get("$ref") if isinstance(branches[i], dict) else None
        bare = isinstance(branches[i], dict) and set(branches[i]) <= _ANNOTATIONS
        target = self.resolve(ref) if bare and ref not in self.inlining else None
        if not isinstance(target, dict) or not self.keys(target):
            self.close(branches[i], context)
            return
        branches[i] = copy.deepcopy(target)
        self.inlining.append(ref)
        self.close(branches[i], context)
        self.inlining.pop()

    def keys(self, node, seen: frozenset = frozenset()) -> frozenset:
        """The keys ``node`` declares for its instance, through its branches and references."""
        if not isinstance(node, dict):
            return frozenset()
        found = set(_declared(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            found |= self.keys(self.resolve(ref), seen | {ref})
        for key in _BRANCHES:
            for branch in _branches(node, key):
                found |= self.keys(branch, seen)
        return frozenset(found)

    def resolve(self, ref):
        """The schema a local reference (``#/$defs/x``, a JSON pointer into the root) names, or None."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node


def _declared(node: dict) -> frozenset:
    properties = node.get("properties")
    required = node.get("required")
    return frozenset([*(properties if isinstance(properties, dict) else ()),
                      *(k for k in (required if isinstance(required, list) else ()) if isinstance(k, str))])


def _branches(node: dict, key: str) -> list:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _subschemas(node: dict):
    """The schemas inside ``node`` that describe other instances (its properties' values, items, definitions)."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()
    for key in _SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            yield node[key]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from node[key]


def rebased(schema, pointer: str):
    """A copy of ``schema`` whose local references (``#/...``) point into it where it sits at JSON pointer
    ``pointer`` of a larger schema (``"/items/properties/arguments"``), so that its ``$defs`` still resolve there."""
    if isinstance(schema, list):
        return [rebased(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA else rebased(v, pointer) for k, v in schema.items()}
    if isinstance(out.get("$ref"), str) and out["$ref"].startswith("#"):
        out["$ref"] = "#" + pointer + out["$ref"][1:]
    return out


def strict_violation(schema) -> str | None:
    """The first of OpenAI's strict-mode rules ``schema`` breaks, in the words of OpenAI's 400 (``"In context=
    ('properties', 'when'), 'additionalProperties' is required to be supplied and to be false."``), or None."""
    kind = schema.get("type") if isinstance(schema, dict) else type(schema).__name__
    if kind != "object" or "anyOf" in schema:
        return f"schema must be a JSON Schema of 'type: \"object\"', got 'type: \"{kind}\"'."
    return _first_violation(schema, ())


def _first_violation(node, context: tuple) -> str | None:
    if not isinstance(node, dict):
        return None
    for key in STRICT_REFUSED:
        if key in node:
            return f"In context={context!r}, '{key}' is not permitted."
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node:
        if node.get("additionalProperties") is not False:
            return f"In context={context!r}, 'additionalProperties' is required to be supplied and to be false."
        required = node.get("required") if isinstance(node.get("required"), list) else []
        missing = [key for key in node.get("properties") or {} if key not in required]
        if missing:
            return (f"In context={context!r}, 'required' is required to be supplied and to be an array including "
                    f"every key in properties. Missing '{missing[0]}'.")
    for key in dict.fromkeys((*_SCHEMA_MAPS, *_SCHEMA_ONE, *_SCHEMA_LISTS, "anyOf")):
        value = node.get(key)
        children = value.items() if isinstance(value, dict) and key in _SCHEMA_MAPS else \
            ((None, value),) if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for name, child in children:
            found = _first_violation(child, context + ((key,) if name is None else (key, name)))
            if found:
                return found
    return None
