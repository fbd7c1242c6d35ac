"""openjet-plugin: an MTP speculative-decoding engine for qwen35 (Qwen3.8-27B) GGUF models,
with a llama.cpp fallback that runs everywhere.

    import openjet_plugin
    eng = openjet_plugin.load()                 # the embedded default model
    print(eng.generate("def fibonacci(n):", max_tokens=32).text)
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import errors  # noqa: E402
from .defaults import default_model_path  # noqa: E402
from .engine import Chunk, Engine, GenerationResult, GenerationStats, load  # noqa: E402

__all__ = ["load", "Engine", "GenerationResult", "GenerationStats", "Chunk", "default_model_path",
           "errors", "__version__"]
