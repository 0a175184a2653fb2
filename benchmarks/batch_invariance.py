"""Which ops of the supported families' forwards give a row a result that depends on the batch, the chunking or the
path (issue 46, deterministic mode): measured bit for bit on this machine's torch.

Five tables, each cell ``=`` (bitwise equal) or the largest absolute difference:

1. ``F.linear`` (and :func:`~hf_hybridcache.kernels.batch_invariant.invariant_linear`, the package's fixed-tile form)
   at M rows: is every row equal to the same row computed in a product of 64 rows? (``M=1`` is a decode step of one
   request, ``M=8`` a step of eight, ``M=64`` a prefill chunk.)
2. Row-wise ops: an RMSNorm (transformers' form: the mean of squares in float32), a softmax over the last dim, the
   activations (``F.silu``, ``F.softplus``, ``sigmoid``, ``exp`` and the package's invariant forms) on rows of
   ``WIDTH`` elements, and a batched matrix-vector product (the C contraction of a Mamba-1 decode step): row 0 alone
   against row 0 among M rows.
2b. The MLP activation at element offsets: ``F.silu`` and the invariant form on a slice of an MLP's gate that starts
   at another element of the tensor (a token's row at another index among the rows), at an MLP width off the vector
   width (104) and on it (128).
3. Attention (``F.scaled_dot_product_attention``): the query at position t run in a causal prefill of 48 queries
   against the same query alone in a decode step over the first t + 1 keys; one query among 1 / 8 / 64 queries over the
   same keys; and a decode query whose 48 keys are split in two and merged by log-sum-exp (split-KV decoding). Then
   deterministic mode's attention (:mod:`hf_hybridcache.kernels.attention_invariant`) in the same cases, in a prefill
   chunk, and as a left-padded decode row beside another.
4. The package's recurrent kernels (:mod:`hf_hybridcache.kernels`): the last token of a 40-token prefill against the
   same token as a decode step after a 39-token prefill (prefill vs decode), and one 40-token prefill against one
   split at token s, the second part starting from the first's state (the chunk grid starting at another offset, as
   a forward that starts at a cache hit or a chunked prefill does). ``y`` is the last token's output, ``state`` the
   final recurrent state (float32).

Read a row of ``=`` as "no ingredient needed for this op on this machine"; anything else is a place where deterministic
mode must fix the reduction order. Timings: the fixed-tile linear against ``F.linear`` at 1, 8 and 64 rows (table 5),
the invariant Mamba-1 scan and step against the package's own (table 6) and the invariant attention against SDPA
(table 7), each pair timed in alternating rounds in one run (best round).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/batch_invariance.py
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/batch_invariance.py --no-costs   # tables 1-4 only
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every benchmark here

import torch
import torch.nn.functional as F

from hf_hybridcache.kernels import chunk_gated_delta_rule, mamba2_chunk_scan, selective_scan
from hf_hybridcache.kernels.attention_invariant import attention_invariant, causal_visible
from hf_hybridcache.kernels.batch_invariant import invariant_linear
from hf_hybridcache.kernels.conv_invariant import causal_conv_invariant
from hf_hybridcache.kernels.mamba1_invariant import (
    selective_scan_invariant,
    selective_step_invariant,
    silu_invariant,
    softplus_invariant,
)
from hf_hybridcache.kernels.mamba2_invariant import mamba2_scan_invariant, mamba2_step_invariant
from hf_hybridcache.kernels.state_update import (
    causal_conv1d_update,
    gated_delta_step,
    mamba2_state_update,
    selective_state_update,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROWS = (1, 2, 5, 8, 16, 64)
LINEAR_SHAPES = [(512, 128, "toy MLP up"), (4096, 1024, "~100M MLP up")]
#: Row width of table 2: not a multiple of the 32 floats an AVX-512 loop takes per step, so a row alone ends in the
#: loop's scalar tail (at aligned widths the tail is wherever the tensor, or a thread's share of it, ends).
WIDTH = 1000


def _cell(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "="
    return f"{(a.double() - b.double()).abs().max().item():.1e}"


def _row(label: str, cells) -> str:
    return "| " + " | ".join([label, *cells]) + " |"


def linear_table() -> list[str]:
    lines = [_row("op, N x K, dtype", [f"M={m}" for m in ROWS]), "|" + "---|" * (len(ROWS) + 1)]
    for n, k, what in LINEAR_SHAPES:
        for name, dtype in DTYPES.items():
            gen = torch.Generator().manual_seed(0)
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
            x = torch.randn(64, k, generator=gen).to(dtype)
            for op_name, op in (("F.linear", F.linear), ("invariant_linear", invariant_linear)):
                full = op(x, w)
                cells = []
                for m in ROWS:
                    out = op(x[:m], w)
                    diffs = [_cell(out[i], full[i]) for i in range(m)]
                    bad = [d for d in diffs if d != "="]
                    cells.append("=" if not bad else f"{len(bad)}/{m} rows, {max(bad)}")
                lines.append(_row(f"{op_name}, {n}x{k} ({what}), {name}", cells))
    return lines


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reduction_table() -> list[str]:
    lines = [_row("op, dtype", [f"M={m}" for m in ROWS]), "|" + "---|" * (len(ROWS) + 1)]
    for name, dtype in DTYPES.items():
        gen = torch.Generator().manual_seed(1)
        x = (torch.randn(64, WIDTH, generator=gen) * 3).to(dtype)
        weight = torch.randn(WIDTH, generator=gen).to(dtype)
        state, c = torch.randn(64, 96, 16, generator=gen).to(dtype), torch.randn(64, 16, 1, generator=gen).to(dtype)
        ops = {"RMSNorm": lambda t: _rms_norm(t, weight), "softmax": lambda t: t.softmax(-1), "F.silu": F.silu,
               "F.softplus": F.softplus, "torch.sigmoid": torch.sigmoid, "torch.exp": torch.exp,
               "silu_invariant": silu_invariant, "softplus_invariant": softplus_invariant}
        for op_name, op in ops.items():
            alone = op(x[:1])[0]
            lines.append(_row(f"{op_name}, {name}", [_cell(op(x[:m])[0], alone) for m in ROWS]))
        bmm_alone = torch.bmm(state[:1], c[:1])[0]
        lines.append(_row(f"bmm [M, 96, 16] @ [M, 16, 1], {name}",
                          [_cell(torch.bmm(state[:m], c[:m])[0], bmm_alone) for m in ROWS]))
    return lines


def _split_kv_decode(q, k, v, split: int) -> torch.Tensor:
    """A decode query over keys split at ``split``, the two partial results merged by log-sum-exp (flash-decoding)."""
    scale = q.shape[-1] ** -0.5
    parts = []
    for ks, vs in ((k[..., :split, :], v[..., :split, :]), (k[..., split:, :], v[..., split:, :])):
        scores = (q.float() @ ks.float().transpose(-1, -2)) * scale
        lse = scores.logsumexp(-1, keepdim=True)
        parts.append(((scores - lse).exp() @ vs.float(), lse))
    (o1, l1), (o2, l2) = parts
    total = torch.logaddexp(l1, l2)
    return (o1 * (l1 - total).exp() + o2 * (l2 - total).exp()).to(q.dtype)


def attention_table() -> list[str]:
    lines = [_row("case", list(DTYPES)), "|---|---|---|---|"]
    cases: dict[str, list[str]] = {"prefill query t=47 vs decode step": [], "prefill query t=20 vs decode step": [],
                                   "1 of 8 queries vs alone (no mask)": [], "1 of 64 queries vs alone (no mask)": [],
                                   "decode, 48 keys split 32+16 vs whole": []}
    for dtype in DTYPES.values():
        gen = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(1, 4, 64, 64, generator=gen).to(dtype) for _ in range(3))
        prefill = F.scaled_dot_product_attention(q[:, :, :48], k[:, :, :48], v[:, :, :48], is_causal=True)
        for t, key in ((47, "prefill query t=47 vs decode step"), (20, "prefill query t=20 vs decode step")):
            step = F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
            cases[key].append(_cell(prefill[:, :, t], step[:, :, 0]))
        alone = F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :48], v[:, :, :48])
        for m, key in ((8, "1 of 8 queries vs alone (no mask)"), (64, "1 of 64 queries vs alone (no mask)")):
            many = F.scaled_dot_product_attention(q[:, :, :m], k[:, :, :48], v[:, :, :48])
            cases[key].append(_cell(many[:, :, 0], alone[:, :, 0]))
        split = _split_kv_decode(q[:, :, :1], k[:, :, :48], v[:, :, :48], 32)
        cases["decode, 48 keys split 32+16 vs whole"].append(_cell(split, alone))
        for key, cell in _invariant_attention_cells(q, k, v).items():
            cases.setdefault(key, []).append(cell)
    lines += [_row(key, cells) for key, cells in cases.items()]
    return lines


def _invariant_attention_cells(q, k, v) -> dict[str, str]:
    """The same comparisons for deterministic mode's attention (and a left-padded decode row beside another)."""
    def run(query, keys, values, visible):
        return attention_invariant(query, keys, values, visible, q.shape[-1] ** -0.5)

    prefill = run(q[:, :, :48], k[:, :, :48], v[:, :, :48], causal_visible(48, 48))
    cells = {}
    for t in (47, 20):
        step = run(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], causal_visible(1, t + 1))
        cells[f"attention_invariant: prefill query t={t} vs decode step"] = _cell(prefill[:, :, t], step[:, :, 0])
    chunk = run(q[:, :, 17:48], k[:, :, :48], v[:, :, :48], causal_visible(31, 48))
    cells["attention_invariant: prefill chunk 17:48 vs whole prefill"] = _cell(chunk, prefill[:, :, 17:])
    padded = torch.cat([torch.zeros_like(k[:, :, :5]), k[:, :, :21]], 2), torch.cat([v[:, :, :5], v[:, :, :21]], 2)
    visible = torch.ones(2, 1, 1, 26, dtype=torch.bool)
    visible[0, ..., :5] = False
    batch = run(q[:, :, 20:22].transpose(0, 2), *(x.expand(2, -1, -1, -1) for x in padded), visible)
    cells["attention_invariant: decode row left-padded by 5 vs prefill"] = _cell(batch[0, :, 0], prefill[0, :, 20])
    return cells


