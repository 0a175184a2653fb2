"""Which weights stored entries were computed under: an identity over every element of the weights, and a cheap
per-request signal that says when to compute it again.

A KV block or checkpoint is only valid for the weights that computed it. Loading, switching, merging or rescaling a
PEFT/LoRA adapter, ``load_state_dict`` or an in-place edit under ``torch.no_grad()`` changes them without changing
the model's identity (class, config, dtype), and so does retraining a few rows of a 150k-row embedding. So the
weights get a :func:`weights_identity` over every element of every parameter and buffer, and the weights state (that
identity and the adapters' state) is mixed into the root of every block hash chain (vLLM mixes the LoRA id into its
block hashes for the same reason). Entries stored under other weights are then never served, and switching back (the
same adapter again, the original weights restored) finds them again.

Which tensors: every parameter and every buffer, persistent or not, read from accelerate's offload maps where a
model is offloaded. Buffers change outputs in the supported families: rotary ``inv_freq`` (and ``original_inv_freq``,
which dynamic RoPE restores), Falcon-H1's ``mup_vector`` and the MoE routing biases (``e_score_correction_bias``,
``expert_bias``, ZAYA's ``balancing_biases``); none is only bookkeeping, and a small buffer costs little to read.

How: :func:`tensor_digest` sums the raw bits of each tensor times fixed odd multipliers with torch ops on the
tensor's own device (no copy to the host), and its value is the same on every device, so a file saved from a model on
a GPU loads into the same weights on the CPU and processes with differently placed weights share through the tier.
Measured on a shared 2-core CPU (``benchmarks/weights_identity.py``): 0.2-0.6 GB/s, as fast as hashlib's SHA-256 of
the same bytes for fp32 and up to 1.6x slower for bf16 (Qwen3.5-0.8B: 13 s in fp32; a cut Jamba-v0.1 of 13.7 GB: 22 s).

Every request reads :func:`weights_key` (each tensor's identity, storage and autograd version counter, 64 evenly
spaced elements of each, and the adapters' state), and the identity is computed again when it differs; it is also
computed at construction, ``save()``, ``load()`` and ``clear()``. The samples catch dense writes that bypass the
version counter (writes through ``param.data``, as peft's ``merge_and_unload`` does); the key costs 5-66 ms on that
CPU (131-322 tensors), under 0.3% of a 64-token forward. Not seen between those points: a sparse write through
``param.data`` (a few rows; call ``cache.clear()`` after one) and a write into accelerate's offload maps of an
offloaded model (construction, ``save()``, ``load()`` and ``clear()`` read them).

A trainer, whose every optimizer step changes every weight, declares its steps instead
(:meth:`WeightsTracker.declare_step`, reached through ``hf_hybridcache.post_training``): each step is a new weights
state named without reading a weight, and requests read nothing until ``clear()`` or ``save()`` read the weights
again (``benchmarks/grpo_rollouts.py`` measures both ways beside a trainer's step).
"""

from __future__ import annotations

import functools
import hashlib
import secrets

import torch

from .. import _compat

#: Elements summed with one run of multipliers in :func:`tensor_digest`; part of the digest's definition (the same
#: on every device), so changing it changes every identity.
RUN_ELEMENTS = 1 << 16
#: Runs reduced per torch call: on CPU the int64 temporaries stay in cache (measured fastest), elsewhere fewer
#: kernel launches.
_RUNS_PER_STEP = {"cpu": 4}
_DEFAULT_RUNS_PER_STEP = 64
#: Integer dtype of each element width: a tensor's raw bits are read through it.
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Elements of each tensor read at every request (:func:`weights_key`).
KEY_SAMPLES = 64


@functools.cache
def _multipliers(device: torch.device) -> torch.Tensor:
    """``[RUN_ELEMENTS]`` int64 odd multipliers on ``device``, the same everywhere (SHAKE-128 of a fixed label)."""
    raw = hashlib.shake_128(b"hf_hybridcache weights identity multipliers").digest(8 * RUN_ELEMENTS)
    return (torch.frombuffer(bytearray(raw), dtype=torch.int64) | 1).to(device)


