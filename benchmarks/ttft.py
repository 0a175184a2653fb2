"""Time to first token (TTFT) of a hybrid model with and without HybridPrefixCache, against the lower bound.

The model is a Jamba-shaped one of two sizes (``--size``, the default), or with ``--family F [--shape NAME]
[--layers N]`` a real model shape from ``benchmarks/model_shapes.py`` (random weights; the header line names the
checkpoint and any cut, and the bytes of one KV block and of one checkpoint).

For each prefix length (default 1k / 2k / 4k / 8k tokens) a prompt is the prefix plus a 64-token suffix, and one run
prints, side by side:

- ``no cache``: stock transformers (``generate`` with its own cache; on CPU its scan is a Python loop over tokens);
- ``no cache*``: the same with transformers' zero-state scan swapped for ours (benchmark only), so that ``miss`` is
  also compared with a run that differs only by the cache's bookkeeping and checkpoint capture;
- ``miss``: a fresh HybridPrefixCache (every KV block and the prompt-end checkpoints are stored);
- ``hit``: the same prefix was served before with another suffix, so the cache restores the prefix and replays only
  the suffix;
- ``suffix``: prefilling only the 64 suffix tokens with no cache (faster of stock and ``*``): the lower bound of a hit
  (each hit and its lower bound run on the same suffix; the hit's prefix checkpoint serves several new suffixes);
- restore steps of the hit one by one (lookup, KV gather, checkpoint copy) with their bytes;
- the Mamba-1 scan alone at ``--scan-tokens`` tokens: transformers' scan against ours (Jamba-shaped model only).

``no cache*`` and the scan need transformers' Jamba scan; other families print ``-`` there.

Times are the best of ``--repeats`` runs (``--repeats x --hit-repeats`` for the cheap hit and suffix runs; the
machine is shared, and the best run is the least disturbed one); the variants run in turn within each repeat. The
hit's first-token logits are checked against the stock run of the same prompt (``max|dlogit|``).

Usage::

    PYTHONPATH=. python benchmarks/ttft.py                      # CPU, ~25M-parameter model (a few minutes)
    PYTHONPATH=. python benchmarks/ttft.py --device cuda --size large --dtype bfloat16
    PYTHONPATH=. python benchmarks/ttft.py --family qwen3_5_text --shape 0.8b --prefixes 1024 4096 8192
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

# On a shared, oversubscribed CPU, OpenMP threads that spin at barriers stall every small torch op for a scheduler
# slice (the chunked scan ran 15x slower); sleeping threads do not. OpenMP reads this when torch loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm.auto import tqdm

from benchmarks.model_shapes import SHAPES, build_shape_model
from benchmarks.ttft_report import print_report
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.kernels import backend, selective_scan, selective_scan_chunked
from hf_hybridcache.toy import VOCAB_SIZE, build_model

#: Jamba's layer pattern (one attention layer in eight, attention at offset 4) at two sizes; experts off so that the
#: dense compute is what a CPU can run.
SIZES = {
    "small": {  # ~25M parameters: 7 Mamba layers (I=1024, N=16) + 1 attention layer
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_dt_rank": 32,
        "initializer_range": 0.02,
    },
    "large": {  # ~520M parameters: 14 Mamba layers (I=3072, N=16) + 2 attention layers
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_dt_rank": 96,
        "initializer_range": 0.02,
    },
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn):
    """(seconds, result) of ``fn()``."""
    seconds, _, result = timed_with_cpu(device, fn)
    return seconds, result


def timed_with_cpu(device: torch.device, fn):
    """(wall seconds, CPU seconds of this process, result) of ``fn()``. On a shared CPU the CPU time is the steadier
    measure of the work done (other processes' load stretches the wall time, not this process's CPU time)."""
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    sync(device)
    return time.perf_counter() - start, time.process_time() - cpu_start, result


def first_token(model, ids: torch.Tensor, cache=None):
    """Prefill + first token; returns the first-step logits ``[1, V]``."""
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=1,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )
    return out.logits[0]


@contextlib.contextmanager
def transformers_scan_replaced():
    """Benchmark only: transformers' Jamba runs our scan where it runs its own zero-state scan (the ``no cache*``
    column). Touches a private transformers symbol on purpose; the package itself never does."""
    from transformers.models.jamba import modeling_jamba

    original = modeling_jamba.mamba_selective_scan

    def ours(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, **kwargs):
        y, last_state, _ = selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus)
        return (y, last_state) if kwargs.get("return_last_state") else y

    modeling_jamba.mamba_selective_scan = ours
    try:
        yield
    finally:
        modeling_jamba.mamba_selective_scan = original


def random_ids(length: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, VOCAB_SIZE, (1, length), generator=g).to(device)


def measure_prefix(args, stock, patched, cache, prefix_tokens: int, device) -> dict:
    """Best-of-repeats TTFTs (seconds) and restore details for one prefix length."""
    prefix = random_ids(prefix_tokens, seed=prefix_tokens, device=device)

    def with_suffix(seed):
        return torch.cat([prefix, random_ids(args.suffix_tokens, seed=seed, device=device)], dim=1)

    warm, prompt = with_suffix(1), with_suffix(2)
    times: dict[str, list[float]] = {}
    swap_scan = stock.config.model_type == "jamba"

    def record(name, seconds):
        times.setdefault(name, []).append(seconds)

    for repeat in range(args.repeats):
        seconds, reference_logits = timed(device, lambda: first_token(stock, prompt))
        record("no cache", seconds)
        if swap_scan:
            with transformers_scan_replaced():
                seconds, cpu_seconds, _ = timed_with_cpu(device, lambda: first_token(stock, prompt))
            record("no cache*", seconds)
            record("no cache* cpu", cpu_seconds)
        cache.clear()
        seconds, cpu_seconds, _ = timed_with_cpu(device, lambda: first_token(patched, prompt, cache))
        record("miss", seconds)
        record("miss cpu", cpu_seconds)
        cache.clear()
        first_token(patched, warm, cache)
        checkpoints, stored = cache.stats.checkpoints, cache.stored_bytes
        # Hits are cheap: several per warm-up, each with a new suffix (the prefix's checkpoint serves them all),
        # interleaved with the lower bound on the same suffix.
        for k in range(args.hit_repeats):
            hit_prompt = prompt if k == 0 else with_suffix(100 + repeat * args.hit_repeats + k)
            for name, value in measure_restore(cache, hit_prompt, device).items():
                record(name, value)
            seconds, hit_logits = timed(device, lambda p=hit_prompt: first_token(patched, p, cache))
            record("hit", seconds)
            if k == 0:
                max_logit_diff = (hit_logits.float() - reference_logits.float()).abs().max().item()
                hit_tokens = cache.last_hit_tokens[0]
            suffix = hit_prompt[:, prefix_tokens:]
            record("suffix", timed(device, lambda s=suffix: first_token(stock, s))[0])
            if swap_scan:
                with transformers_scan_replaced():
                    record("suffix", timed(device, lambda s=suffix: first_token(stock, s))[0])
    best = {name: min(values) for name, values in times.items()}
    best.update(max_logit_diff=max_logit_diff, hit_tokens=hit_tokens, checkpoints=checkpoints, stored_bytes=stored)
    best["kv_bytes"], best["ckpt_bytes"] = int(best["kv_bytes"]), int(best["ckpt_bytes"])
    return best


def measure_restore(cache, prompt: torch.Tensor, device) -> dict:
    """The steps of the coming hit's restore, timed one by one (seconds), and the bytes they copy."""
    store = cache.store  # the benchmark times the restore steps one by one
    token_ids = prompt[0].tolist()
    lookup_seconds, hit = timed(device, lambda: store.lookup(token_ids))
    if not hit.hit_tokens:
        return {"lookup": lookup_seconds, "kv_gather": 0.0, "kv_bytes": 0, "ckpt_copy": 0.0, "ckpt_bytes": 0}
    kv_seconds = timed(device, lambda: [store.gather_kv(a.layer_idx, hit.block_ids) for a in cache.spec.attention])[0]
    ckpt_seconds = timed(device, lambda: store.checkpoint_copy(hit.block_ids[-1]))[0]
    return {
        "lookup": lookup_seconds,
        "kv_gather": kv_seconds,
        "kv_bytes": len(hit.block_ids) * store.spec.kv_block_bytes,
        "ckpt_copy": ckpt_seconds,
        "ckpt_bytes": store.spec.checkpoint_bytes,
    }