def offset_table(widths=(104, 128), offsets=range(1, 33)) -> list[str]:
    """SiLU (and GELU, Zamba's MLP activation) of an MLP's ``[M, I]`` gate (I = 104, off the vector width, or 128)
    where a token's row starts at another element offset of the tensor (its index among the rows): the elements at
    each offset against the whole tensor's."""
    lines = [_row("op, dtype", [f"I={w}" for w in widths]), "|---|---|---|"]
    for name, dtype in DTYPES.items():
        gen = torch.Generator().manual_seed(3)
        for op_name, op in (("F.silu", F.silu), ("silu_invariant (float32, rounded)",
                                                 lambda t: silu_invariant(t.float()).to(t.dtype)),
                            ("F.gelu (erf)", F.gelu), ("F.gelu (tanh)", lambda t: F.gelu(t, approximate="tanh"))):
            cells = []
            for width in widths:
                flat = (torch.randn(40 * width, generator=gen) * 3).to(dtype)
                whole = op(flat)
                bad = [o for o in offsets if not torch.equal(op(flat[o : o + 3 * width]), whole[o : o + 3 * width])]
                cells.append("=" if not bad else f"{len(bad)}/{len(offsets)} offsets")
            lines.append(_row(f"{op_name}, {name}", cells))
    return lines


