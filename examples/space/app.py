"""Gradio chat on a hybrid attention + Mamba model that shows hf_hybridcache at work.

Every chat turn is one request to the continuous-batching engine of one shared
:class:`~hf_hybridcache.HybridPrefixCache` (``cache.init_continuous_batching``): the second turn of a chat finds the first turn's prompt and reply in the cache (KV blocks for the attention layers, a checkpoint of the
Mamba states at the reply's end) and runs only the new text. Beside each reply the app shows the prompt tokens, the
hit (tokens restored), why the hit is that long (``cache.last_report``: its reason and a sentence on what to do), the
replayed tokens (run through the model) and the time to first token (TTFT); with "compare" on it also runs the same
prompt without the cache and checks that the reply is token for token the same.

Run it with one command (it prints the URL, http://127.0.0.1:7860 by default)::

    pip install -e ".[demo]"
    python examples/space/app.py                          # the built-in random Jamba-shaped model, no downloads
    python examples/space/app.py --model-id ai21labs/Jamba-tiny-dev   # a real checkpoint (needs a hub)
    python examples/space/app.py --vision                 # a built-in random vision-language model: images

Several browser sessions share the one cache (a second user with the same system prompt gets a hit on their first
turn); each session keeps its own chat history. Their turns run at the same time: the engine packs the requests of
every session into the same forward steps (up to ``--max-running-requests`` at once, 8 by default; Gradio's queue
holds the rest), and each turn shows its own hit and how many requests ran with it. The "compare" run is a plain
``generate()`` without the cache, beside the engine.

With a vision-language model (``--vision``: a built-in random Qwen3.5-shaped wrapper; or ``--model-id`` of a Qwen3.5,
LFM2-VL, ... checkpoint) a message can carry an image. The cache keys the image's placeholder tokens by its content,
so the next question about the same image restores the prompt, image included, and the vision encoder does not run
for it: each turn shows the images encoded and skipped and the encoder's time (``cache.stats``: ``images_skipped``,
``vision_encoder_seconds``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import pandas as pd
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
    TextIteratorStreamer,
)

try:
    import hf_hybridcache
except ImportError:  # run from a source checkout without `pip install -e .`: the package sits two folders up
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_hybridcache import HybridPrefixCache, supported_model_types
from hf_hybridcache.toy import build_model, byte_tokenizer

#: The built-in model: a random-init Jamba-shaped model (6.2M parameters, 2 attention + 6 Mamba layers) with the
#: long-memory init, big enough that a 1000-token prefill takes visibly longer than replaying one block on 2 CPU cores.
BUILTIN_MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    mamba_dt_rank=16,
)
#: The built-in model may only write these characters (and end its reply): its random weights write gibberish, and a
#: small alphabet keeps it readable and free of Markdown, and makes the reply's text give back the reply's tokens.
BUILTIN_ALPHABET = "abcdefghijklmnopqrstuvwxyz ,."

DEFAULT_SYSTEM_PROMPT = (
    "You are the assistant of a demo of hf_hybridcache, a prefix cache for hybrid language models that mix "
    "attention layers with Mamba state space layers. Attention layers keep a key and a value for every token, so any "
    "prefix of their cache can be reused. A Mamba layer keeps one fixed-size state, the conv window and the SSM "
    "state, which cannot be cut back to an earlier token. The cache therefore copies the Mamba states out at block "
    "boundaries while a prompt runs, and stores them as checkpoints next to the paged attention KV blocks. A later "
    "request that starts with the same tokens restores the deepest checkpoint it shares and replays only the tokens "
    "after it. In a chat, the next turn starts with the whole previous turn, so it starts almost at once. Answer "
    "briefly and kindly."
)

RETENTION_CHOICES = [
    ("0: prompt end and reply end only", "0"),
    ("dense: every block boundary", "dense"),
    ("every 64 tokens", "64"),
    ("every 256 tokens", "256"),
]
BUDGET_CHOICES_MIB = [1, 4, 16, 64, 256]
#: Defaults: a checkpoint every 64 tokens lets a second visitor with the same system prompt hit on their first turn
#: (with 0 only prompt ends and reply ends are kept); 64 MiB holds a few dozen chat turns of the built-in model.
DEFAULT_RETENTION, DEFAULT_BUDGET_MIB = "64", 64
#: Requests the engine runs at once (its state slots); Gradio's queue holds the sessions beyond them.
DEFAULT_MAX_RUNNING_REQUESTS = 8
MIB = 1024**2


@dataclass(frozen=True)
class CacheSettings:
    """What the shared cache is built with, on the first message after start or after "clear cache"."""

    retention_interval: int | str = int(DEFAULT_RETENTION)
    eviction: str = "flop_aware"
    max_cache_mib: int = DEFAULT_BUDGET_MIB

    @classmethod
    def from_ui(cls, retention: str, eviction: str, budget_mib) -> CacheSettings:
        return cls(retention if retention == "dense" else int(retention), eviction, int(budget_mib))


@dataclass(frozen=True)
class TurnStats:
    """Numbers of one chat turn. TTFT is measured from queueing the request to its first new token, in ms;
    ``reason`` and ``detail`` say why the hit is that long (:class:`~hf_hybridcache.core.explain.HitReport`);
    ``requests_at_once`` is the most requests the engine ran in one step while this turn ran (this one included).
    ``images`` is the prompt's images; ``images_encoded`` / ``images_skipped`` and ``encoder_ms`` are what the cache's
    image counters moved by while this turn ran (other sessions' turns at the same time count there too)."""

    prompt_tokens: int
    hit_tokens: int
    replayed_tokens: int
    new_tokens: int
    ttft_ms: float
    cold_ttft_ms: float | None = None
    identical_to_cold: bool | None = None
    reason: str = ""
    detail: str = ""
    requests_at_once: int = 1
    images: int = 0
    images_encoded: int = 0
    images_skipped: int = 0
    encoder_ms: float = 0.0


@dataclass(frozen=True)
class ChatUpdate:
    """What the chat shows while a turn runs: the reply so far, a status line, and the numbers once it is done."""

    text: str
    status: str = ""
    turn: TurnStats | None = None
    token_ids: list[int] | None = None  # once done: the turn's prompt ids + the reply's ids (the chat's token history)


class TimedStreamer(TextIteratorStreamer):
    """``TextIteratorStreamer`` that also notes when the first generated token arrives (``perf_counter`` seconds)."""

    def __init__(self, tokenizer, **kwargs) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True, **kwargs)
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        if self.first_token_time is None and not self.next_tokens_are_prompt:
            self.first_token_time = time.perf_counter()
        super().put(value)


