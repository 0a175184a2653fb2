"""The tensor layout of stored entries as named tensors: the one description that everything serializing them uses.

A KV block and a checkpoint are written as named tensors in two places — a cache file
(:mod:`~hf_hybridcache.core.persistence`, which stacks the entries of each name along a new first dim) and a value of
the remote tier (:mod:`~hf_hybridcache.remote.codec`) — and both name, shape, check and rebuild them through the
:class:`EntryLayout` derived here from the model's :class:`~hf_hybridcache.config.ModelStateSpec`, so the writer and
the reader of either can never describe one state two ways (they once did: a layer holding several states, such as
Inkling's four conv windows, was written under one name and looked up under another).

Names and shapes of one entry (legend in :mod:`~hf_hybridcache.config`):

- KV block: ``keys.{layer}`` ``[Hkv, block_size, Dk]`` and ``values.{layer}`` ``[Hkv, block_size, Dv]`` per attention
  layer, in the layer's KV dtype (two tensors: MLA layers cache keys and values of different widths).
- checkpoint: ``conv.{state}`` ``[C, W]`` and ``ssm.{state}`` (``[I, N]`` for Mamba-1, ``[0]`` for a short conv, which
  keeps no recurrent state) per state, in the states' dtypes, where ``{state}`` is
  :attr:`~hf_hybridcache.config.MambaLayerSpec.name`: the layer index, or ``{layer}.{state idx}`` for a layer's
  second and later states. The store keeps a checkpoint's tensors with a leading batch dim of 1 (``[1, C, W]``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config import ModelStateSpec, StateKey, TensorSpec

#: The two kinds of entries, as the store names them.
KINDS = ("kv", "checkpoint")


@dataclass(frozen=True)
class Field:
    """One named tensor of an entry.

    Attributes:
        name: its name in a file or a tier value.
        key: where the store keeps it: the attention layer index (KV) or the state key (checkpoint).
        part: which tensor of the store's pair it is: 0 for keys / conv state, 1 for values / SSM state.
        tensor: shape and dtype of one entry's tensor under ``name``.
        stored_shape: its shape in the store (``tensor.shape``, with a leading 1 for a checkpoint's states).
    """

    name: str
    key: StateKey
    part: int
    tensor: TensorSpec
    stored_shape: tuple[int, ...]


@dataclass(frozen=True)
class EntryLayout:
    """The named tensors of one kind of entry (``"kv"`` or ``"checkpoint"``) of one model."""

    kind: str
    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        assert len(set(names)) == len(names), f"two {self.kind} tensors share a name: {names}"
        slots = [(f.key, f.part) for f in self.fields]
        assert len(set(slots)) == len(slots), f"two {self.kind} tensors fill one stored tensor: {slots}"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def num_bytes(self) -> int:
        """Bytes of one entry's tensors."""
        return sum(f.tensor.num_bytes for f in self.fields)

    def shapes(self, num_entries: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of one entry, or of ``num_entries`` entries stacked along a new first dim."""
        lead = () if num_entries is None else (num_entries,)
        return {f.name: ((*lead, *f.tensor.shape), f.tensor.dtype) for f in self.fields}

    def tensors(self, entry: Mapping[StateKey, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A stored entry (``{key: (keys, values)}`` or ``{state key: (conv, ssm)}``) as ``{name: tensor}``: views of
        the stored tensors, on their devices."""
        named = {}
        for f in self.fields:
            stored = entry[f.key][f.part]
            assert stored.shape == f.stored_shape and stored.dtype == f.tensor.dtype, (
                f"stored {f.name} is {tuple(stored.shape)} {stored.dtype}, its layout {f.stored_shape} {f.tensor.dtype}"
            )
            named[f.name] = stored.reshape(f.tensor.shape)
        return named

    def entry(self, tensors: Mapping[str, torch.Tensor]) -> dict[StateKey, tuple[torch.Tensor, torch.Tensor]]:
        """Named tensors that fit :meth:`shapes` as a stored entry (views of them, in the store's shapes)."""
        pairs: dict[StateKey, list] = {}
        for f in self.fields:
            pairs.setdefault(f.key, [None, None])[f.part] = tensors[f.name].reshape(f.stored_shape)
        return {key: (first, second) for key, (first, second) in pairs.items()}


def _kv_fields(spec: ModelStateSpec) -> tuple[Field, ...]:
    fields = []
    for a in spec.attention:
        for part, (name, dim) in enumerate((("keys", a.head_dim), ("values", a.value_head_dim))):
            shape = (a.num_kv_heads, spec.block_size, dim)
            fields.append(Field(f"{name}.{a.layer_idx}", a.layer_idx, part, TensorSpec(shape, a.dtype), shape))
    return tuple(fields)


def _checkpoint_fields(spec: ModelStateSpec) -> tuple[Field, ...]:
    fields = []
    for m in spec.mamba:
        for part, (name, state) in enumerate((("conv", m.conv), ("ssm", m.ssm))):
            fields.append(Field(f"{name}.{m.name}", m.key, part, state, (1, *state.shape)))
    return tuple(fields)


@functools.lru_cache(maxsize=64)
def entry_layout(spec: ModelStateSpec, kind: str) -> EntryLayout:
    """The layout of ``kind`` (``"kv"`` or ``"checkpoint"``) entries of a model with state spec ``spec``."""
    assert kind in KINDS, f"unknown entry kind {kind!r}"
    return EntryLayout(kind, _kv_fields(spec) if kind == "kv" else _checkpoint_fields(spec))