def attention_cost_table(tokens: int = 256) -> list[str]:
    """SDPA (transformers' path: keys repeated per query head) against the invariant attention: a prefill of
    ``tokens`` and one decode step of 1 and 8 rows over ``tokens`` keys; 8 query heads over 2 KV heads of 64."""
    lines = ["| call, dtype | SDPA ms | attention_invariant ms | ratio |", "|---|---|---|---|"]
    for name in ("fp32", "bf16"):
        gen = torch.Generator().manual_seed(4)
        dtype = DTYPES[name]
        q = torch.randn(8, 8, tokens, 64, generator=gen).to(dtype)
        k, v = (torch.randn(8, 2, tokens, 64, generator=gen).to(dtype) for _ in range(2))
        calls = [(f"prefill {tokens}, 1 row", q[:1], k[:1], v[:1], causal_visible(tokens, tokens))]
        calls += [(f"decode over {tokens}, {r} {'row' if r == 1 else 'rows'}", q[:r, :, -1:], k[:r], v[:r],
                   causal_visible(1, tokens)) for r in (1, 8)]
        for label, query, keys, values, visible in calls:
            def sdpa():
                return F.scaled_dot_product_attention(query, keys.repeat_interleave(4, 1),
                                                      values.repeat_interleave(4, 1), attn_mask=visible)

            base, ours = _ms_pair(sdpa, lambda: attention_invariant(query, keys, values, visible, 0.125), repeats=3)
            lines.append(f"| {label}, {name} | {base:.3f} | {ours:.3f} | {ours / base:.2f} |")
    return lines


