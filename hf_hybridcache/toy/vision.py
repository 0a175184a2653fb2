"""Tiny seeded vision-language wrappers of the hybrid families, images drawn in code, and their model inputs.

Each wrapper is built as transformers builds it (``Qwen3_5ForConditionalGeneration`` and kin) from the tiny text
config of its decoder (:data:`~hf_hybridcache.toy.configs.TINY_CONFIGS`, with room in the vocabulary for the
placeholder tokens below) and a vision tower of two small layers, then given the long-memory init. Pixel inputs are
made the way each family's image processor lays them out (Qwen3.5 and LFM3-VL through transformers' own PIL
``Qwen2VLImageProcessorPil``; the others, whose processors need torchvision, by the same layout written here), and a
prompt wraps each image's placeholder tokens in the family's delimiters.

Qwen3.5's tiny text config rotates every head dimension with multimodal sections ``[2, 3, 3]``, so a wrong
``rope_deltas`` or 3D position moves the logits (transformers' default rotates a quarter of a 16-wide head: two
frequencies, one of them temporal, too few to tell positions apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import transformers
from PIL import Image

from . import TINY_CONFIGS, VOCAB_SIZE, byte_tokenizer, long_memory_init_, tiny_config

#: Placeholder and delimiter tokens after the byte vocabulary: ``name -> id``.
VISION_TOKENS = {"<|image_pad|>": VOCAB_SIZE, "<|video_pad|>": VOCAB_SIZE + 1, "<|vision_start|>": VOCAB_SIZE + 2,
                 "<|vision_end|>": VOCAB_SIZE + 3, "<|audio_pad|>": VOCAB_SIZE + 4}
IMAGE, VIDEO, START, END, AUDIO = VISION_TOKENS.values()
#: The vocabulary of every tiny wrapper: bytes, special tokens, the tokens above and a few spare ids.
VLM_VOCAB_SIZE = VOCAB_SIZE + 10
PATCH = 4  # pixels per patch side in every tiny tower
MERGE = 2  # patches per token side where a tower merges them

_QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                    spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)
_MROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0, mrope_section=[2, 3, 3],
              mrope_interleaved=True)
_TOKEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


@dataclass(frozen=True)
class TinyWrapper:
    """One tiny vision-language wrapper: its config class and decoder family, the config's own settings, how its
    pixel inputs are laid out (``layout``, a key of :data:`_LAYOUTS`) and the tokens around each image."""

    config_class: str
    text_family: str
    settings: dict
    layout: str
    wrap: tuple[int, int] | None = (START, END)
    text_overrides: tuple = ()
    #: False where the tower's width is fixed by its patch layout (Inkling's stack of projections, already the
    #: slowest tower here): :data:`SIZES` leaves it as it is.
    resizable_tower: bool = True


TINY_WRAPPERS = {
    "qwen3_5": TinyWrapper("Qwen3_5Config", "qwen3_5_text", dict(vision_config=_QWEN_VISION, **_TOKEN_IDS), "qwen",
                           text_overrides=(("rope_parameters", _MROPE),)),
    "qwen3_5_moe": TinyWrapper("Qwen3_5MoeConfig", "qwen3_5_moe_text", dict(vision_config=_QWEN_VISION, **_TOKEN_IDS),
                               "qwen", text_overrides=(("rope_parameters", _MROPE),)),
    "lfm2_vl": TinyWrapper(
        "Lfm2VlConfig", "lfm2",
        dict(vision_config=dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, patch_size=PATCH, num_patches=64),
             image_token_id=IMAGE, projector_hidden_size=64, downsample_factor=MERGE, tie_word_embeddings=False),
        "naflex"),
    "lfm3_vl": TinyWrapper(
        "Lfm3VlConfig", "lfm3",
        dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, patch_size=PATCH, spatial_merge_size=MERGE,
                                temporal_patch_size=2),
             projector_hidden_size=64, tie_word_embeddings=False, **_TOKEN_IDS),
        "qwen"),
    "nemotron_h_omni": TinyWrapper(
        "NemotronH_Omni_Reasoning_V3_Config", "nemotron_h",
        dict(vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=PATCH,
                                image_size=32, max_img_size=64, num_cls_tokens=1, num_registers=1,
                                video_temporal_patch_size=2),
             vision_hidden_size=32, projector_hidden_size=64, image_token_id=IMAGE, video_token_id=VIDEO,
             audio_config=None),
        "packed_hw"),
    "inkling_mm_model": TinyWrapper(
        "InklingConfig", "inkling_text",
        dict(vision_config=dict(patch_size=PATCH, temporal_patch_size=2, hidden_size=32, num_hidden_layers=4),
             audio_config=dict(n_mel_bins=8, mel_vocab_size=16), image_token_id=IMAGE, audio_token_id=AUDIO,
             image_bos_token_id=START),
        "inkling", wrap=(START, None), resizable_tower=False),
    "inkling2": TinyWrapper(
        "Inkling2Config", "inkling2_text",
        dict(vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=PATCH,
                                spatial_merge_size=MERGE, posemb_grid_size=8, projection_hidden_dim=64,
                                text_hidden_size=64),
             image_token_id=IMAGE),
        "inkling2"),
}
#: Inkling 2 Loop's wrapper (transformers >= 5.24, where its tiny decoder config exists): Inkling 2's tower and layout.
if "inkling2_loop_text" in TINY_CONFIGS:
    TINY_WRAPPERS["inkling2_loop"] = TinyWrapper(
        "Inkling2LoopConfig", "inkling2_loop_text",
        dict(TINY_WRAPPERS["inkling2"].settings, vision_config=dict(TINY_WRAPPERS["inkling2"].settings["vision_config"],
                                                                    model_type="inkling2_vision")),
        "inkling2")


#: Model sizes: ``"tiny"`` (the test shapes: a tower of 2-4 layers of width 32, a few ms per image on a CPU, and the
#: decoder of :data:`~hf_hybridcache.toy.configs.TINY_CONFIGS`, width 64) and ``"realistic"`` for benchmarks (a tower of
#: 6 layers of width 128, MLP 512: tens to hundreds of ms per image on a CPU; a decoder of width 256, dense MLP 1024,
#: whose prefill costs more than a forward's fixed Python overhead, as a real decoder's does). Layer patterns, patch
#: size, merge and placeholder counts stay, so prompts are the same at every size.
SIZES = {"tiny": None, "realistic": dict(tower_layers=6, tower_width=128, decoder_width=256)}


def _sized(spec: TinyWrapper, size: str) -> tuple[dict, dict]:
    """The text config overrides and wrapper settings of ``spec`` at ``SIZES[size]``."""
    if size not in SIZES:
        raise ValueError(f"No model size {size!r}; available: {', '.join(SIZES)}.")
    shape, settings = SIZES[size], spec.settings
    if shape is None:
        return {}, settings
    width = shape["decoder_width"]
    vision = dict(settings["vision_config"])
    if spec.resizable_tower:
        vision["hidden_size"] = shape["tower_width"]
        for key in ("depth", "num_hidden_layers"):
            if key in vision:
                vision[key] = shape["tower_layers"]
        if "intermediate_size" in vision:
            vision["intermediate_size"] = 4 * shape["tower_width"]
    for key in ("out_hidden_size", "text_hidden_size"):  # the tower's output is the decoder's width
        if key in vision:
            vision[key] = width
    sized = dict(settings, vision_config=vision)
    if "vision_hidden_size" in settings and spec.resizable_tower:  # Nemotron-H Omni's projector reads it here
        sized["vision_hidden_size"] = shape["tower_width"]
    return dict(hidden_size=width, intermediate_size=4 * width), sized


def tiny_vlm_config(family: str = "qwen3_5", size: str = "tiny"):
    """The config of the tiny ``family`` wrapper (a key of :data:`TINY_WRAPPERS`) at ``size`` (:data:`SIZES`).

    Raises:
        ValueError: no tiny wrapper for ``family``, or no size ``size``.
    """
    if family not in TINY_WRAPPERS:
        raise ValueError(f"No tiny wrapper {family!r}; available: {', '.join(sorted(TINY_WRAPPERS))}.")
    import transformers

    spec = TINY_WRAPPERS[family]
    text_sizes, settings = _sized(spec, size)
    text = tiny_config(spec.text_family, vocab_size=VLM_VOCAB_SIZE, unpadded_vocab_size=VLM_VOCAB_SIZE,
                       **dict(spec.text_overrides), **text_sizes).to_dict()
    return getattr(transformers, spec.config_class)(text_config=text, **settings)


def build_vlm(family: str = "qwen3_5", seed: int = 0, dtype: torch.dtype = torch.float32,
              size: str = "tiny") -> torch.nn.Module:
    """A seeded random-init ``family`` wrapper at ``size`` (:data:`SIZES`) in eval mode, with the long-memory init of
    its decoder."""
    from transformers import AutoModelForImageTextToText

    config = tiny_vlm_config(family, size)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    long_memory_init_(model)
    return model.to(dtype).eval()


def toy_image(seed: int, width: int = 48, height: int = 32) -> Image.Image:
    """A seeded RGB picture like a screenshot: a background, a few filled boxes and noise (numpy, no files)."""
    rng = np.random.default_rng(seed)
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:] = rng.integers(0, 256, 3)
    for _ in range(4):
        top, left = rng.integers(0, height), rng.integers(0, width)
        pixels[top : top + rng.integers(2, height), left : left + rng.integers(2, width)] = rng.integers(0, 256, 3)
    noise = rng.integers(-12, 13, pixels.shape)
    return Image.fromarray(np.clip(pixels.astype(np.int64) + noise, 0, 255).astype(np.uint8))


def _array(image: Image.Image, multiple: int) -> np.ndarray:
    """``image`` as float32 ``[H, W, 3]`` in [-1, 1], cropped to a multiple of ``multiple`` pixels per side."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    height, width = pixels.shape[0] // multiple * multiple, pixels.shape[1] // multiple * multiple
    return pixels[:height, :width]


