"""The server's speculative decoding: ``--speculative ngram|draft:PATH|mtp`` and ``--num-speculative-tokens K`` made
into the engine's :class:`~hf_hybridcache.engine.Speculation` (docs/speculative.md), and a request's
``num_speculative_tokens`` checked against them.

- ``ngram``: :class:`~hf_hybridcache.engine.NgramDrafter` (prompt lookup, no model).
- ``draft:PATH``: :class:`~hf_hybridcache.engine.DraftModelDrafter` over a model loaded as ``--model`` loads one (a
  folder saved with ``save_pretrained``, a hub id, or ``toy:FAMILY``), with the target's tokenizer, dtype and device
  map, served by an engine of its own over its own :class:`~hf_hybridcache.HybridPrefixCache` (the target's block
  size, retention and eviction; no shared tier).
- ``mtp``: :class:`~hf_hybridcache.engine.MTPDrafter`, the MTP head ``--model``'s checkpoint ships (its ``mtp.*``
  weights; Qwen3.5, Qwen3.5-MoE and Qwen3-Next), drafting from the target's hidden states.

Flag combinations that cannot run are found from the arguments alone (:func:`speculative_args_error`), before a
model loads; a draft model or an MTP head that cannot serve is refused once the target has loaded.
"""

from __future__ import annotations

import argparse
import os

from .loading import TOY_PREFIX, StartupError, check_source, has_tokenizer
from .schema import APIError

NGRAM, DRAFT_PREFIX, MTP = "ngram", "draft:", "mtp"
#: How startup messages name the draft model.
DRAFT_FLAG = "the draft model (--speculative draft:PATH)"
#: Draft tokens per request and step when ``--num-speculative-tokens`` is not given.
DEFAULT_SPECULATIVE_TOKENS = 4


def speculative_kind(value: str) -> str:
    """``--speculative``'s argparse type: ``ngram``, ``draft:PATH`` (PATH not empty) or ``mtp``.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it as a usage error, exit status 2).
    """
    if value in (NGRAM, MTP) or (value.startswith(DRAFT_PREFIX) and len(value) > len(DRAFT_PREFIX)):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not a drafter: use ngram, draft:PATH (a saved model folder, a hub "
                                     "id or toy:FAMILY, with the target's tokenizer) or mtp.")