def _mamba1(dtype, gen, t, scan=selective_scan, step=selective_state_update):
    i, n = 64, 16
    u, dt, z = (torch.randn(1, i, t, generator=gen).to(dtype) for _ in range(3))
    b, c = (torch.randn(1, n, t, generator=gen).to(dtype) for _ in range(2))
    a = -torch.rand(i, n, generator=gen) - 0.1
    d, bias = torch.randn(i, generator=gen), torch.randn(i, generator=gen) * 0.1 - 1

    def prefill(lo, hi, state):
        y, final, _ = scan(u[..., lo:hi], dt[..., lo:hi], a, b[..., lo:hi], c[..., lo:hi], d, z[..., lo:hi], bias, True,
                           initial_state=state)
        return y[..., -1], final

    def decode(pos, state):
        state = state.clone()
        y = step(state, u[..., pos], dt[..., pos], a, b[..., pos], c[..., pos], d, z[..., pos], bias, True)
        return y, state

    return prefill, decode


def _mamba2(dtype, gen, t, chunk=16, invariant=False, heads=4, head_dim=16, state_size=16):
    h, p, g, n = heads, head_dim, 1, state_size
    x = torch.randn(1, t, h, p, generator=gen).to(dtype)
    dt = torch.randn(1, t, h, generator=gen).to(dtype)
    b, c = (torch.randn(1, t, g, n, generator=gen).to(dtype) for _ in range(2))
    a = -torch.rand(h, generator=gen) - 0.1
    d, bias = torch.randn(h, generator=gen), torch.randn(h, generator=gen) * 0.1 - 1

    def prefill(lo, hi, state):
        if invariant:
            y, final, _ = mamba2_scan_invariant(x[:, lo:hi], dt[:, lo:hi], a, b[:, lo:hi], c[:, lo:hi], d, bias, True,
                                                initial_state=state)
        else:
            y, final, _ = mamba2_chunk_scan(x[:, lo:hi], dt[:, lo:hi], a, b[:, lo:hi], c[:, lo:hi], chunk, D=d,
                                            dt_bias=bias, dt_softplus=True, initial_state=state)
        return y[:, -1].to(dtype), final

    def decode(pos, state):
        state = state.clone()
        if invariant:
            return mamba2_step_invariant(state, x[:, pos], dt[:, pos], a, b[:, pos], c[:, pos], d, bias, True), state
        y = mamba2_state_update(state, x[:, pos], dt[:, pos, :, None].expand(1, h, p), a[:, None, None].expand(h, p, n),
                                b[:, pos], c[:, pos], d[:, None].expand(h, p), bias[:, None].expand(h, p), True)
        return y, state

    return prefill, decode


def _gated_delta(dtype, gen, t, chunk=16):
    hk, hv, dk, dv = 2, 4, 16, 16
    q, k = (torch.randn(1, t, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(1, t, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(1, t, hv, generator=gen).to(dtype) * 0.3
    beta = torch.rand(1, t, hv, generator=gen).to(dtype)

    def prefill(lo, hi, state):
        y, final, _ = chunk_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi],
                                             chunk, state, True, True)
        return y[:, -1], final

    def decode(pos, state):
        sl = slice(pos, pos + 1)
        y, final = gated_delta_step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state, True)
        return y[:, 0], final

    return prefill, decode


def scan_table(tokens: int = 40, splits=(1, 16, 17, 24)) -> list[str]:
    lines = [_row("kernel, dtype", ["prefill vs decode: y", "state", *[f"split at {s}: y" for s in splits],
                                    "states (all splits)"]), "|" + "---|" * (len(splits) + 4)]
    invariant = functools.partial(_mamba1, scan=selective_scan_invariant, step=selective_step_invariant)
    for family, make in (("Mamba-1 selective_scan", _mamba1), ("Mamba-1 selective_scan_invariant", invariant),
                         ("Mamba-2 mamba2_chunk_scan (chunk 16)", _mamba2),
                         ("Mamba-2 mamba2_scan_invariant", functools.partial(_mamba2, invariant=True)),
                         ("gated delta chunk rule (chunk 16)", _gated_delta)):
        for name, dtype in DTYPES.items():
            prefill, decode = make(dtype, torch.Generator().manual_seed(3), tokens)
            y_full, s_full = prefill(0, tokens, None)
            _, s_head = prefill(0, tokens - 1, None)
            y_step, s_step = decode(tokens - 1, s_head)
            cells = [_cell(y_step.reshape(y_full.shape), y_full), _cell(s_step, s_full)]
            state_cells = []
            for s in splits:
                _, s_a = prefill(0, s, None)
                y_b, s_b = prefill(s, tokens, s_a)
                cells.append(_cell(y_b, y_full))
                state_cells.append(_cell(s_b, s_full))
            bad = [c for c in state_cells if c != "="]
            cells.append("=" if not bad else f"{len(bad)}/{len(splits)}, {max(bad)}")
            lines.append(_row(f"{family}, {name}", cells))
    for name, dtype in DTYPES.items():
        lines.append(_row(f"depthwise causal conv (width 4), {name}", [_conv_prefill_vs_decode(dtype, tokens)]
                          + ["n/a"] * (len(splits) + 2)))
    for name, dtype in DTYPES.items():
        lines.append(_row(f"causal_conv_invariant (width 4), {name}", _conv_invariant_cells(dtype, tokens, splits)))
    return lines