def measure_scan(args, model, device, dtype) -> list[tuple[str, float]]:
    """The Mamba-1 scan alone on the first Mamba layer's shapes: transformers' scan and ours (best of repeats)."""
    from transformers.models.jamba import modeling_jamba

    mixer = next(m for m in model.modules() if type(m).__name__ == "JambaMambaMixer")
    channels, state_size, seq_len = mixer.intermediate_size, mixer.ssm_state_size, args.scan_tokens
    g = torch.Generator().manual_seed(0)
    u, delta, z = (torch.randn(1, channels, seq_len, generator=g).to(device, dtype) for _ in range(3))
    B, C = (torch.randn(1, state_size, seq_len, generator=g).to(device, dtype) for _ in range(2))
    A = -torch.exp(mixer.A_log.float())
    common = {"D": mixer.D.float(), "z": z, "delta_bias": mixer.dt_proj.bias.float(), "delta_softplus": True}
    delta = 0.1 * delta
    initial_state = torch.zeros(1, channels, state_size, device=device)
    candidates = {
        "transformers' scan (zero state)": lambda: modeling_jamba.mamba_selective_scan(
            u, delta, A, B, C, return_last_state=True, **common
        ),
        "ours, chunked torch (state in, 2 emitted)": lambda: selective_scan_chunked(
            u, delta, A, B, C, initial_state=initial_state, emit_positions=[seq_len // 2, seq_len], **common
        ),
    }
    if device.type == "cuda" and backend.triton_available():
        from hf_hybridcache.kernels.mamba1_scan_triton import selective_scan_triton

        candidates["ours, Triton (state in, 2 emitted)"] = lambda: selective_scan_triton(
            u, delta, A, B, C, initial_state=initial_state, emit_positions=[seq_len // 2, seq_len], **common
        )
    results = {name: [] for name in candidates}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, fn in candidates.items():
                results[name].append(timed(device, fn)[0])
    return [(name, min(values)) for name, values in results.items()]


def build_models(args, device, dtype):
    """``(stock, patched, description)``. A ``--family`` shape is built once: HybridPrefixCache patches the instance's
    mixers, and the patches run upstream's forward unchanged for any other cache (or none), so the same instance is
    the stock model when called without our cache; a second copy of a real-size model would double the memory."""
    if args.family is None:
        stock, patched = (
            build_model("jamba", seed=0, long_memory=False, dtype=dtype, **SIZES[args.size]).to(device)
            for _ in range(2)
        )
        return stock, patched, f"Jamba-shaped model '{args.size}'"
    shape = args.shape or next(iter(SHAPES[args.family]))
    model, description = build_shape_model(args.family, shape, args.layers, dtype=dtype)
    return model.to(device), model.to(device), f"{args.family} '{shape}' ({description}, random weights)"


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", "--prefixes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--scan-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each full prefill (no cache, miss)")
    parser.add_argument("--hit-repeats", type=int, default=3, help="hits (and suffix-only runs) per repeat")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="the Jamba-shaped model (no --family)")
    parser.add_argument("--family", choices=sorted(SHAPES), help="a real model shape's family (model_shapes.py)")
    parser.add_argument("--shape", help="the family's shape (default: its first; see benchmarks/model_shapes.py)")
    parser.add_argument("--layers", type=int, help="keep the shape's first N layers (the layer pattern is kept)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--retention", type=int, default=1024, help="retention interval in tokens (the prefixes are multiples of it)"
    )
    args = parser.parse_args(argv)
    if args.family is None and (args.shape or args.layers):
        parser.error("--shape and --layers need --family")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    stock, patched, description = build_models(args, device, dtype)
    cache = HybridPrefixCache(patched, block_size=args.block_size, retention_interval=args.retention)
    warmup = random_ids(2 * args.block_size + 3, seed=0, device=device)
    first_token(stock, warmup)
    first_token(patched, warmup, cache)

    rows = {}
    try:
        for prefix_tokens in tqdm(args.prefix_tokens, desc="prefixes", unit="prefix"):
            rows[prefix_tokens] = measure_prefix(args, stock, patched, cache, prefix_tokens, device)
    except KeyboardInterrupt:  # Ctrl-C during a long run still prints the prefixes measured so far
        if not rows:
            raise
    complete = len(rows) == len(args.prefix_tokens)
    scan = measure_scan(args, stock, device, dtype) if args.family is None and complete else []
    print_report(args, stock, device, dtype, rows, scan, cache.spec, description)


if __name__ == "__main__":
    main()