def speculative_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the speculation flags of ``args`` (one sentence that says what to do), or None."""
    from ..engine.speculative import MAX_SPECULATIVE_TOKENS

    kind, k = args.speculative, args.num_speculative_tokens
    if kind is None:
        if k is not None:
            return "--num-speculative-tokens needs --speculative ngram|draft:PATH|mtp; add one, or drop the count."
        return None
    if args.no_cache:
        return (f"--speculative {kind} needs the engine, and --no-cache serves one plain generate() at a time; drop "
                "--no-cache (or --speculative).")
    if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        return (f"--num-speculative-tokens must be 1 to {MAX_SPECULATIVE_TOKENS} (draft tokens a request verifies per "
                f"step), got {k}; leave --speculative out to serve without speculation.")
    if kind == MTP and args.model.startswith(TOY_PREFIX):
        return (f"--speculative mtp reads the MTP head a checkpoint ships (its mtp.* weights), and {args.model} has "
                "none; use --speculative ngram or draft:PATH, or serve a Qwen3.5 checkpoint folder.")
    if kind.startswith(DRAFT_PREFIX):
        try:  # a draft folder that is not there, before minutes of loading the target
            check_source(kind[len(DRAFT_PREFIX):], DRAFT_FLAG, needs_tokenizer=False)
        except StartupError as error:
            return str(error)
    return None


def speculation_for(args: argparse.Namespace, target, tokenizer=None):
    """The :class:`~hf_hybridcache.engine.Speculation` that ``args`` asks for (None: ``--speculative`` not given).

    Args:
        args: the parsed command line (``--speculative``, ``--num-speculative-tokens`` and the cache and loading
            options a draft model shares with the target).
        target: the served model (a draft model is loaded onto its device when ``--device-map`` is not given).
        tokenizer: the served model's tokenizer, which a draft model folder's own tokenizer must equal (None: not
            compared).

    Raises:
        ValueError: a flag combination :func:`speculative_args_error` refuses.
        StartupError: the draft model cannot be loaded (:func:`~hf_hybridcache.serve.loading.load`), it is a
            vision-language wrapper, its vocabulary is smaller than the target's, or its folder holds a tokenizer
            other than ``tokenizer``; ``mtp`` for a family whose head is not read or a checkpoint without ``mtp.*``
            weights.
    """
    problem = speculative_args_error(args)
    if problem is not None:
        raise ValueError(problem)
    if args.speculative is None:
        return None
    from ..engine import DraftModelDrafter, NgramDrafter, Speculation

    k = args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
    if args.speculative == NGRAM:
        return Speculation(NgramDrafter(), k)
    if args.speculative == MTP:
        return Speculation(_mtp_drafter(args, target), k)
    return Speculation(DraftModelDrafter(_draft_cache(args, target, tokenizer)), k)


def _mtp_drafter(args: argparse.Namespace, target):
    """The :class:`~hf_hybridcache.engine.MTPDrafter` of ``--model``'s checkpoint (a hub id: its files in the hub
    cache, which loading the model filled)."""
    from .._compat.mtp import mtp_support_error
    from ..engine import MTPDrafter
    from .loading import is_local

    problem = mtp_support_error(target.config)
    if problem is not None:
        raise StartupError(f"--speculative mtp: {problem}")
    folder = args.model
    if not is_local(folder):
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(folder, allow_patterns=["*.safetensors", "*.safetensors.index.json"])
        except Exception as error:  # noqa: BLE001 - offline, gone: one line at startup
            raise StartupError(f"--speculative mtp: the safetensors of {args.model} could not be read from the hub "
                               f"cache: {error}") from None
    try:
        return MTPDrafter(folder)
    except ValueError as error:
        raise StartupError(f"--speculative mtp: {error}") from None


def _draft_cache(args: argparse.Namespace, target, tokenizer=None):
    from .. import HybridPrefixCache
    from ..multimodal import modalities_of
    from .loading import load

    source, flag = args.speculative[len(DRAFT_PREFIX):], DRAFT_FLAG
    model, _ = load(source, args.dtype, args.device_map, trust_remote_code=args.trust_remote_code,
                    with_tokenizer=False, flag=flag)
    if modalities_of(model):
        raise StartupError(f"{flag} {source}: a vision-language wrapper cannot draft; use a text model with the "
                           "target's tokenizer.")
    vocab, wanted = model.get_input_embeddings().num_embeddings, target.get_input_embeddings().num_embeddings
    if vocab < wanted:
        raise StartupError(f"{flag} {source}: its vocabulary ({vocab} tokens) is smaller than the target's ({wanted}); "
                           "use a draft model with the target's tokenizer.")
    if tokenizer is not None:
        _check_tokenizer(source, flag, tokenizer, args.trust_remote_code)
    if args.device_map is None:
        model = model.to(target.get_input_embeddings().weight.device)
    try:
        return HybridPrefixCache(model, args.block_size, args.retention_interval, args.max_cache_bytes,
                                 eviction=args.eviction, offload=args.offload)
    except ValueError as error:
        raise StartupError(f"{flag} {source}: its own prefix cache (it takes --max-cache-bytes, --block-size and "
                           f"--retention-interval as the target's does) cannot be made: {error}") from None


def _check_tokenizer(source: str, flag: str, tokenizer, trust_remote_code: bool) -> None:
    """Refuse a draft model folder whose own tokenizer maps tokens to other ids than the target's: its drafts would
    name other tokens and be rejected (replies stay exact, every step pays for a draft it throws away). A folder
    without a tokenizer, or a hub id, is not compared."""
    from transformers import AutoTokenizer

    from .loading import _loaded

    path = os.path.expanduser(source)
    if not os.path.isdir(path) or not has_tokenizer(path):
        return
    remote = {"trust_remote_code": True} if trust_remote_code else {}
    theirs = _loaded(AutoTokenizer.from_pretrained, source, "tokenizer", flag, **remote).get_vocab()
    ours = tokenizer.get_vocab()
    differ = sum(theirs.get(token) != index for token, index in ours.items())
    if differ:
        raise StartupError(f"{flag} {source}: its tokenizer is not the target's ({differ} of the target's "
                           f"{len(ours)} tokens have another id or none), so its drafts would be other tokens, "
                           "never accepted; use a draft model with the target's tokenizer.")


def request_speculative_tokens(value: int | None, most: int) -> int | None:
    """A request's ``num_speculative_tokens`` as the engine takes it (None: the server's default), checked against
    ``most`` (the server's ``--num-speculative-tokens``; 0 when it does not speculate).

    Raises:
        APIError: 400 for a value outside ``0 .. most`` (0 is always allowed: no speculation for this request).
    """
    if value is None or value == 0:
        return None if value is None or most == 0 else 0
    if most == 0:
        raise APIError(400, f"num_speculative_tokens={value}: this server does not speculate (started without "
                       "--speculative); send 0 or leave the field out.", param="num_speculative_tokens")
    if not 0 <= value <= most:
        raise APIError(400, f"num_speculative_tokens must be 0 (no speculation for this request) to {most} (the "
                       f"server's --num-speculative-tokens), got {value}.", param="num_speculative_tokens")
    return value
