"""Writing a safetensors file atomically (a temp file beside the target, fsynced, renamed over it), with errors
that name the path the user gave, not the temp file: what ``HybridPrefixCache.save`` writes through
(:mod:`~hf_hybridcache.core.persistence`)."""

from __future__ import annotations

import os
import re

from safetensors import SafetensorError
from safetensors.torch import save_file


def write_atomically(tensors: dict, metadata: dict, path: str) -> None:
    """Write ``tensors`` (name -> contiguous tensor) and ``metadata`` (str -> str) to the safetensors file ``path``:
    to a temp file beside it, fsynced, then renamed over ``path``, so a reader never sees a half-written file.

    Raises:
        OSError: :func:`write_error`'s, naming ``path``; the temp file is removed.
    """
    tmp = f"{path}.tmp-{os.getpid()}-{id(tensors):x}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as error:
        raise write_error(path, error) from error
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_error(path: str, error: Exception) -> OSError:
    """An ``OSError`` (``PermissionError`` and the like where the errno says so) that names ``path``, not the temp file
    safetensors or we wrote, and the cause."""
    number = getattr(error, "errno", None)
    reason = getattr(error, "strerror", None) or str(error)
    if isinstance(error, SafetensorError):  # "... I/O error: <reason> (os error N) at path <temp file>"
        found = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(error))
        number, reason = (int(found[2]), found[1]) if found else (None, str(error).split(" at path ")[0])
    message = (f"The cache cannot be saved to {path!r}: {reason}. Save it to a file in a folder you can write to; "
               f"nothing was written there and the cache is unchanged.")
    return OSError(number, message) if number else OSError(message)