def _qwen(images: list[Image.Image]) -> tuple[dict, list[int]]:
    """Qwen2-VL's layout (Qwen3.5, LFM3-VL): transformers' PIL image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                         min_pixels=(PATCH * MERGE) ** 2, max_pixels=96 * 96)
    out = processor(images=images, return_tensors="pt")
    return dict(out), (out["image_grid_thw"].prod(-1) // MERGE**2).tolist()


class ImageOnlyQwen3VLProcessor(transformers.Qwen3VLProcessor):
    """Qwen3-VL's processor without its video processor (which needs torchvision): images only."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def qwen_processor() -> ImageOnlyQwen3VLProcessor:
    """A ``Qwen3VLProcessor`` for the tiny Qwen3.5 wrappers, made in code: the byte tokenizer with the tokens of
    :data:`VISION_TOKENS`, transformers' PIL image processor (:func:`image_inputs`' settings) and a chat template
    whose image parts become ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor expands the pad), as
    ``pipeline("image-text-to-text")`` needs. Videos are left out (their processor needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = (
        "{% for message in messages %}<|{{ message['role'] }}|>{% if message['content'] is string %}"
        "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    images = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                      min_pixels=(PATCH * MERGE) ** 2, max_pixels=96 * 96)
    return ImageOnlyQwen3VLProcessor(images, tokenizer, chat_template=tokenizer.chat_template)


#: The module a saved tiny wrapper's folder ships its processor in (``AutoProcessor`` finds it through ``auto_map``).
PROCESSOR_MODULE = "processing_image_only"


def save_vlm(path, family: str = "qwen3_5", seed: int = 0) -> torch.nn.Module:
    """Save the tiny ``family`` wrapper (Qwen3.5 or Qwen3.5-MoE: a processor made in code exists for those) and its
    processor to the folder ``path`` as a checkpoint is published: ``AutoModelForImageTextToText`` and, with
    ``trust_remote_code=True`` (the processor's class ships in the folder), ``AutoProcessor`` load them. Returns the
    model.

    Raises:
        ValueError: no processor is made in code for ``family``.
    """
    import inspect
    import json
    from pathlib import Path

    if family not in TINY_WRAPPERS or not TINY_WRAPPERS[family].config_class.startswith("Qwen3_5"):
        raise ValueError(f"save_vlm makes a processor for the Qwen3.5 wrappers only, not {family!r}.")
    folder = Path(path)
    model = build_vlm(family, seed)
    model.save_pretrained(folder)
    qwen_processor().save_pretrained(folder)
    source = inspect.getsource(ImageOnlyQwen3VLProcessor)
    (folder / f"{PROCESSOR_MODULE}.py").write_text(f"import transformers\n\n\n{source}", encoding="utf-8")
    config_path = folder / "processor_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoProcessor": f"{PROCESSOR_MODULE}.{ImageOnlyQwen3VLProcessor.__name__}"}
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return model


def _naflex(images: list[Image.Image]) -> tuple[dict, list[int]]:
    """SigLIP2's NaFlex layout (LFM2-VL): one row of patches per image, padded to the longest, with its patch grid
    and mask; the projector merges 2 x 2 patches into a token."""
    grids = [_array(image, PATCH * MERGE) for image in images]
    rows = [g.reshape(g.shape[0] // PATCH, PATCH, g.shape[1] // PATCH, PATCH, 3).transpose(0, 2, 1, 3, 4)
            .reshape(-1, PATCH * PATCH * 3) for g in grids]
    longest = max(len(r) for r in rows)
    pixel_values = torch.zeros(len(rows), longest, PATCH * PATCH * 3)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        pixel_values[i, : len(r)], mask[i, : len(r)] = torch.from_numpy(r), 1
    shapes = torch.tensor([[g.shape[0] // PATCH, g.shape[1] // PATCH] for g in grids])
    inputs = dict(pixel_values=pixel_values, spatial_shapes=shapes, pixel_attention_mask=mask)
    return inputs, (shapes.prod(-1) // MERGE**2).tolist()


def _patches(image: Image.Image, side: int) -> tuple[np.ndarray, int, int]:
    """``[h * w, side, side, 3]`` square patches of ``image`` in raster order, and the grid ``h, w``."""
    pixels = _array(image, side)
    h, w = pixels.shape[0] // side, pixels.shape[1] // side
    return pixels.reshape(h, side, w, side, 3).transpose(0, 2, 1, 3, 4).reshape(h * w, side, side, 3), h, w


def _packed_hw(images: list[Image.Image]) -> tuple[dict, list[int]]:
    """RADIO's packed layout (Nemotron-H Omni): every image's flattened patches, with each image's patch grid; its
    pixel shuffle makes a token of 2 x 2 patches."""
    pieces = [_patches(image, PATCH) for image in images]
    for p, h, w in pieces:
        assert h % MERGE == 0 and w % MERGE == 0, "the tiny tower needs an even patch grid"
    pixel_values = torch.from_numpy(np.concatenate([p.transpose(0, 3, 1, 2).reshape(len(p), -1) for p, _, _ in pieces]))
    grid = torch.tensor([[h, w] for _, h, w in pieces])
    return dict(pixel_values=pixel_values, image_grid_hw=grid), (grid.prod(-1) // MERGE**2).tolist()


def _inkling(images: list[Image.Image]) -> tuple[dict, list[int]]:
    """Inkling's layout: one ``[2, PATCH, PATCH, 3]`` patch (the frame twice) per placeholder token."""
    pieces = [_patches(image, PATCH)[0] for image in images]
    pixel_values = torch.from_numpy(np.concatenate([np.stack([p, p], axis=1) for p in pieces]))
    return dict(pixel_values=pixel_values), [len(p) for p in pieces]


def _inkling2(images: list[Image.Image]) -> tuple[dict, list[int]]:
    """Inkling 2's layout: one ``[PATCH * 2, PATCH * 2, 3]`` block of 2 x 2 patches per placeholder token, with each
    image's grid counted in tokens."""
    pieces = [_patches(image, PATCH * MERGE) for image in images]
    pixel_values = torch.from_numpy(np.concatenate([p for p, _, _ in pieces]))
    grid = torch.tensor([[1, h, w] for _, h, w in pieces])
    return dict(pixel_values=pixel_values, image_grid_thw=grid), grid.prod(-1).tolist()


_LAYOUTS = {"qwen": _qwen, "naflex": _naflex, "packed_hw": _packed_hw, "inkling": _inkling, "inkling2": _inkling2}


def image_inputs(family: str, images: list[Image.Image]) -> tuple[dict, list[int]]:
    """The pixel inputs of ``images`` for the tiny ``family`` wrapper (tensors, as its processor returns them) and
    the placeholder tokens each image takes."""
    return _LAYOUTS[TINY_WRAPPERS[family].layout](images)


def vlm_inputs(family: str, parts: list) -> dict:
    """``generate()`` inputs of one prompt made of ``parts`` (``str``: text, byte-tokenized; a list of ints: token
    ids as they are; ``PIL.Image``: an image, its placeholder tokens between the family's delimiters): ``input_ids``
    ``[1, T]``, the pixel inputs, and ``mm_token_type_ids`` (1 on image placeholders) for the families that read
    them."""
    tokenizer = byte_tokenizer()
    images = [part for part in parts if isinstance(part, Image.Image)]
    pixels, counts = image_inputs(family, images) if images else ({}, [])
    start, end = TINY_WRAPPERS[family].wrap or (None, None)
    ids, counts = [], iter(counts)
    for part in parts:
        if isinstance(part, str):
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
        elif isinstance(part, list):
            ids += part
        else:
            ids += [t for t in (start, *[IMAGE] * next(counts), end) if t is not None]
    input_ids = torch.tensor([ids])
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **pixels)
    if TINY_WRAPPERS[family].config_class.startswith("Qwen3_5"):
        inputs["mm_token_type_ids"] = (input_ids == IMAGE).int()
    return inputs


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower of a wrapper (what a hit on an image's prefix must not run)."""
    inner = getattr(model, "model", model)
    for name in ("visual", "vision_tower", "vision_model"):
        if isinstance(getattr(inner, name, None), torch.nn.Module):
            return getattr(inner, name)
    raise ValueError(f"{type(model).__name__} has no vision tower this module knows of.")
