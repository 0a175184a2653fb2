"""``python -m hf_hybridcache.serve --model PATH_OR_ID|toy:FAMILY [--port N] [cache options]``."""

from __future__ import annotations

import argparse

from .loading import DTYPES



def _retention(value: str):
    return value if value == "dense" else int(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hf_hybridcache.serve", description=__doc__)
    parser.add_argument("--model", required=True, help="a local path or hub id, or toy:FAMILY (e.g. toy:jamba)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=list(DTYPES), default="auto")
    parser.add_argument("--device-map", default=None, help="from_pretrained's device_map (e.g. auto, cuda:0, cpu)")
    parser.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    parser.add_argument("--max-tokens", type=int, default=256, help="a chat reply's max_tokens when none is sent")
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    cache = parser.add_argument_group("prefix cache (HybridPrefixCache's options)")
    cache.add_argument("--block-size", type=int, default=16)
    cache.add_argument("--retention-interval", type=_retention, default=0, help='"dense", 0 or a multiple of tokens')
    cache.add_argument("--max-cache-bytes", type=int, default=None)
    cache.add_argument("--eviction", choices=["flop_aware", "lru"], default="flop_aware")
    cache.add_argument("--offload", default=None, help='"cpu" to keep stored entries in host memory')
    cache.add_argument("--remote", default=None, help="redis://... for the shared second tier")
    cache.add_argument("--no-cache", action="store_true",
                       help="no prefix cache and no engine: one plain generate() at a time (the stock baseline)")
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def make_app(args: argparse.Namespace):
    """The app for parsed ``args`` (model loaded, cache and backend built, not started)."""
    from .. import HybridPrefixCache
    from .app import build_app
    from .backends import EngineBackend, SequentialBackend
    from .loading import load

    model, tokenizer = load(args.model, args.dtype, args.device_map)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    name = args.served_model_name or args.model
    if args.no_cache:
        return build_app(SequentialBackend(model, eos), tokenizer, name, None, args.max_tokens)
    cache = HybridPrefixCache(model, args.block_size, args.retention_interval, args.max_cache_bytes,
                              eviction=args.eviction, offload=args.offload, remote=args.remote)
    backend = EngineBackend(cache, eos, args.max_running_requests, args.max_batch_tokens)
    return build_app(backend, tokenizer, name, cache, args.max_tokens)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    app = make_app(args)
    print(f"hf_hybridcache.serve: {args.served_model_name or args.model} at http://{args.host}:{args.port}/v1 "
          "(OpenAI API; /health, /metrics)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
