"""What the server serves: a model and its tokenizer, from ``toy:FAMILY`` (the package's seeded tiny model of that
family with the byte tokenizer and its chat template, no download) or a path / hub id (``from_pretrained``); for a
vision-language wrapper (``model_type`` of :data:`~hf_hybridcache.multimodal.WRAPPERS`) the wrapper itself
(``AutoModelForImageTextToText``) and its processor (``AutoProcessor``), whose tokenizer is the tokenizer."""

from __future__ import annotations

import os

import torch

TOY_PREFIX = "toy:"

#: ``--dtype`` choices -> torch dtypes ("auto": the checkpoint's own dtype).
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StartupError(Exception):
    """What is wrong with the server's startup arguments, in one line that says what to do (``python -m
    hf_hybridcache.serve`` prints it and exits with status 2)."""


#: Files of which a folder holds at least one when it has a tokenizer ``AutoTokenizer`` can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load(model_id: str, dtype: str = "auto", device_map: str | None = None, tokenizer_id: str | None = None,
         trust_remote_code: bool = False, check_support: bool = True, with_tokenizer: bool = True,
         flag: str = "--model"):
    """The ``(model, tokenizer)`` for ``model_id`` in eval mode (a vision-language wrapper: the wrapper itself; its
    processor: :func:`load_processor`).

    Args:
        model_id: ``toy:FAMILY`` (a family of :data:`~hf_hybridcache.toy.configs.TINY_CONFIGS`, seed 0, long-memory
            init, float32 unless ``dtype`` says otherwise) or a local path / hub id.
        dtype: a key of :data:`DTYPES`.
        device_map: accelerate's ``device_map`` for ``from_pretrained`` (``"auto"``, ``"cpu"``, ``"cuda:0"``); for a toy
            model, the device it is moved to.
        tokenizer_id: the tokenizer's local path or hub id (None: ``model_id``'s).
        trust_remote_code: let ``from_pretrained`` run code the folder or repository ships (its ``auto_map``).
        check_support: refuse, from its config and before its weights load, a model the cache does not serve.
        with_tokenizer: False: load no tokenizer (a draft model's; the tokenizer returned is None).
        flag: the option that named ``model_id``, as the errors name it.

    Raises:
        ValueError: an unknown dtype or toy family.
        StartupError: a local path that does not exist, a folder without a tokenizer, a hub id that cannot be loaded
            (offline, not found), or (``check_support``) a model the cache does not serve: one line that says what to
            do.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    if model_id.startswith(TOY_PREFIX):
        from ..toy import build_model, byte_tokenizer

        torch_dtype = torch.float32 if dtype == "auto" else DTYPES[dtype]
        try:
            model = build_model(model_id[len(TOY_PREFIX):], seed=0, dtype=torch_dtype)
        except ValueError as error:  # an unknown family: say which option named it
            raise ValueError(f"{flag} {model_id}: {error}") from None
        if device_map not in (None, "auto"):
            model = model.to(device_map)
        if not with_tokenizer:
            return model, None
        if tokenizer_id is None:
            return model, byte_tokenizer()
        check_source(tokenizer_id, "--tokenizer", needs_tokenizer=True)
        return model, _loaded(AutoTokenizer.from_pretrained, tokenizer_id, "tokenizer", "--tokenizer")

    from ..models import support_for_config
    from ..multimodal import WRAPPERS

    tokenizer_id = model_id if tokenizer_id is None else tokenizer_id
    check_source(model_id, flag, needs_tokenizer=with_tokenizer and tokenizer_id == model_id)
    if with_tokenizer and tokenizer_id != model_id:
        check_source(tokenizer_id, "--tokenizer", needs_tokenizer=True)
    tokenizer_flag = flag if tokenizer_id == model_id else "--tokenizer"
    remote = {"trust_remote_code": True} if trust_remote_code else {}
    config = _loaded(AutoConfig.from_pretrained, model_id, "config", flag, **remote)
    if check_support:  # before the weights load (minutes on a real checkpoint), from config.json alone
        try:
            support_for_config(config)
        except ValueError as unsupported:
            hint = ("--no-cache serves it without the cache." if flag == "--model" else
                    "A draft model is served by the engine too: pick one of a family the cache serves.")
            raise StartupError(f"{flag} {model_id}: {unsupported} {hint}") from None
    tokenizer = None
    if with_tokenizer:
        tokenizer = _loaded(AutoTokenizer.from_pretrained, tokenizer_id, "tokenizer", tokenizer_flag, **remote)
    auto = AutoModelForImageTextToText if config.model_type in WRAPPERS else AutoModelForCausalLM
    model = _loaded(auto.from_pretrained, model_id, "model", flag, dtype=DTYPES[dtype], device_map=device_map,
                    **remote)
    return model.eval(), tokenizer


def load_processor(source: str, flag: str = "--model", trust_remote_code: bool = False):
    """The processor (``AutoProcessor``) of a vision-language checkpoint at ``source``.

    Raises:
        StartupError: it cannot be loaded, or what loads is not a processor that takes images (a folder without a
            processor config gives its tokenizer).
    """
    from transformers import AutoProcessor

    remote = {"trust_remote_code": True} if trust_remote_code else {}
    processor = _loaded(AutoProcessor.from_pretrained, source, "processor", flag, **remote)
    if getattr(processor, "image_processor", None) is None or getattr(processor, "image_token", None) is None:
        raise StartupError(f"{flag} {source}: AutoProcessor gave a {type(processor).__name__}, not a processor that "
                           "takes images; save the checkpoint's processor there (processor.save_pretrained).")
    return processor


def is_local(source: str) -> bool:
    """Whether ``source`` names a local path (absolute, relative, existing, or with two ``/`` or more), not a hub id."""
    return os.path.isabs(source) or source.startswith((".", "~")) or os.path.exists(source) or source.count("/") > 1


def has_tokenizer(path: str) -> bool:
    """Whether the folder ``path`` holds a saved tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def check_source(source: str, flag: str, needs_tokenizer: bool) -> None:
    """Refuse a local path that does not exist, and a model folder without a tokenizer when it must give one."""
    if not is_local(source):
        return
    path = os.path.expanduser(source)
    if not os.path.isdir(path):
        raise StartupError(f"{flag} {source}: no such folder; pass a folder saved with save_pretrained() or a hub id.")
    if needs_tokenizer and not has_tokenizer(path):
        raise StartupError(f"{flag} {source} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one "
                           "there (tokenizer.save_pretrained) or pass --tokenizer PATH.")


def _loaded(load_fn, source: str, what: str, flag: str, **kwargs):
    """``load_fn(source, **kwargs)``, with a failure to find or download it as one :class:`StartupError` line."""
    try:
        return load_fn(source, **kwargs)
    except (OSError, ValueError) as problem:
        first = str(problem).strip().splitlines()[0] if str(problem).strip() else type(problem).__name__
        if "trust_remote_code" in str(problem):
            raise StartupError(f"{flag} {source}: the {what} ships code of its own (its auto_map); read it, then "
                               "pass --trust-remote-code to run it.") from None
        where = "the folder" if is_local(source) else "the Hugging Face Hub (offline, or no such repository?)"
        raise StartupError(f"{flag} {source}: the {what} could not be loaded from {where}: {first}") from None
