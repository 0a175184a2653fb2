"""``python -m hf_hybridcache.serve --model PATH_OR_ID|toy:FAMILY [--port N] [cache options]``."""

from __future__ import annotations

import argparse
import os
import sys

from .images import ImageLimits
from .loading import DTYPES
from .speculation import DEFAULT_SPECULATIVE_TOKENS, speculative_args_error, speculative_kind


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default (once: a help text that names its default keeps it)."""

    def _get_help_string(self, action):
        if action.required or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _retention(value: str):
    return value if value == "dense" else int(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hf_hybridcache.serve", description=__doc__,
                                     formatter_class=_DefaultsShown)
    parser.add_argument("--model", required=True, help="a local path or hub id, or toy:FAMILY (e.g. toy:jamba)")
    parser.add_argument("--tokenizer", default=None,
                        help="the tokenizer's local path or hub id (default: the model's; a toy's byte tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument("--dtype", choices=list(DTYPES), default="auto",
                        help="the weights' dtype (auto: the checkpoint's)")
    parser.add_argument("--device-map", default=None, help="from_pretrained's device_map (e.g. auto, cuda:0, cpu)")
    parser.add_argument("--api-key", default=None,
                        help="clients must send Authorization: Bearer KEY on /v1/ (default: $HF_HYBRIDCACHE_API_KEY; "
                        "unset: no key)")
    parser.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    parser.add_argument("--max-tokens", type=int, default=256, help="a chat reply's max_tokens when none is sent")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + reply tokens of one request at most; over it a 400 context_length_exceeded "
                        "(default: what the model's positions and the memory allow)")
    parser.add_argument("--max-running-requests", type=int, default=32, help="requests in one engine batch at most")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens in one engine step at most")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let from_pretrained run code the checkpoint ships (its auto_map: a custom processor)")
    images = parser.add_argument_group("images (a vision-language checkpoint's chat image parts)")
    images.add_argument("--max-image-bytes", type=int, default=ImageLimits.max_image_bytes,
                        help="an image part's encoded size at most, in bytes; over it a 400")
    images.add_argument("--allow-remote-images", action="store_true",
                        help="fetch http(s) image URLs (off: only data: URLs are taken, a remote URL is a 400)")
    images.add_argument("--image-fetch-timeout", type=float, default=ImageLimits.fetch_timeout_s,
                        help="seconds a remote image's whole download may take (--allow-remote-images)")
    cache = parser.add_argument_group("prefix cache (HybridPrefixCache's options)")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per stored KV block")
    cache.add_argument("--retention-interval", type=_retention, default=0, help='"dense", 0 or a multiple of tokens')
    cache.add_argument("--max-cache-bytes", type=int, default=None,
                       help="the stored cache's budget in bytes (default: the cache's own)")
    cache.add_argument("--eviction", choices=["flop_aware", "lru"], default="flop_aware", help="the eviction policy")
    cache.add_argument("--offload", default=None, help='"cpu" to keep stored entries in host memory')
    cache.add_argument("--remote", default=None,
                       help="redis://... for the shared second tier (redis+cluster://host:port,... for a cluster)")
    cache.add_argument("--deterministic", action="store_true",
                       help="the same tokens and logprobs bit for bit whatever was cached or shared a step (on CPU; "
                       "most hybrid families, the rest refused with what they lack: docs/deterministic.md)")
    cache.add_argument("--no-cache", action="store_true",
                       help="no prefix cache and no engine: one plain generate() at a time (the stock baseline)")
    spec = parser.add_argument_group("speculative decoding (docs/speculative.md; exact: greedy replies unchanged)")
    spec.add_argument("--speculative", type=speculative_kind, default=None, metavar="ngram|draft:PATH|mtp",
                      help="draft tokens for every request to verify in its steps: ngram (prompt lookup, no model), "
                      "draft:PATH (a smaller model with the target's tokenizer: a saved folder, a hub id or "
                      "toy:FAMILY) or mtp (the MTP head --model's checkpoint ships: Qwen3.5, Qwen3-Next) "
                      "(default: no speculation)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None,
                      help=f"draft tokens a request verifies per step at most; a request sends "
                      f"num_speculative_tokens 0 to opt out (default: {DEFAULT_SPECULATIVE_TOKENS} with --speculative)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds the requests in flight may take before they are cut (new ones get "
                        "a 503 a gateway retries elsewhere); then the tier's writes are flushed and the process exits")
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return parser.parse_args(argv)


def make_app(args: argparse.Namespace):
    """The app for parsed ``args`` (model loaded, cache and backend built, not started).

    Raises:
        StartupError: the model or tokenizer cannot be loaded (:func:`~hf_hybridcache.serve.loading.load`).
        ValueError: an option the model or the memory refuses (an empty ``--api-key``, ``--max-model-len`` too long,
            ``--deterministic`` for a model it cannot hold for or with ``--no-cache``), a speculation flag the server
            refuses (:func:`~hf_hybridcache.serve.speculation.speculative_args_error`), or a transformers outside the
            tested window (refused before the model loads).
    """
    from .. import HybridPrefixCache
    from .._compat import check_version
    from ..multimodal import modalities_of
    from .app import build_app
    from .auth import API_KEY_ENV, RequireAPIKey
    from .backends import EngineBackend, SequentialBackend
    from .image_chat import ImageChat
    from .loading import load, load_processor
    from .speculation import speculation_for

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key:
        raise ValueError("--api-key must not be empty; omit it to serve without a key.")
    problem = speculative_args_error(args)  # before minutes of loading
    if problem is not None:
        raise ValueError(problem)
    if args.deterministic and args.no_cache:
        raise ValueError("--deterministic is a mode of the prefix cache and its engine; drop --no-cache.")
    if not args.no_cache:
        check_version()  # an untested transformers is refused before minutes of loading, not after
    model, tokenizer = load(args.model, args.dtype, args.device_map, args.tokenizer, args.trust_remote_code,
                            check_support=not args.no_cache)
    vision = None
    if modalities_of(model):  # a vision-language wrapper: its processor renders every chat
        processor = load_processor(args.tokenizer or args.model, "--model" if args.tokenizer is None else "--tokenizer",
                                   args.trust_remote_code)
        limits = ImageLimits(args.max_image_bytes, args.allow_remote_images, args.image_fetch_timeout)
        vision, tokenizer = ImageChat(processor, limits), processor.tokenizer
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    name = args.served_model_name or args.model
    cache = None
    if args.no_cache:
        limit = {} if args.max_model_len is None else {"max_request_tokens": args.max_model_len}
        backend = SequentialBackend(model, eos, **limit)
    else:
        cache = HybridPrefixCache(model, args.block_size, args.retention_interval, args.max_cache_bytes,
                                  eviction=args.eviction, offload=args.offload, remote=args.remote,
                                  deterministic=args.deterministic)
        backend = EngineBackend(cache, eos, args.max_running_requests, args.max_batch_tokens, args.max_model_len,
                                speculation_for(args, model, tokenizer))
    app = build_app(backend, tokenizer, name, cache, args.max_tokens, vision)
    if api_key:
        app.add_middleware(RequireAPIKey, api_key=api_key)
    return app


def main(argv: list[str] | None = None) -> None:
    from .lifecycle import run

    args = parse_args(argv)
    if args.max_model_len is not None and args.max_model_len < 2:
        _exit(f"--max-model-len must be at least 2 (a prompt token and a reply token), got {args.max_model_len}.")
    problem = speculative_args_error(args)
    if problem is not None:
        _exit(problem)
    failure = run(args, make_app)  # listens at once, loads in a thread, drains on SIGTERM (serve/lifecycle.py)
    if failure is not None:
        _exit(failure)


def _exit(message: str) -> None:
    """One line on stderr (what is wrong and what to do), exit status 2 (as argparse's own usage errors)."""
    print(f"hf_hybridcache.serve: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
