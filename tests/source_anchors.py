"""The CPU emulations of native kernels (tests/test_*_mapping.py, test_matvec_f16_split.py)
transcribe kernel lines into Python; each pins the lines it copies, so an edit to one of them
fails its test until the emulation is updated."""
import re
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[1] / "native"


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip()


def missing_anchors(anchors: list[tuple[str, str]]) -> list[str]:
    """The (file under native/, line) pairs whose line, whitespace aside, is no longer in the file."""
    cache: dict[str, str] = {}
    missing = []
    for fname, line in anchors:
        if fname not in cache:
            cache[fname] = _norm((NATIVE / fname).read_text())
        if _norm(line) not in cache[fname]:
            missing.append(f"{fname}: {line}")
    return missing
