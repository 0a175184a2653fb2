"""An OpenAI-compatible server for hybrid models on the continuous-batching engine with prefix reuse::

    python -m hf_hybridcache.serve --model toy:jamba --port 8000

Parts: ``loading`` (model and tokenizer; a vision-language wrapper and its processor), ``prompts`` (chat prompts whose
next turn hits on the reply), ``images`` (image parts made into images, within their limits), ``image_chat`` (chats
with images: the processor's prompt ids and pixel inputs), ``text`` (detokenizing and stop strings), ``backends`` (the
engine, or plain sequential ``generate()``), ``choices`` (one request's choices), ``completions``
(``/v1/completions``' prompts, refused fields and payloads), ``logprobs`` (OpenAI's logprobs shapes), ``metrics``
(Prometheus), ``schema`` (requests and errors), ``app`` (the routes), ``health`` (what a gateway reads: probes, server
and model info, load), ``lifecycle`` (loading, draining on SIGTERM), ``reply_tier`` (reply token ids shared by
replicas through the tier) and ``__main__`` (the command).
"""

from .app import build_app
from .backends import EngineBackend, SequentialBackend
from .image_chat import ImageChat, image_prompt
from .images import ImageLimits
from .prompts import ReplyMemory, chat_prompt_ids

__all__ = ["EngineBackend", "ImageChat", "ImageLimits", "ReplyMemory", "SequentialBackend", "build_app",
           "chat_prompt_ids", "image_prompt"]
