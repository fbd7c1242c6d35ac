"""openjet-plugin: an MTP speculative-decoding engine for qwen35 (Qwen3.8-27B) GGUF models,
with a llama.cpp fallback that runs everywhere.

    import openjet_plugin
    eng = openjet_plugin.load()                 # the embedded default model
    print(eng.generate("def fibonacci(n):", max_tokens=32).text)
"""

from __future__ import annotations

__version__ = "0.1.0"


def _source_tree_adapters() -> None:
    """Installed, `adapters/` is the subpackage openjet_plugin.adapters (pyproject maps it). Run from
    a source checkout on PYTHONPATH (the GPU machine's scripts do), register it under that name."""
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    src = here.parent / "adapters" / "__init__.py"
    if (here / "adapters").is_dir() or not src.is_file() or __name__ + ".adapters" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(__name__ + ".adapters", src,
                                                  submodule_search_locations=[str(src.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["adapters"] = module


_source_tree_adapters()

# The public names load on first use: `python -m openjet_plugin.setup_llama` and
# `openjet_plugin.cpu_features` run in a bare environment, before numpy and the rest are installed.
_LAZY = {"load": "engine", "Engine": "engine", "GenerationResult": "engine", "GenerationStats": "engine",
         "Chunk": "engine", "default_model_path": "defaults", "errors": None}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    module = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


__all__ = ["load", "Engine", "GenerationResult", "GenerationStats", "Chunk", "default_model_path",
           "errors", "__version__"]
