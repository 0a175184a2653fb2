"""Chats with images for a vision-language wrapper: the messages' image parts loaded
(:mod:`~hf_hybridcache.serve.images`), the conversation rendered with the processor's chat template (each image part as
``{"type": "image"}``), and the processor run on it for the prompt ids and the pixel tensors the engine takes with
the request (``add_request(input_ids, images=...)``: what the processor returns for the prompt besides
``input_ids`` / ``attention_mask``).

The prompt keeps the previous turns' reply ids as a text chat does (:mod:`~hf_hybridcache.serve.prompts`): the
rendered conversation is cut at each remembered reply, and each piece is run through the processor with the images
whose image tokens it holds (a piece without one through the tokenizer), so turn ``k`` starts with turn ``k - 1``'s
prompt and reply ids and the prefix cache restores the image with them.
"""

from __future__ import annotations

import asyncio

import torch

from .images import ImageLimits, image_digest, load_image
from .prompts import TextPieces, spliced_prompt
from .schema import APIError, Message

#: Processor outputs that are per token of the prompt, not per image: rebuilt for the spliced ids, or left out.
_TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def image_parts(messages: list[Message]) -> list[tuple[str, str]]:
    """``(param, url)`` of every image part of ``messages``, in order (``param``: where it is in the request).

    Raises:
        APIError: 400 for an image part in a message whose role is not ``user`` (as OpenAI refuses it).
    """
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            param = f"messages[{i}].content[{j}].image_url"
            if message.role != "user":
                article = "an" if message.role[:1] in "aeiou" else "a"
                raise APIError(400, f"{param}: image parts are taken in user messages only, not in {article} "
                               f"{message.role} message.", param=param)
            parts.append((f"{param}.url", part.image_url.url))
    return parts


def refuse_images(messages: list[Message], model_id: str) -> None:
    """A 400 when ``messages`` hold an image part and the served model takes text only.

    Raises:
        APIError: 400 naming the first image part.
    """
    parts = image_parts(messages)
    if parts:
        raise APIError(400, f"The model {model_id!r} takes text only: it has no vision tower and no processor, so "
                       "image parts are refused; send text parts only, or serve a vision-language checkpoint.",
                       param=parts[0][0])


class ImagePieces(TextPieces):
    """Pieces of a rendered conversation run through ``processor``, each with the images its image tokens stand for
    (in order); a piece without one through the tokenizer. ``outputs`` holds the processor's outputs of the pieces of
    the latest rendering; a piece seen before (the same text and images, at an earlier reply's lookup) is not run
    again."""

    def __init__(self, processor, images: list) -> None:
        super().__init__(processor.tokenizer)
        self.processor, self.images = processor, images
        self.digests = [image_digest(image) for image in images]
        self.used, self.outputs = 0, []
        self._runs: dict[tuple[str, int], dict] = {}

    def render(self, messages: list[dict], template_kwargs: dict) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs)

    def start(self) -> None:
        self.used, self.outputs = 0, []

    def encode(self, text: str) -> list[int]:
        count = text.count(self.processor.image_token)
        if not count:
            return super().encode(text)
        key = (text, self.used)
        if key not in self._runs:
            images = self.images[self.used : self.used + count]
            self._runs[key] = self.processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
        self.used += count
        self.outputs.append(self._runs[key])
        return self._runs[key]["input_ids"][0].tolist()

    def images_key(self) -> bytes:
        return b"".join(self.digests[: self.used])


