"""Cross-request prefix caching for hybrid attention + Mamba models in Hugging Face transformers."""

from .cache import HybridPrefixCache
from .stats import PrefixCacheStats
from .config import DEFAULT_MAX_CACHE_BYTES
from .models import supported_model_types

__version__ = "0.1.0"

__all__ = ["DEFAULT_MAX_CACHE_BYTES", "HybridPrefixCache", "PrefixCacheStats", "supported_model_types", "__version__"]
