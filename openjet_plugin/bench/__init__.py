"""`openjet bench`: our engine against llama.cpp and the card's bandwidth roofline, with a manifest
and the spread of every number. See bench/README.md for what each metric means and how to run it.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .runner import main as run_main

    return run_main(argv)
