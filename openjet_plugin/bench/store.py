"""The resume folder: finished measurements (raw samples) kept between runs of `openjet bench`.

`--resume DIR` makes a run idempotent: a measurement already in DIR/records.jsonl is not made
again, and the report is built from everything DIR holds. DIR/identity.json pins what the
records are comparable under (model file, GPU, settings); a run with a different identity is
refused, naming the field, rather than mixing incomparable numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .report import row_key


class ResumeMismatch(ValueError):
    pass


class Store:
    def __init__(self, root: Path, identity: dict):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.records_path = self.root / "records.jsonl"
        self.info_path = self.root / "info.json"
        ident_path = self.root / "identity.json"
        if ident_path.is_file():
            old = json.loads(ident_path.read_text())
            for k in sorted(set(old) | set(identity)):
                if old.get(k) != identity.get(k):
                    raise ResumeMismatch(
                        f"--resume {self.root}: its measurements were made with {k} = {old.get(k)!r}, "
                        f"this run has {identity.get(k)!r}; use a new folder (or the same settings)")
        else:
            _write_json(ident_path, identity)
        self.identity = identity
        self._records: dict[str, dict] = {}
        if self.records_path.is_file():
            for n, line in enumerate(self.records_path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    # a run killed mid-write leaves at most one broken last line: skip it
                    continue
                self._records[row_key(rec["metric"], rec["engine"], rec["params"])] = rec
        self.info: dict = json.loads(self.info_path.read_text()) if self.info_path.is_file() else {}

    def has(self, metric: str, engine: str, params: dict) -> bool:
        return row_key(metric, engine, params) in self._records

    def add(self, metric: str, engine: str, params: dict, unit: str, samples: list[float],
            session: str) -> bool:
        """Keep a finished measurement; False (and nothing written) when it is already kept."""
        key = row_key(metric, engine, params)
        if key in self._records:
            return False
        if not samples:
            raise ValueError(f"{key}: no samples")
        rec = {"metric": metric, "engine": engine, "params": params, "unit": unit,
               "samples": [float(x) for x in samples], "session": session}
        with open(self.records_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._records[key] = rec
        return True

    def records(self) -> list[dict]:
        return list(self._records.values())

    def update_info(self, **kv) -> None:
        self.info.update(kv)
        _write_json(self.info_path, self.info)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)