def _raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensor`` as signed integers of the same width (1-D; a copy only when not contiguous)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(_INTS.get(flat.element_size(), torch.uint8))


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """A digest of every element of ``tensor`` (any shape, dtype and device), computed on its device.

    Each run of :data:`RUN_ELEMENTS` elements gives ``sum(m_j * x_j) mod 2**64``, where ``x_j`` are the elements' raw
    bits read as signed integers of their width and ``m_j`` fixed odd 64-bit multipliers; the digest is those sums,
    ``ceil(numel / RUN_ELEMENTS)`` little-endian int64 (8 bytes per 65,536 elements). Any change of a single element
    changes it (an odd multiplier is invertible mod ``2**64``); a change of several elements of one run goes unseen
    with odds of about ``2**-(63 - k)``, where ``2**k`` divides every element's change (``k = 0`` for the low bits a
    fine-tune moves; flipping the signs of an even number of fp32 elements, ``k = 31``, is the worst case). Integer
    sums mod ``2**64`` do not depend on the reduction order, so the digest is the same on every device and thread
    count. Memory: one int64 temporary of 4 runs (CPU) or 64 runs (other devices). A meta tensor gives ``b""``.
    """
    if tensor.device.type == "meta" or not tensor.numel():
        return b""
    bits, table = _raw_bits(tensor), _multipliers(tensor.device)
    step = RUN_ELEMENTS * _RUNS_PER_STEP.get(tensor.device.type, _DEFAULT_RUNS_PER_STEP)
    work = torch.empty(min(bits.numel(), step), dtype=torch.int64, device=tensor.device)
    sums = []
    for start in range(0, bits.numel(), step):
        chunk = work[: min(step, bits.numel() - start)].copy_(bits[start : start + step])
        whole = chunk.numel() // RUN_ELEMENTS * RUN_ELEMENTS
        if whole:
            sums.append(chunk[:whole].view(-1, RUN_ELEMENTS).mul_(table).sum(dim=1))
        if whole < chunk.numel():
            sums.append(chunk[whole:].mul_(table[: chunk.numel() - whole]).sum().reshape(1))
    return torch.cat(sums).cpu().numpy().tobytes()


def weights_identity(model: torch.nn.Module) -> str:
    """SHA-256 over the name, shape, dtype and :func:`tensor_digest` of every parameter and buffer of ``model``, in
    module order (offloaded ones read from accelerate's offload maps). Reads every weight once: see
    ``benchmarks/weights_identity.py`` for its cost."""
    h = hashlib.sha256(b"hf_hybridcache-weights-identity\0")
    digests: dict[int, bytes] = {}  # a tensor tied into several modules is read once
    for name, tensor, value in _compat.weight_tensors(model):
        if id(tensor) not in digests:
            digests[id(tensor)] = tensor_digest(value)
        digest = digests[id(tensor)]
        h.update(f"{name}|{tuple(value.shape)}|{value.dtype}|{len(digest)}|".encode())
        h.update(digest)
    return h.hexdigest()


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's tuner layers in ``model`` (LoRA and the rest); none when peft is not installed."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def adapter_state(layers: list[torch.nn.Module]) -> tuple:
    """Per tuner layer: the active adapters, whether they are disabled, which are merged into the base weights and
    their scaling (``rescale_adapter_scale`` changes outputs through it alone), as a hashable tuple."""
    return tuple(
        (
            tuple(layer.active_adapters),
            bool(layer.disable_adapters),
            tuple(layer.merged_adapters),
            tuple(sorted((str(k), repr(v)) for k, v in getattr(layer, "scaling", {}).items())),
        )
        for layer in layers
    )