class ChatEngine:
    """One model, its tokenizer, the one :class:`HybridPrefixCache` that every browser session shares, and the cache's
    continuous-batching manager that runs the turns of all sessions at once.

    The cache and its manager are built lazily on the first message (so the cache's settings can be chosen first)
    and dropped by :meth:`clear_cache`. :meth:`chat` is safe to call from many threads at once (Gradio runs each
    session's event in its own); ``self.lock`` guards building and dropping the cache.
    """

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        max_new_tokens: int = 48,
        suppress_tokens=None,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        processor=None,
    ) -> None:
        if tokenizer.chat_template is None:
            raise ValueError(
                f"The tokenizer of {name!r} has no chat template; pick a chat or instruct checkpoint, or set "
                "`tokenizer.chat_template` before building the engine."
            )
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be at least 1, got {max_running_requests}.")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        # A vision-language wrapper's processor: it renders chats with images (hf_hybridcache.serve.image_chat), and
        # the reply memory splices each reply's generated ids into the next prompt, keyed by the prompt's images.
        self.processor, self.memory = processor, None
        if processor is not None:
            from hf_hybridcache.serve import ReplyMemory

            self.memory = ReplyMemory()
        self.generation_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
        if suppress_tokens:
            self.generation_kwargs["suppress_tokens"] = list(suppress_tokens)
        self.max_running_requests = max_running_requests
        self.lock = threading.Lock()
        self.cache: HybridPrefixCache | None = None
        self.manager = None
        self.settings: CacheSettings | None = None
        self.hit_history: list[dict] = []
        self._totals = [0, 0]  # prompt tokens, hit tokens over the app's life (clears included)
        self._history_lock = threading.Lock()
        self._request_ids = itertools.count()

    # ------------------------------------------------------------------ building

    @classmethod
    def builtin(cls, max_new_tokens: int = 48, max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS) -> ChatEngine:
        """The built-in random Jamba-shaped model and the byte-level tokenizer: no downloads, starts in ~1 s."""
        tokenizer = byte_tokenizer()
        allowed = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch))[0] for ch in BUILTIN_ALPHABET}
        allowed.add(tokenizer.eos_token_id)
        suppress = [i for i in range(len(tokenizer)) if i not in allowed]
        model = build_model("jamba", seed=0, **BUILTIN_MODEL)
        name = f"built-in random Jamba-shaped model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)"
        return cls(model, tokenizer, name, max_new_tokens, suppress, max_running_requests)

    @classmethod
    def builtin_vision(
        cls, max_new_tokens: int = 48, max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    ) -> ChatEngine:
        """The built-in random Qwen3.5-shaped vision-language wrapper (a gated delta net decoder and a two-layer
        vision tower) with its processor made in code (``hf_hybridcache.toy.vision``): no downloads."""
        from hf_hybridcache.toy.vision import build_vlm, qwen_processor

        processor = qwen_processor()
        tokenizer = processor.tokenizer
        allowed = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch))[0] for ch in BUILTIN_ALPHABET}
        allowed.add(tokenizer.eos_token_id)
        model = build_vlm("qwen3_5", seed=0)
        suppress = [i for i in range(model.config.text_config.vocab_size) if i not in allowed]
        params = sum(p.numel() for p in model.parameters()) / 1e6
        name = f"built-in random Qwen3.5-shaped vision-language model ({params:.2f}M params)"
        return cls(model, tokenizer, name, max_new_tokens, suppress, max_running_requests, processor)

    @classmethod
    def from_pretrained(
        cls,
        model_id: str,
        max_new_tokens: int = 48,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        trust_remote_code: bool = False,
    ) -> ChatEngine:
        """A hub checkpoint or a local ``save_pretrained`` folder (bf16 on a GPU, fp32 on CPU; SDPA attention, which
        the engine needs). A vision-language checkpoint (Qwen3.5, LFM2-VL, ...) is loaded as published, the wrapper
        with its processor, and its chat takes images; ``trust_remote_code``: let the processor's own code run (a
        folder that ships it, as ``hf_hybridcache.toy.vision.save_vlm`` writes).

        Raises:
            ValueError: the model type is not supported by hf_hybridcache, or the tokenizer has no chat template.
        """
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

        from hf_hybridcache.multimodal import WRAPPERS

        vision = AutoConfig.from_pretrained(model_id).model_type in WRAPPERS
        processor = AutoProcessor.from_pretrained(model_id, trust_remote_code=trust_remote_code) if vision else None
        tokenizer = processor.tokenizer if vision else AutoTokenizer.from_pretrained(model_id)
        on_gpu = torch.cuda.is_available()
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(
            model_id, dtype=torch.bfloat16 if on_gpu else torch.float32, attn_implementation="sdpa"
        )
        if model.config.model_type not in supported_model_types() and not vision:
            raise ValueError(
                f"{model_id!r} is a {model.config.model_type!r} model; hf_hybridcache supports "
                f"{', '.join(supported_model_types())}. Pick a checkpoint of one of those."
            )
        model = model.to("cuda" if on_gpu else "cpu").eval()
        return cls(model, tokenizer, model_id, max_new_tokens, max_running_requests=max_running_requests,
                   processor=processor)

    @staticmethod
    def eviction_choices() -> list[str]:
        """The eviction policies of the cache, its default last."""
        return ["lru", "flop_aware"]

    def warm_up(self) -> None:
        """One short ``generate()`` without the cache, so that one-time costs (lazy inits, first calls of each op)
        do not land in the first visitor's TTFT."""
        ids, images, _ = self.prompt_inputs([{"role": "user", "content": "warm up"}])
        self.model.generate(ids, **{**self.generation_kwargs, "max_new_tokens": 2}, **(images or {}))

    # ------------------------------------------------------------------ the shared cache and its engine

    def _serving(self, settings: CacheSettings):
        """The shared cache and its running manager; both built with ``settings`` if there is none yet."""
        with self.lock:
            if self.cache is None:
                cache = HybridPrefixCache(
                    self.model,
                    retention_interval=settings.retention_interval,
                    max_cache_bytes=settings.max_cache_mib * MIB,
                    eviction=settings.eviction,
                )
                eos = self.tokenizer.eos_token_id
                generation_config = GenerationConfig(
                    **self.generation_kwargs, eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or eos
                )
                batching = ContinuousBatchingConfig(max_requests_per_batch=self.max_running_requests)
                manager = cache.init_continuous_batching(generation_config, batching)
                manager.start()
                self.cache, self.manager, self.settings = cache, manager, settings
            return self.cache, self.manager

    def clear_cache(self) -> None:
        """Stop the engine and drop the shared cache (every stored block and checkpoint); the next message builds new
        ones. A turn still running ends with an error that asks to send it again."""
        with self.lock:
            manager, self.cache, self.manager, self.settings = self.manager, None, None, None
        if manager is not None:
            manager.stop(block=True, timeout=30.0)

    # ------------------------------------------------------------------ chat turns

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def prompt_ids(self, messages: list[dict]) -> torch.Tensor:
        """Token ids ``[1, L]`` of the chat so far plus the assistant prefix, from the tokenizer's chat template.

        The chat is kept as token ids: the last reply carries ``token_ids`` (its turn's prompt + the ids generated),
        and only the template text after the reply is tokenized anew. Re-tokenizing the reply's text could give other
        ids at its seams, and the cache stored the generated ones (README: when a chat's reply is reused)."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("token_ids")), default=-1)
        if last >= 0:
            before, full = self._render(messages[:last]) + messages[last]["content"], self._render(messages)
            if full.startswith(before):
                tail = self.tokenizer(full[len(before) :], add_special_tokens=False).input_ids
                return torch.tensor([messages[last]["token_ids"] + tail], device=self.model.device)
        chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        encoded = self.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"].to(self.model.device)

    def prompt_inputs(self, messages: list[dict]) -> tuple[torch.Tensor, dict | None, bytes]:
        """``(token ids [1, L], image inputs or None, images key)`` of the chat so far plus the assistant prefix.

        Without a processor: :meth:`prompt_ids`. With one, a user message's ``images`` (file paths) go before its text,
        and the processor's chat template and the processor make the ids and the pixel inputs; the previous replies'
        generated ids are spliced in from the reply memory (``hf_hybridcache.serve.image_chat.image_prompt``)."""
        if self.processor is None:
            return self.prompt_ids(messages), None, b""
        from PIL import Image

        from hf_hybridcache.serve import image_prompt

        chat, images = [], []
        for m in messages:
            paths = m.get("images") or []
            images += [Image.open(path).convert("RGB") for path in paths]
            parts = [{"type": "image"} for _ in paths] + [{"type": "text", "text": m["content"]}]
            chat.append({"role": m["role"], "content": parts if paths else m["content"]})
        ids, inputs, key = image_prompt(self.processor, chat, images, self.memory)
        inputs = {name: tensor.to(self.model.device) for name, tensor in inputs.items()} if images else None
        return torch.tensor([ids], device=self.model.device), inputs, key

    def _generate_cold(self, ids: torch.Tensor, images: dict | None = None) -> tuple[torch.Tensor, float]:
        """The same prompt through a plain ``generate()`` without the cache: its new ids and TTFT in ms."""
        streamer = TimedStreamer(self.tokenizer)
        start = time.perf_counter()
        try:
            sequences = self.model.generate(ids, streamer=streamer, **self.generation_kwargs, **(images or {}))
        finally:
            streamer.end()  # a second end() after generate's own is harmless
        return sequences[0, ids.shape[1] :], 1000 * ((streamer.first_token_time or time.perf_counter()) - start)

    def chat(self, messages: list[dict], settings: CacheSettings, compare: bool) -> Iterator[ChatUpdate]:
        """Run one turn on the engine and stream its reply, then (``compare``) the same prompt without the cache.

        Yields the reply so far while it streams, and a last update with :class:`TurnStats`. Closing the iterator
        early (a visitor who left) cancels the request.

        Raises:
            ValueError: the engine refused the request (it says what to do), or the cache was cleared meanwhile.
        """
        ids, images, images_key = self.prompt_inputs(messages)
        cache, manager = self._serving(settings)
        request_id = f"chat-{next(self._request_ids)}"
        start, first_token_time, at_once, output = time.perf_counter(), None, 1, None
        before = cache.stats
        manager.add_request(
            ids[0].tolist(),
            request_id=request_id,
            streaming=True,
            max_new_tokens=self.generation_kwargs["max_new_tokens"],
            **({} if images is None else {"images": images}),
        )
        try:
            for output in manager.request_id_iter(request_id):
                at_once = max(at_once, manager.num_running)
                if output.generated_tokens and first_token_time is None:
                    first_token_time = time.perf_counter()
                if output.generated_tokens and not output.error:
                    yield ChatUpdate(
                        self.tokenizer.decode(output.generated_tokens, skip_special_tokens=True), "generating"
                    )
        finally:
            if output is None or not output.is_finished():
                manager.cancel_request(request_id)  # the visitor left, or the engine stopped
        if output is None or not output.is_finished():
            raise ValueError("The cache was cleared while this turn ran; send the message again.")
        if output.error:
            raise ValueError(output.error)
        new_ids = torch.tensor(output.generated_tokens, dtype=torch.long)
        ttft_ms = 1000 * ((first_token_time or time.perf_counter()) - start)
        self._record(ids.shape[1], output.hit_tokens)
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        reply_ids = new_ids.tolist()
        if reply_ids and reply_ids[-1] == self.tokenizer.eos_token_id:
            reply_ids.pop()  # the template writes the end of the reply itself
        token_ids = ids[0].tolist() + reply_ids
        if self.memory is not None:
            self.memory.remember(None, ids[0].tolist(), text, reply_ids, images_key)
        prompt_tokens, hit_tokens, report = ids.shape[1], output.hit_tokens, output.hit_report
        after = cache.stats
        turn = TurnStats(
            prompt_tokens,
            hit_tokens,
            prompt_tokens - hit_tokens,
            len(new_ids),
            ttft_ms,
            reason=report.reason,
            detail=report.detail,
            requests_at_once=at_once,
            images=sum(len(m.get("images") or []) for m in messages),
            images_encoded=after.images_encoded - before.images_encoded,
            images_skipped=after.images_skipped - before.images_skipped,
            encoder_ms=1000 * (after.vision_encoder_seconds - before.vision_encoder_seconds),
        )
        if compare:
            yield ChatUpdate(text, "running the same prompt without the cache")
            cold_ids, cold_ttft_ms = self._generate_cold(ids, images)
            same = torch.equal(cold_ids.cpu(), new_ids)
            turn = TurnStats(**{**asdict(turn), "cold_ttft_ms": cold_ttft_ms, "identical_to_cold": same})
        yield ChatUpdate(text, "", turn, token_ids)

    def _record(self, prompt_tokens: int, hit_tokens: int) -> None:
        with self._history_lock:
            self._totals[0] += prompt_tokens
            self._totals[1] += hit_tokens
            request = len(self.hit_history) // 2 + 1
            self.hit_history.append(
                {"request": request, "hit_rate": hit_tokens / prompt_tokens, "series": "this request"}
            )
            self.hit_history.append(
                {"request": request, "hit_rate": self._totals[1] / self._totals[0], "series": "all requests so far"}
            )

    # ------------------------------------------------------------------ what the cache panel shows

    def panel_html(self) -> str:
        cache, settings, manager = self.cache, self.settings, self.manager
        if cache is None or manager is None:
            return (
                "<div id='cache-empty'><b>No cache yet.</b> Pick the settings below; the first message builds the "
                "shared cache with them.</div>"
            )
        s = cache.stats
        used = s.stored_bytes / s.max_cache_bytes
        rows = [
            ("stored", f"{s.stored_bytes / MIB:.2f} MiB of {s.max_cache_bytes / MIB:.0f} MiB ({100 * used:.1f} %)"),
            ("KV blocks", f"{s.kv_blocks} ({cache.block_size} tokens each)"),
            ("checkpoints", str(s.checkpoints)),
            ("evicted", f"{s.evicted_kv_blocks} KV blocks, {s.evicted_checkpoints} checkpoints"),
            ("requests", str(s.requests)),
            ("why", ", ".join(f"{reason} {n}" for reason, n in s.misses_by_reason.items() if n) or "–"),
            ("token hit rate", f"{100 * s.token_hit_rate:.1f} % ({s.hit_tokens} of {s.prompt_tokens} tokens)"),
            (
                "engine",
                f"{manager.num_running} requests running, {manager.num_waiting} waiting now "
                f"(at most {self.max_running_requests} at once)",
            ),
            ("settings", f"retention {settings.retention_interval}, eviction {settings.eviction}"),
        ]
        if self.processor is not None:  # the vision encoder's work, and what hits spared it
            rows[5:5] = [
                ("images skipped", f"{s.images_skipped} (inside a hit: not encoded again)"),
                ("images encoded", f"{s.images_encoded}, vision encoder {1000 * s.vision_encoder_seconds:.1f} ms in "
                 f"{s.vision_encoder_calls} calls"),
            ]
        table = "".join(f"<tr><th>{k}</th><td data-stat='{k}'>{v}</td></tr>" for k, v in rows)
        bar = (
            "<div style='background:#e5e7eb;border-radius:4px;height:10px;margin:4px 0 8px'>"
            f"<div style='background:#6366f1;border-radius:4px;height:10px;width:{min(100.0, 100 * used):.1f}%'>"
            "</div></div>"
        )
        return f"<div id='cache-stats'>{bar}<table>{table}</table></div>"

    def hit_plot(self) -> pd.DataFrame | None:
        """Token hit rate per request and over all requests so far (clears included), two rows per request; None
        before the first request (Gradio 6's plot stays blank for good after an empty typed frame). Requests are
        zero-padded labels, so the axis shows one tick per request (a numeric axis put ticks at 0.5, 1.5, ...)."""
        if not self.hit_history:
            return None
        with self._history_lock:
            frame = pd.DataFrame(list(self.hit_history))
        frame["request"] = frame["request"].map(lambda n: f"{n:03d}")
        return frame


# ---------------------------------------------------------------------- rendering


def _badge(turn: TurnStats) -> str:
    text = (
        f"⚡ hit {turn.hit_tokens} of {turn.prompt_tokens} prompt tokens ({turn.reason}) · replayed "
        f"{turn.replayed_tokens} · TTFT {turn.ttft_ms:.0f} ms · {turn.requests_at_once} request(s) at once"
    )
    if turn.cold_ttft_ms is not None:
        same = "identical to cold ✓" if turn.identical_to_cold else "DIFFERS from cold ✗"
        text += f" (without cache {turn.cold_ttft_ms:.0f} ms) · {same}"
    if turn.images:
        text += (
            f" · 🖼 {turn.images_skipped} image(s) skipped, {turn.images_encoded} encoded "
            f"(vision encoder {turn.encoder_ms:.1f} ms)"
        )
    return text


#: What the chat shows for a reply with no text: the model ended it at once (its first token was the end of sequence).
EMPTY_REPLY = "_(empty reply: the model's first token was its end-of-sequence token)_"


def render_chat(conversation: list[dict], turns: list[TurnStats], pending: ChatUpdate | None = None) -> list[dict]:
    """Chatbot messages: each reply followed by a collapsed box whose title holds the turn's numbers; an empty reply
    says so (:data:`EMPTY_REPLY`) instead of showing an empty bubble; a message's images are shown before its text."""
    shown: list[dict] = []
    for i, message in enumerate(conversation):
        shown += [{"role": message["role"], "content": {"path": path}} for path in message.get("images") or []]
        empty = message["role"] == "assistant" and not message["content"].strip()
        shown.append({"role": message["role"], "content": EMPTY_REPLY if empty else message["content"]})
        turn_index = i // 2
        if message["role"] == "assistant" and turn_index < len(turns):
            turn = turns[turn_index]
            details = (
                f"Prompt tokens {turn.prompt_tokens}: {turn.hit_tokens} restored from the cache, "
                f"{turn.replayed_tokens} run through the model. {turn.new_tokens} new tokens. "
                f"Why {turn.reason}: {turn.detail}"
            )
            badge = {"title": _badge(turn), "status": "done"}
            shown.append({"role": "assistant", "content": details, "metadata": badge})
    if pending is not None:
        shown.append({"role": "assistant", "content": pending.text or "…"})
        if pending.status:
            status = {"title": pending.status, "status": "pending"}
            shown.append({"role": "assistant", "content": "", "metadata": status})
    return shown


def turns_markdown(turns: list[TurnStats], vision: bool = False) -> str:
    """The session's turns as a Markdown table (``vision``: with the images skipped and encoded, and the vision
    encoder's time, in ms)."""
    if not turns:
        return "_No turns yet in this session._"
    images = (" images skipped | images encoded | encoder (ms) |", "---:|---:|---:|") if vision else ("", "")
    lines = [
        "| # | prompt tokens | hit tokens | why | replayed tokens | TTFT (ms) | requests at once "
        "| TTFT without cache (ms) | identical to cold |" + images[0],
        "|---:|---:|---:|:---|---:|---:|---:|---:|:---:|" + images[1],
    ]
    for i, t in enumerate(turns, 1):
        cold = "–" if t.cold_ttft_ms is None else f"{t.cold_ttft_ms:.0f}"
        same = "–" if t.identical_to_cold is None else ("yes" if t.identical_to_cold else "NO")
        cells = [
            i,
            t.prompt_tokens,
            t.hit_tokens,
            t.reason,
            t.replayed_tokens,
            f"{t.ttft_ms:.0f}",
            t.requests_at_once,
            cold,
            same,
        ]
        if vision:
            cells += [t.images_skipped, t.images_encoded, f"{t.encoder_ms:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the app


#: Table headers wrap between words, never inside one (the turns table and the cache panel).
CSS = """
#turns th, #turns td, #cache-panel th { word-break: normal; overflow-wrap: normal; hyphens: none; }
"""


def how_it_works() -> str:
    """The module docstring up to "Run it with", as Markdown: Sphinx roles and double backticks become code spans."""
    text = __doc__.split("Run it with")[0]
    text = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)  # :class:`~a.b.C` -> `C`
    return text.replace("``", "`")



INTRO = """\
# hf_hybridcache: prefix caching for hybrid attention + Mamba models
Chat with **{name}**. Every turn is one request to the continuous-batching engine of one `HybridPrefixCache` that all
visitors share: the second turn restores the first turn's attention KV blocks and Mamba state checkpoint and runs only the new text, so it
starts sooner. Beside each reply: prompt tokens, hit (restored) tokens, replayed tokens and the time to first token;
tick **compare** to also run the prompt without the cache and check that the reply is the same token for token.
{model_note}
Visitors chat at the same time: the engine runs up to {max_running} requests in the same forward steps (the column
"requests at once" says how many ran with yours). Your chat history is yours; the cache is shared, so another visitor
with the same system prompt gets a hit on their first turn (with a retention interval other than 0).
"""
BUILTIN_NOTE = (
    "The built-in model has **random weights: its replies are gibberish, by design** (no downloads; letters only). "
    "Run the app with `--model-id` for a real checkpoint."
)
VISION_NOTE = (
    " This model reads images: attach one to a message, then ask a second question about it. The second turn "
    "restores the image with the rest of the chat, so the vision encoder does not run for it (the columns images "
    "skipped, images encoded and encoder time)."
)


def build_demo(engine: ChatEngine) -> gr.Blocks:
    """The Gradio app around ``engine``. Chat turns run ``engine.max_running_requests`` at once (Gradio's queue holds
    the others); clearing the cache waits for its own slot."""
    is_builtin = "suppress_tokens" in engine.generation_kwargs
    vision = engine.processor is not None  # the message box takes an image (a MultimodalTextbox)

    def settings_updates():
        locked = engine.settings
        if locked is None:
            return [gr.update(interactive=True)] * 3
        retention = "dense" if locked.retention_interval == "dense" else str(locked.retention_interval)
        return [
            gr.update(value=retention, interactive=False),
            gr.update(value=locked.eviction, interactive=False),
            gr.update(value=locked.max_cache_mib, interactive=False),
        ]

    def panel_outputs():
        return [engine.panel_html(), engine.hit_plot(), *settings_updates()]

    def send(message, system_prompt, compare, retention, eviction, budget, conversation, turns):
        files = []
        if isinstance(message, dict):  # the MultimodalTextbox: {"text": ..., "files": [paths]}
            files = [f if isinstance(f, str) else f["path"] for f in message.get("files") or []]
            message = message.get("text")
        message = (message or "").strip()
        if not message and not files:
            raise gr.Error("Type a message first.")
        settings = CacheSettings.from_ui(retention, eviction, budget)
        asked = conversation + [{"role": "user", "content": message, **({"images": files} if files else {})}]
        messages = ([{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []) + asked
        yield {
            chatbot: render_chat(asked, turns, ChatUpdate("", "waiting for the model")),
            msg: None if vision else "",
            system: gr.update(interactive=False),
        }
        try:
            for update in engine.chat(messages, settings, bool(compare)):
                if update.turn is None:
                    yield {chatbot: render_chat(asked, turns, update)}
                    continue
                conversation = asked + [{"role": "assistant", "content": update.text, "token_ids": update.token_ids}]
                turns = turns + [update.turn]
                yield {
                    chatbot: render_chat(conversation, turns),
                    state_conversation: conversation,
                    state_turns: turns,
                    turns_md: turns_markdown(turns, vision),
                    last_turn: asdict(update.turn),
                    **dict(zip(panel, panel_outputs())),
                }
        except ValueError as error:  # a clear message from the cache or the tokenizer; the cache stays usable
            raise gr.Error(str(error)) from error

    def new_chat():
        return [], [], [], turns_markdown([], vision), None, gr.update(interactive=True)

    def clear_cache():
        engine.clear_cache()
        return panel_outputs()

    with gr.Blocks(title="hf_hybridcache demo") as demo:
        state_conversation = gr.State([])
        state_turns = gr.State([])
        gr.Markdown(
            INTRO.format(
                name=engine.name,
                model_note=(BUILTIN_NOTE if is_builtin else "") + (VISION_NOTE if vision else ""),
                max_running=engine.max_running_requests,
            )
        )
        with gr.Tab("Chat"), gr.Row():
            with gr.Column(scale=3):
                with gr.Accordion("System prompt (fixed after your first message)", open=False):
                    system = gr.Textbox(
                        DEFAULT_SYSTEM_PROMPT, show_label=False, lines=3, max_lines=8, elem_id="system-prompt"
                    )
                chatbot = gr.Chatbot(
                    label="Chat",
                    height=500,
                    elem_id="chatbot",
                    group_consecutive_messages=False,
                    buttons=["copy_all"],
                )
                with gr.Row():
                    if vision:
                        msg = gr.MultimodalTextbox(
                            placeholder="Type a message, attach an image (the clip), press Enter",
                            file_types=["image"],
                            show_label=False,
                            scale=5,
                            elem_id="msg",
                            submit_btn=False,
                        )
                    else:
                        msg = gr.Textbox(
                            placeholder="Type a message and press Enter", show_label=False, scale=5, elem_id="msg"
                        )
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                with gr.Row():
                    compare = gr.Checkbox(
                        False, label="compare: also run without the cache (TTFT, same output)", elem_id="compare"
                    )
                    new_btn = gr.Button("New chat", size="sm", elem_id="new-chat")
                turns_md = gr.Markdown(turns_markdown([], vision), elem_id="turns")
                with gr.Accordion("Last turn (raw numbers)", open=False):
                    last_turn = gr.JSON(label="last turn", elem_id="last-turn")
            with gr.Column(scale=2):
                gr.Markdown("### Cache (shared by all sessions)")
                panel_box = gr.HTML(engine.panel_html(), elem_id="cache-panel")
                plot = gr.LinePlot(
                    engine.hit_plot(),
                    x="request",
                    y="hit_rate",
                    sort="x",
                    color="series",
                    y_lim=[0, 1],
                    y_title="token hit rate",
                    title="Token hit rate per request (all sessions)",
                    height=220,
                    elem_id="hit-plot",
                )
                retention = gr.Dropdown(
                    RETENTION_CHOICES,
                    value=DEFAULT_RETENTION,
                    label="Retention interval (checkpoints kept during prefill)",
                    elem_id="retention",
                )
                eviction = gr.Dropdown(
                    engine.eviction_choices(),
                    value=engine.eviction_choices()[-1],
                    label="Eviction policy",
                    elem_id="eviction",
                )
                budget = gr.Dropdown(
                    BUDGET_CHOICES_MIB, value=DEFAULT_BUDGET_MIB, label="Budget (MiB)", elem_id="budget"
                )
                gr.Markdown("Settings apply when the cache is built: before the first message, or after clearing.")
                with gr.Row():
                    refresh_btn = gr.Button("Refresh", size="sm", elem_id="refresh")
                    clear_btn = gr.Button("Clear cache", size="sm", variant="stop", elem_id="clear-cache")
        with gr.Tab("How it works"):
            gr.Markdown(how_it_works(), elem_id="how-it-works")
        panel = [panel_box, plot, retention, eviction, budget]

        send_inputs = [msg, system, compare, retention, eviction, budget, state_conversation, state_turns]
        send_outputs = [chatbot, msg, system, state_conversation, state_turns, turns_md, last_turn, *panel]
        model_event = dict(concurrency_limit=engine.max_running_requests, concurrency_id="chat")
        msg.submit(send, send_inputs, send_outputs, api_name="send", show_progress="minimal", **model_event)
        send_btn.click(
            send, send_inputs, send_outputs, api_visibility="private", show_progress="minimal", **model_event
        )
        new_chat_outputs = [chatbot, state_conversation, state_turns, turns_md, last_turn, system]
        new_btn.click(new_chat, None, new_chat_outputs, api_name="new_chat")
        clear_btn.click(clear_cache, None, panel, api_name="clear_cache")
        refresh_btn.click(panel_outputs, None, panel, api_name="cache_panel")
        demo.load(panel_outputs, None, panel, api_visibility="private")
    return demo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-id",
        default=os.environ.get("MODEL_ID"),
        help="hub id or local folder of a supported checkpoint (default: $MODEL_ID, else the built-in model)",
    )
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=DEFAULT_MAX_RUNNING_REQUESTS,
        help="chat turns the engine runs at once (Gradio's queue holds the others)",
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        default=os.environ.get("VISION") == "1",
        help="the built-in random vision-language model: messages take an image (default: $VISION=1)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a --model-id checkpoint run the code it ships (a vision-language checkpoint's own processor)",
    )
    args = parser.parse_args(argv)
    if args.model_id:
        engine = ChatEngine.from_pretrained(
            args.model_id, args.max_new_tokens, args.max_running_requests, args.trust_remote_code
        )
    elif args.vision:
        engine = ChatEngine.builtin_vision(args.max_new_tokens, args.max_running_requests)
    else:
        engine = ChatEngine.builtin(args.max_new_tokens, args.max_running_requests)
    engine.warm_up()
    demo = build_demo(engine)
    demo.queue(default_concurrency_limit=1)
    demo.launch(server_name=args.host, server_port=args.port, css=CSS)


if __name__ == "__main__":
    main()
