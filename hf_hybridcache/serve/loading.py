"""What the server serves: a model and its tokenizer, from ``toy:FAMILY`` (the package's seeded tiny model of that
family with the byte tokenizer and its chat template, no download) or a path / hub id (``from_pretrained``)."""

from __future__ import annotations

import torch

TOY_PREFIX = "toy:"

#: ``--dtype`` choices -> torch dtypes ("auto": the checkpoint's own dtype).
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(model_id: str, dtype: str = "auto", device_map: str | None = None):
    """The ``(model, tokenizer)`` for ``model_id`` in eval mode.

    Args:
        model_id: ``toy:FAMILY`` (a family of :data:`~hf_hybridcache.toy_configs.TINY_CONFIGS`, seed 0, long-memory
            init, float32 unless ``dtype`` says otherwise) or a local path / hub id.
        dtype: a key of :data:`DTYPES`.
        device_map: accelerate's ``device_map`` for ``from_pretrained`` (``"auto"``, ``"cpu"``, ``"cuda:0"``); for a toy
            model, the device it is moved to.

    Raises:
        ValueError: an unknown dtype or toy family.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    if model_id.startswith(TOY_PREFIX):
        from ..toy import build_model, byte_tokenizer

        torch_dtype = torch.float32 if dtype == "auto" else DTYPES[dtype]
        model = build_model(model_id[len(TOY_PREFIX):], seed=0, dtype=torch_dtype)
        if device_map not in (None, "auto"):
            model = model.to(device_map)
        return model, byte_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=DTYPES[dtype], device_map=device_map)
    return model.eval(), tokenizer
