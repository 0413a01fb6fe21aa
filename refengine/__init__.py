"""refengine: a small paged-KV inference engine whose lab model reads back its KV cache.

It imports nothing of kvwatch; a probe attaches through :class:`EngineObserver`.
"""

from refengine.config import EngineConfig
from refengine.engine import Engine, StepResult
from refengine.errors import ContextLengthExceeded, InvalidRequest, PoolExhausted, RefEngineError
from refengine.hooks import EngineObserver
from refengine.pool import KVPool
from refengine.request import Completion, Request, TokenDelta
from refengine.tokenizer import BOS, EOS, PAD, PLACEHOLDER, ByteTokenizer

__version__ = "0.1.0"

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "PLACEHOLDER",
    "ByteTokenizer",
    "Completion",
    "ContextLengthExceeded",
    "Engine",
    "EngineConfig",
    "EngineObserver",
    "InvalidRequest",
    "KVPool",
    "PoolExhausted",
    "RefEngineError",
    "Request",
    "StepResult",
    "TokenDelta",
    "__version__",
]
