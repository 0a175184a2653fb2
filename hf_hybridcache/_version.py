"""The package's version, below everything that reads it (the cache file and the tier's keys name it)."""

__version__ = "0.1.0"
