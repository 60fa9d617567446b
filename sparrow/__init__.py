"""sparrow: CPU inference for Qwen-family models with block-sparse top-k attention."""

from .api import LLM, load
from .errors import SparrowError

__all__ = ["LLM", "load", "SparrowError"]
__version__ = "0.1.0"