def weights_key(model: torch.nn.Module, views: dict[int, tuple] | None = None) -> int:
    """Changes when a parameter or buffer is added, removed, replaced, re-pointed, written in place (autograd version
    counter) or written through ``.data`` where one of its :data:`KEY_SAMPLES` evenly spaced elements changed. Costs
    one walk of the module tree and one copy per device and dtype (see ``benchmarks/weights_identity.py``).

    ``views``: a dict kept across calls for one model, in which each tensor's strided view of its samples is made
    once (per tensor object, storage and shape; entries of tensors that left the model are dropped)."""
    tensors = _compat.module_tensors(model)
    kept = {} if views is None else views
    current: dict[int, tuple] = {}
    samples: dict[tuple, list[torch.Tensor]] = {}  # (device, dtype) -> samples, concatenated per group
    with torch.no_grad():  # views of parameters without autograd's bookkeeping
        for t in tensors:
            if not t.numel() or t.device.type == "meta":
                continue
            entry = kept.get(id(t))
            if entry is None or entry[0] is not t or entry[1] != t.data_ptr() or entry[2] != t.shape:
                # Elements of the storage span the tensor covers (its own elements when contiguous): no copy.
                span = t.numel() if t.is_contiguous() else 1 + sum((s - 1) * d for s, d in zip(t.shape, t.stride()))
                # Of a detached alias: a view kept across calls must outlive in-place writes under autograd.
                picked = t.detach().as_strided((min(span, KEY_SAMPLES),), (max(1, span // KEY_SAMPLES),))
                entry = (t, t.data_ptr(), t.shape, picked)
            current[id(t)] = entry
            samples.setdefault((t.device, t.dtype), []).append(entry[3])
    if views is not None:
        views.clear()
        views.update(current)
    read = [torch.cat(group).cpu() for _, group in sorted(samples.items(), key=lambda item: str(item[0]))]
    raw = b"".join(r.view(_INTS.get(r.element_size(), torch.uint8)).numpy().tobytes() for r in read)
    # A tensor accelerate offloaded is a meta placeholder between forwards, made anew (and as many) at each one: it
    # does not count (its weights live in the hook's weights map, which weights_identity reads at every request).
    return hash((tuple((id(t), t.data_ptr(), t._version) for t in tensors if t.device.type != "meta"), raw))


class WeightsTracker:
    """The weights state of one model, re-read at every request, or declared by a trainer once per step.

    Attributes:
        identity: :func:`weights_identity` of the weights as last computed (hex SHA-256).
        fingerprint: names the current weights state (identity + adapter state, or the declared step); mixed into
            root hashes.
        generation: counts the changes of :func:`weights_key` seen so far (cheap to read again: :meth:`observe`) and
            the declared steps; a request stores what it computes only while the generation it began under is the
            current one.
        declared_steps: steps declared since the weights were last read in full (:meth:`declare_step`); 0 when the
            weights are read at every request.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._views: dict[int, tuple] = {}  # weights_key's sample views, made once per tensor
        self._key: int | None = None
        self.generation = 0
        self._identity_generation = -1
        self.fingerprint = ""
        self.declared_steps = 0
        self._nonce = secrets.token_hex(16)  # declared states are this tracker's own: no other process shares them
        self._declared_total = 0  # never reset: a step declared after a full read must not reuse an earlier name
        self.refresh(full=True)

    def declare_step(self) -> int:
        """The weights changed and the caller says so (a trainer's optimizer step): the weights state becomes step
        ``declared_steps + 1`` of this tracker, named without reading any weight (O(1)); from now until
        :meth:`refresh` with ``full``, :meth:`observe` and :meth:`refresh` read nothing either, so an edit between
        two declared steps is not seen. Returns the step's number."""
        self.declared_steps += 1
        self._declared_total += 1
        self.generation += 1
        state = f"declared|{self._nonce}|{self._declared_total}"
        self.fingerprint = hashlib.sha256(state.encode()).hexdigest()
        return self.declared_steps

    def observe(self) -> int:
        """Re-read :func:`weights_key` (not the identity) and return the generation: one more than before when the
        key changed since the last look. An in-place write bumps a tensor's version counter, so a write that was
        undone in place still counts; a write through ``.data`` undone before the next look does not. Between
        declared steps nothing is read."""
        if self.declared_steps:
            return self.generation
        key = weights_key(self._model, self._views)
        if key != self._key:
            self._key = key
            self.generation += 1
        return self.generation

    def refresh(self, full: bool = False) -> bool:
        """Re-read the weights state: the identity is computed again when the generation moved (:meth:`observe`), or
        always with ``full`` or when accelerate offloaded some weights (:func:`weights_key` does not see those: an edit
        to them is seen by the next request, not by a running one). True when the fingerprint changed since the last
        call. Between declared steps (:meth:`declare_step`) nothing is read unless ``full``, which returns to reading
        the weights at every request."""
        if self.declared_steps and not full:
            return False
        self.declared_steps = 0
        offloaded = any(t.device.type == "meta" for t in _compat.module_tensors(self._model))
        if self.observe() != self._identity_generation or full or offloaded:
            self._identity_generation = self.generation
            self._adapters = adapter_layers(self._model)
            self.identity = weights_identity(self._model)
        state = f"{self.identity}|{adapter_state(self._adapters)}"
        fingerprint = hashlib.sha256(state.encode()).hexdigest()
        changed, self.fingerprint = fingerprint != self.fingerprint, fingerprint
        return changed
