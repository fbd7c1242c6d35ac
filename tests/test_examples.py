"""Every example in examples/ runs, as a user would run it, on the embedded default model.

Each script must exit 0 and print what it promises (the patterns below); the default model has
random weights, so the checks are about structure and numbers, not meaning. A new example without
an entry here fails test_every_example_is_checked.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

EXPECTED = {
    "langchain_agent.py": [r"step 1: \d+ prompt tokens, \d+ generated, \d+ tool calls",
                           r"\[(llama\.cpp|native), finish: (stop|length)\]", r"^answer: ['\"]"],
    "litellm_completion.py": [r"^reply: ['\"]", r"usage: prompt [1-9]\d*, completion [1-9]\d*, total [1-9]\d*",
                              r"same text as the plain call: True", r"^async reply: ['\"]"],
    "llama_cpp_dropin.py": [r"^model: openjet-[\w-]+ \(\d+ tokens, n_ctx 1024, backend (llama\.cpp|native)\)",
                            r"usage \{'prompt_tokens': \d+, 'completion_tokens': \d+, 'total_tokens': \d+\}",
                            r"stream equals completion: True", r"^grammar-constrained answer: '(yes|no)'$",
                            r"-> b'Hello, world!'$"],
    "openai_client.py": [r"^models: \['openjet-default'\]", r"^reply: ['\"]",
                         r"usage: prompt [1-9]\d*, completion [1-9]\d*, total [1-9]\d*",
                         r"same text: True", r"server stopped \(exit status 0\)"],
}
ARGS = {"openai_client.py": ["--start"]}      # start its own server instead of expecting one
# run elsewhere: the proxy test starts `openjet serve --config examples/litellm_proxy.yaml`
RUN_BY_OTHER_TESTS = {"litellm_proxy.yaml": "tests/test_litellm_proxy.py",
                      # a several-host config: litellm's own Router accepts it there
                      "cluster_router.yaml": "tests/test_cluster.py"}


def test_every_example_is_checked():
    files = {p.name for p in EXAMPLES.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert files == set(EXPECTED) | set(RUN_BY_OTHER_TESTS)
    for name, test in RUN_BY_OTHER_TESTS.items():
        assert name in (EXAMPLES.parent / test).read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name):
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *ARGS.get(name, [])], cwd=EXAMPLES.parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    for pattern in EXPECTED[name]:
        assert re.search(pattern, proc.stdout, re.M), f"{name}: no line matches {pattern!r} in\n{proc.stdout}"
