"""Cross-request prefix caching for hybrid attention + Mamba models in Hugging Face transformers."""

from ._compat import CACHE_KWARG
from ._version import __version__
from .cache import HybridPrefixCache
from .config import DEFAULT_MAX_CACHE_BYTES
from .core import HitReport
from .models import supported_model_types
from .sizing import CacheSizes, sizes
from .stats import PrefixCacheStats

__all__ = [
    "CACHE_KWARG",
    "CacheSizes",
    "DEFAULT_MAX_CACHE_BYTES",
    "HitReport",
    "HybridPrefixCache",
    "PrefixCacheStats",
    "__version__",
    "sizes",
    "supported_model_types",
]
