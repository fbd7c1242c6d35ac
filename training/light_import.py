"""Import modules of openjet_plugin without running the package's __init__.

The GPU machine has torch but not gguf or cffi, which the package __init__ (the engine) imports;
config.py and tokenizer.py themselves need only the standard library. Where the package imports
normally we use it as is.
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import types

REPO = pathlib.Path(__file__).resolve().parent.parent


def openjet_module(name: str):
    """`openjet_module("config")` -> the module openjet_plugin.config."""
    try:
        return importlib.import_module(f"openjet_plugin.{name}")
    except ImportError:
        for mod in [m for m in sys.modules if m == "openjet_plugin" or m.startswith("openjet_plugin.")]:
            del sys.modules[mod]
        pkg = types.ModuleType("openjet_plugin")
        pkg.__path__ = [str(REPO / "openjet_plugin")]
        sys.modules["openjet_plugin"] = pkg
        return importlib.import_module(f"openjet_plugin.{name}")


def model_config(preset: str):
    config = openjet_module("config")
    if preset not in config.PRESETS:
        raise KeyError(f"preset {preset!r} is not in openjet_plugin/config.py PRESETS "
                       f"(have: {', '.join(config.PRESETS)})")
    return config.PRESETS[preset]
