#!/usr/bin/env python3
"""Retrain the generated test models' BPE vocabulary on this Python's standard library.

Writes openjet_plugin/data/bpe_vocab.json (or --out). Deterministic for a given Python
installation; the shipped file records the Python version and a hash of the text it learned from.
"""

import sys

from openjet_plugin.testing.bpe import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
