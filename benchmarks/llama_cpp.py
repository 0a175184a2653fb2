"""llama.cpp's ``llama-server`` as a peer on the same weights, for ``benchmarks/vs_llama_cpp.py``.

- **Sources and build**: the llama.cpp sources ship inside the ``llama-cpp-python`` sdist on PyPI (``pip download
  --no-deps --no-binary :all: llama-cpp-python``, then ``vendor/llama.cpp``); ``llama-server`` is built for CPU with
  ``cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release`` and ``cmake --build build --target llama-server``
  (about 25 minutes on two cores).
- **A tokenizer the converter takes for a Jamba without ``tokenizer.model``**: Llama-style (BPE with byte fallback,
  no merges, the Llama decoder): ids 0-2 ``<unk> <s> </s>``, every other id one letter (CJK ideographs first), so a
  text is its ids one character per token in both servers and a reply's text gives back its ids. Ids 3-5 are the chat
  template's role markers; the benchmark's texts are drawn from the ids after them.
- **Two config details**: ``num_experts_per_tok`` is saved as 1 when the model has one expert (transformers ignores
  it with a dense MLP; llama.cpp refuses a value above the expert count), and the LM head's rows of the special ids
  are zeroed, so greedy decoding never picks ``</s>`` and both servers generate exactly ``max_tokens``.
- **Conversion**: ``convert_hf_to_gguf.py DIR --outtype f32`` from the same sources, with their ``gguf-py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import unicodedata
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
NUM_MARKERS = 3  # the chat template's role markers: ids 3, 4, 5
#: ``$XDG_CACHE_HOME/hf_hybridcache/llama.cpp``: where the sdist is unpacked and built unless told otherwise.
DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_hybridcache" / "llama.cpp"


def letters(count: int) -> list[str]:
    """``count`` distinct one-character tokens: letters (Unicode ``Lo``) from U+4E00 on that NFKC leaves as they are."""
    found, code = [], 0x4E00
    while len(found) < count:
        char = chr(code)
        if unicodedata.category(char) == "Lo" and unicodedata.normalize("NFKC", char) == char:
            found.append(char)
        code += 1
    return found


def chat_template(markers: list[str]) -> str:
    """A template that writes each message as its role's marker (system, user, assistant) and its content."""
    system, user, assistant = markers
    return ("{% for message in messages %}{% if message['role'] == 'system' %}" + system
            + "{% elif message['role'] == 'user' %}" + user + "{% else %}" + assistant
            + "{% endif %}{{ message['content'] }}{% endfor %}{% if add_generation_prompt %}" + assistant
            + "{% endif %}")


def letter_tokenizer(vocab_size: int):
    """The Llama-style tokenizer of ``vocab_size`` ids described above (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = letters(vocab_size - len(SPECIAL_TOKENS))
    vocab = {**{token: i for i, token in enumerate(SPECIAL_TOKENS)},
             **{char: i for i, char in enumerate(chars, len(SPECIAL_TOKENS))}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = chat_template(chars[:NUM_MARKERS])
    return tokenizer


def text_alphabet(tokenizer) -> list[str]:
    """The characters the benchmark's texts are drawn from: every token after the specials and the role markers."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    return [by_id[i] for i in range(len(SPECIAL_TOKENS) + NUM_MARKERS, len(by_id))]


def save_for_gguf(model, path: str | Path) -> None:
    """Save ``model`` (fp32 Jamba) with :func:`letter_tokenizer` and the two config details, for both servers.

    Raises:
        ValueError: the model's vocabulary is too small for the specials, the markers and a text alphabet.
    """
    vocab_size = model.config.vocab_size
    if vocab_size < len(SPECIAL_TOKENS) + NUM_MARKERS + 16:
        raise ValueError(f"A vocabulary of {vocab_size} ids leaves no text alphabet; use a model with 22 ids or more.")
    if getattr(model.config, "num_experts", None) == 1:
        model.config.num_experts_per_tok = 1
    with torch.no_grad():
        model.get_output_embeddings().weight[: len(SPECIAL_TOKENS)] = 0
    model.save_pretrained(path)
    letter_tokenizer(vocab_size).save_pretrained(path)
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=False, add_eos_token=False)  # neither server adds a BOS the other does not
    config_path.write_text(json.dumps(config, indent=2))


def sources(directory: str | Path = DEFAULT_DIR) -> Path:
    """The llama.cpp sources in ``directory``, downloaded from the ``llama-cpp-python`` sdist on PyPI when absent."""
    directory = Path(directory)
    found = sorted(directory.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "llama-cpp-python",
                    "-d", str(directory)], check=True)
    archive = max(directory.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")
    return sources(directory)


def sources_of(binary: str | Path) -> Path | None:
    """The llama.cpp sources ``binary`` was built in (``SOURCES/build/bin/llama-server``), when they are there."""
    source_dir = Path(binary).resolve().parents[2]
    return source_dir if (source_dir / "convert_hf_to_gguf.py").exists() else None


def build_llama_server(source_dir: Path, log=None) -> Path:
    """``build/bin/llama-server`` under ``source_dir``, built for CPU (CURL off, Release, 2 jobs) when absent."""
    binary = source_dir / "build" / "bin" / "llama-server"
    if not binary.exists():
        configure = ["cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
        build = ["cmake", "--build", "build", "-j2", "--target", "llama-server"]
        for command in (configure, build):
            subprocess.run(["nice", "-n", "19", *command], cwd=source_dir, check=True, stdout=log, stderr=log)
    return binary


def convert(source_dir: Path, model_dir: str | Path, out: str | Path, log=None) -> Path:
    """Convert the saved model in ``model_dir`` to a GGUF f32 file ``out`` with the sources' converter (``--no-mtp``
    for a Qwen3.5 / Qwen3-Next config without MTP layers, which the converter otherwise asserts it has)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source_dir / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    config = json.loads((Path(model_dir) / "config.json").read_text())
    no_mtp = config.get("model_type", "").startswith(("qwen3_5", "qwen3_next")) and not config.get(
        "mtp_num_hidden_layers")
    subprocess.run([sys.executable, str(source_dir / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
                    "--outfile", str(out), *(["--no-mtp"] if no_mtp else [])], check=True, env=env, stdout=log,
                   stderr=log)
    return Path(out)


def llama_server_command(binary: str | Path, gguf: str | Path, port: int, parallel: int, threads: int = 2,
                         context_per_slot: int = 4096) -> list[str]:
    """``llama-server`` on ``gguf`` with ``parallel`` slots of ``context_per_slot`` tokens each and ``threads``
    threads; prompt cache, ``--cache-ram`` and context checkpoints as shipped."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
            "-c", str(context_per_slot * parallel), "-t", str(threads), "--alias", "bench"]
