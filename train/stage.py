"""Bookkeeping shared by the stages: settings pinned per output folder, completion markers, atomic writes.

Each stage writes into its own folder under the run's --out. `begin` records the recipe settings the stage depends
on; a later run into the same folder with different settings is refused (naming the keys), because resuming or
skipping would silently mix two recipes. `DONE.json` is written last, so a stage is complete exactly when it exists.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


class StageMismatchError(RuntimeError):
    pass


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a serving engine may read it as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path, validate):
    """`validate(json.load(path))`, with every error (bad JSON or invalid content) naming the file."""
    with open(path) as handle:
        try:
            obj = json.load(handle)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
    try:
        return validate(obj)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _flatten(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): obj}


def begin(stage_dir: Path, settings: dict, is_main: bool = True) -> None:
    """Pin `settings` to `stage_dir` (first run) or check they match what the folder was made with."""
    path = Path(stage_dir) / "settings.json"
    if path.is_file():
        old, new = _flatten(json.loads(path.read_text())), _flatten(json.loads(json.dumps(settings)))
        diff = [f"{k}: {old.get(k)!r} in the folder, {new.get(k)!r} now" for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k)]
        if diff:
            raise StageMismatchError(
                f"{stage_dir} was made with other settings:\n  " + "\n  ".join(diff)
                + f"\nUse another --out, or delete {stage_dir} to rebuild it."
            )
    elif is_main:
        atomic_write_json(path, settings)


def is_done(stage_dir: Path) -> bool:
    return (Path(stage_dir) / "DONE.json").is_file()


def mark_done(stage_dir: Path, stats: dict) -> None:
    atomic_write_json(Path(stage_dir) / "DONE.json", stats)


def throughput(tokens: float, seconds: float) -> dict:
    """The timing fields every stage records in DONE.json."""
    return {"seconds": round(seconds, 2), "tokens_this_run": int(tokens),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0}


def throughput_line(stats: dict) -> str:
    return (f"this run: {stats['tokens_this_run']} tokens in {stats['seconds']:.1f} s "
            f"({stats['tokens_per_s']} tok/s)")


def read_done(stage_dir: Path) -> dict:
    return json.loads((Path(stage_dir) / "DONE.json").read_text())