def _conv_invariant_cells(dtype, tokens: int, splits) -> list[str]:
    """The invariant conv's last token as a one-token call against its prefill; the prompt split at each of
    ``splits``; and the windows it leaves."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, tokens, generator=gen).to(dtype)
    weight, bias = torch.randn(64, 4, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    y, window = causal_conv_invariant(x, weight, bias)
    step, step_window = causal_conv_invariant(x[..., -1:], weight, bias, conv_state=x[..., -5:-1])
    cells = [_cell(step, y[..., -1:]), _cell(step_window, window)]
    windows = []
    for s in splits:
        _, head_window = causal_conv_invariant(x[..., :s], weight, bias)
        tail, tail_window = causal_conv_invariant(x[..., s:], weight, bias, conv_state=head_window)
        cells.append(_cell(tail, y[..., s:]))
        windows.append(_cell(tail_window, window))
    bad = [c for c in windows if c != "="]
    return cells + ["=" if not bad else f"{len(bad)}/{len(splits)}, {max(bad)}"]


def _conv_prefill_vs_decode(dtype, tokens: int) -> str:
    """The last token of transformers' prefill conv (``F.conv1d``, groups = channels) against the decode step's
    window product (:func:`~hf_hybridcache.kernels.state_update.causal_conv1d_update`)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, tokens, generator=gen).to(dtype)
    weight, bias = torch.randn(64, 4, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    prefill = F.conv1d(x, weight.unsqueeze(1), bias, padding=3, groups=64)[..., :tokens]
    window = x[..., -5:-1].clone()  # the conv state before the last token: the 4 inputs before it
    step = causal_conv1d_update(x[..., -1], window, weight, bias)
    return _cell(step, prefill[..., -1])


def _ms_pair(first, second, rounds: int = 7, repeats: int = 10) -> tuple[float, float]:
    """Milliseconds per call of two functions, timed in alternating rounds (the best round of each), so both see the
    same machine load."""
    best = [float("inf"), float("inf")]
    first(), second()
    for _ in range(rounds):
        for i, fn in enumerate((first, second)):
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            best[i] = min(best[i], (time.perf_counter() - started) / repeats * 1e3)
    return best[0], best[1]


def cost_table() -> list[str]:
    lines = ["| N x K, dtype, rows | F.linear ms | invariant_linear ms | ratio |", "|---|---|---|---|"]
    for n, k, what in LINEAR_SHAPES:
        for name in ("fp32", "bf16"):
            w = torch.randn(n, k).to(DTYPES[name])
            for m in (1, 8, 64):
                x = torch.randn(m, k).to(DTYPES[name])
                base, ours = _ms_pair(lambda: F.linear(x, w), lambda: invariant_linear(x, w))
                lines.append(f"| {n}x{k} ({what}), {name}, {m} | {base:.3f} | {ours:.3f} | {ours / base:.2f} |")
    return lines


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def scan_cost_table(tokens: int = 256) -> list[str]:
    lines = ["| dtype, call (Mamba-1: 64 channels, state 16, conv width 4) | package path ms | invariant ms | ratio |",
             "|---|---|---|---|"]
    for name in ("fp32", "bf16"):
        dtype = DTYPES[name]
        prefill, _ = _mamba1(dtype, torch.Generator().manual_seed(5), tokens)
        prefill_inv, _ = _mamba1(dtype, torch.Generator().manual_seed(5), tokens, selective_scan_invariant,
                                 selective_step_invariant)
        base, ours = _ms_pair(lambda: prefill(0, tokens, None), lambda: prefill_inv(0, tokens, None), 3, 3)
        lines.append(f"| {name}, prefill of {tokens} tokens | {base:.2f} | {ours:.2f} | {ours / base:.2f} |")
        for rows in (1, 8):
            gen = torch.Generator().manual_seed(6)
            state = torch.randn(rows, 64, 16, generator=gen)
            x, dt, z = (torch.randn(rows, 64, generator=gen).to(dtype) for _ in range(3))
            b, c = (torch.randn(rows, 16, generator=gen).to(dtype) for _ in range(2))
            a, d, bias = -torch.rand(64, 16, generator=gen), torch.randn(64, generator=gen), torch.zeros(64)
            args = (x, dt, a, b, c, d, z, bias, True)
            base, ours = _ms_pair(lambda: selective_state_update(state.clone(), *args),
                                  lambda: selective_step_invariant(state.clone(), *args))
            lines.append(f"| {name}, decode step of {_rows(rows)} | {base:.3f} | {ours:.3f} | {ours / base:.2f} |")
        lines += _conv_cost_rows(name, dtype, tokens)
        lines += _mamba2_cost_rows(name, dtype, tokens)
    return lines


def _mamba2_cost_rows(name: str, dtype, tokens: int) -> list[str]:
    """The chunked SSD scan (chunk 256, as Zamba2's and Falcon-H1's configs) and the package's decode step against the
    invariant scan and step, 32 heads of 64 channels, state 64 (a ~100M+ model's mixer)."""
    make = functools.partial(_mamba2, dtype, torch.Generator().manual_seed(8), tokens, 256, heads=32, head_dim=64,
                             state_size=64)
    (prefill, decode), (prefill_inv, decode_inv) = make(), make(invariant=True)
    base, ours = _ms_pair(lambda: prefill(0, tokens, None), lambda: prefill_inv(0, tokens, None), 3, 3)
    lines = [f"| {name}, Mamba-2 prefill of {tokens} tokens | {base:.2f} | {ours:.2f} | {ours / base:.2f} |"]
    _, state = prefill(0, tokens - 1, None)
    base, ours = _ms_pair(lambda: decode(tokens - 1, state), lambda: decode_inv(tokens - 1, state))
    return lines + [f"| {name}, Mamba-2 decode step of 1 row | {base:.3f} | {ours:.3f} | {ours / base:.2f} |"]


def _conv_cost_rows(name: str, dtype, tokens: int) -> list[str]:
    """transformers' prefill conv (``F.conv1d`` + ``F.silu``) and the package's decode update against the invariant
    conv, 64 channels of width 4."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, tokens, generator=gen).to(dtype)
    weight, bias = torch.randn(64, 4, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    one = x[:1]
    base, ours = _ms_pair(lambda: F.silu(F.conv1d(one, weight.unsqueeze(1), bias, padding=3, groups=64)),
                          lambda: causal_conv_invariant(one, weight, bias))
    lines = [f"| {name}, conv prefill of {tokens} tokens | {base:.3f} | {ours:.3f} | {ours / base:.2f} |"]
    for rows in (1, 8):
        window = x[:rows, :, :4].contiguous()
        base, ours = _ms_pair(lambda: causal_conv1d_update(x[:rows, :, 4], window.clone(), weight, bias, "silu"),
                              lambda: causal_conv_invariant(x[:rows, :, 4:5], weight, bias, conv_state=window))
        lines.append(f"| {name}, conv decode step of {_rows(rows)} | {base:.3f} | {ours:.3f} | {ours / base:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-costs", action="store_true", help="print the invariance tables only (no timings)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, BLAS: "
          f"{'MKL' if torch.backends.mkl.is_available() else 'other'}\n")
    tables = [("1. linear rows vs the same rows among 64", linear_table),
              ("2. row-wise ops, row 0 among M vs alone", reduction_table),
              ("2b. MLP activation, a token's row at another element offset", offset_table),
              ("3. attention", attention_table),
              ("4. recurrent kernels: prefill vs decode, and the chunk grid's offset", scan_table)]
    if not args.no_costs:
        tables += [("5. cost of the fixed-tile linear", cost_table),
                   ("6. cost of the invariant scans, steps and conv", scan_cost_table),
                   ("7. cost of the invariant attention", attention_cost_table)]
    for title, table in tables:
        print(f"## {title}\n")
        print("\n".join(table()), end="\n\n")


if __name__ == "__main__":
    main()