def image_prompt(processor, messages: list[dict], images: list, memory=None, salt: str | None = None,
                 **template_kwargs) -> tuple[list[int], dict[str, torch.Tensor], bytes]:
    """The prompt of a conversation with images.

    Args:
        processor: the wrapper's processor (``AutoProcessor``), with a chat template.
        messages: ``[{"role", "content"}]``, content a string or parts (``{"type": "text", "text"}`` and
            ``{"type": "image"}``), as :meth:`~hf_hybridcache.serve.schema.Message.for_template` gives them.
        images: the PIL images of the image parts, in order.
        memory, salt: the :class:`~hf_hybridcache.serve.prompts.ReplyMemory` whose reply ids are spliced in.

    Returns:
        ``(prompt ids, image inputs, images key)``: the image inputs are the processor's tensors besides the per-token
        ones (e.g. ``pixel_values`` ``[patches, C * T * P * P]`` float32 and ``image_grid_thw`` ``[N, 3]`` int64), and
        ``mm_token_type_ids`` ``[1, T]`` rebuilt for the prompt ids when the processor gives them; the images key
        names the images in the reply memory (their digests, joined).

    Raises:
        ValueError: the template wrote another number of image tokens than there are images; the template or the
            processor refused the conversation.
    """
    pieces = ImagePieces(processor, images)
    if memory is not None:
        memory = _WithoutPlaceholders(memory, _placeholder_ids(processor))
    ids = spliced_prompt(pieces, messages, memory, salt, **template_kwargs)
    if pieces.used != len(images):
        raise ValueError(f"The chat template wrote {pieces.used} image tokens for {len(images)} images.")
    inputs = _merged(pieces.outputs)
    if inputs is None:  # per-piece tensors that do not stack (padded to each piece's longest): one run over all
        whole = processor(text=processor.image_token * len(images), images=images, return_tensors="pt")
        inputs = {k: v for k, v in whole.items() if k not in _TOKEN_KEYS}
    if any("mm_token_type_ids" in out for out in pieces.outputs):
        inputs["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids([ids]), dtype=torch.long)
    return ids, inputs, pieces.images_key()


def _placeholder_ids(processor) -> frozenset[int]:
    """The ids of the processor's image, video and audio placeholder tokens."""
    tokens = [getattr(processor, f"{kind}_token", None) for kind in ("image", "video", "audio")]
    ids = processor.tokenizer.convert_tokens_to_ids([t for t in tokens if isinstance(t, str)])
    return frozenset(i for i in ids if isinstance(i, int) and i != processor.tokenizer.unk_token_id)


class _WithoutPlaceholders:
    """A reply memory whose replies holding a placeholder id are not spliced in: such an id stands for content the
    request does not hold (the engine refuses the prompt, transformers fails on it), so the reply is encoded from its
    text, as the client sent it back (the model sampled the id; its text skips it)."""

    def __init__(self, memory, placeholders: frozenset[int]) -> None:
        self.memory, self.placeholders = memory, placeholders

    def lookup(self, *args) -> list[int] | None:
        ids = self.memory.lookup(*args)
        return None if ids is None or not self.placeholders.isdisjoint(ids) else ids


def _merged(outputs: list[dict]) -> dict[str, torch.Tensor] | None:
    """The image tensors of the pieces' outputs concatenated along dim 0, or None when their trailing shapes differ."""
    names = [k for k in outputs[0] if k not in _TOKEN_KEYS] if outputs else []
    merged = {}
    for name in names:
        tensors = [out[name] for out in outputs]
        if len({tuple(t.shape[1:]) for t in tensors}) > 1:
            return None
        merged[name] = torch.cat(tensors)
    return merged


class ImageChat:
    """What lets a server take image parts: the wrapper's ``processor`` and the :class:`ImageLimits`."""

    def __init__(self, processor, limits: ImageLimits | None = None) -> None:
        if getattr(processor, "image_token", None) is None:
            raise ValueError(f"{type(processor).__name__} has no image_token; serve a vision-language checkpoint's "
                             "processor (AutoProcessor.from_pretrained).")
        self.processor, self.limits = processor, limits or ImageLimits()

    def refuse_placeholders(self, prompts: list[list[int]]) -> None:
        """A 400 when a ``/v1/completions`` prompt (token ids) holds an image, video or audio placeholder id: it
        would stand for content the request cannot carry (the engine refuses such a prompt).

        Raises:
            APIError: 400 naming the first such id.
        """
        placeholders = _placeholder_ids(self.processor)
        for ids in prompts:
            found = sorted(placeholders.intersection(ids))
            if found:
                token = self.processor.tokenizer.convert_ids_to_tokens(found[0])
                raise APIError(400, f"The prompt holds the placeholder token {token!r} (id {found[0]}), which stands "
                               "for an image, video or audio input; /v1/completions takes text only: send images as "
                               "image_url parts to /v1/chat/completions, or drop the token.", param="prompt")

    async def prompt(self, messages: list[Message], memory, salt: str | None,
                     template_kwargs: dict) -> tuple[list[int], dict[str, torch.Tensor] | None, bytes]:
        """``(prompt ids, image inputs or None without images, images key)`` of a chat request's ``messages``.

        Raises:
            APIError: 400 for a bad image part (:func:`~hf_hybridcache.serve.images.load_image`) and for a
                conversation the template or the processor refuses.
        """
        parts = image_parts(messages)
        images = await asyncio.gather(*(load_image(url, self.limits, param) for param, url in parts))
        rendered = [m.for_template(with_images=True) for m in messages]
        try:
            ids, inputs, key = await asyncio.to_thread(image_prompt, self.processor, rendered, list(images), memory,
                                                       salt, **template_kwargs)
        except Exception as problem:  # noqa: BLE001 - a template or processor that refuses the conversation
            raise APIError(400, f"The chat template or the processor cannot take these messages: {problem}",
                           param="messages") from None
        return ids, (inputs if images else None), key
