"""The stage protocol every stage follows (regenerate, cache, train, eval, export): pin, skip when done, mark done.

Each stage writes into its own folder under the run's --out:

    done = stage.start(folder, settings, "cache", dist.is_main)   # pins settings.json, or checks them
    if done is not None:
        return done                                               # complete: skip, return its DONE.json
    ...                                                           # the work (itself resumable)
    stage.mark_done(folder, stats, outputs=["records.jsonl"])     # DONE.json, written last, with each output's
                                                                  # size and sha256
    stage.verify_outputs(folder)                                  # a later stage, before it reads them

`settings` are the recipe values (and input digests) the folder's content depends on. A later run into the same
folder with other settings is refused, naming the keys, because resuming or skipping would silently mix two
recipes; stages that only derive a report from what they pin (eval, export) run again instead
(`on_change="rerun"`). DONE.json is written last and atomically, so a stage is complete exactly when it exists.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from core.io import (CHECKSUMS_NAME, LinkedPathError, atomic_write_bytes, atomic_write_json, link_problem, links_under,
                     own_file, read_json, sha256_file, verify_checksums)
from core.recipe import recipe_keys

# each stage's folder under a run's --out, in pipeline order (regenerate, cache, train, opd, eval, export)
STAGE_DIRS = ("regen", "cache", "train", "opd", "eval", "export")
SETTINGS_NAME = "settings.json"
DONE_NAME = "DONE.json"
# A folder is a DraftSmith stage folder by this marker only (never by a generic name like settings.json): a rerun
# sweeps its writers' temporaries there and nowhere else.
MARKER_NAME = ".draftsmith-stage"
_MARKER = b"DraftSmith stage folder: a rerun removes the temporaries its writers left in here\n"


class StageMismatchError(RuntimeError):
    pass


class DamagedOutputError(StageMismatchError):
    """A finished stage's output differs from what the stage recorded when it finished (cut, edited, removed)."""


def _flatten(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): obj}


def is_ours(stage_dir: Path) -> bool:
    """Whether `stage_dir` is a stage folder DraftSmith made: a real folder holding its marker (a regular file)."""
    marker = Path(stage_dir) / MARKER_NAME
    try:
        return not Path(stage_dir).is_symlink() and own_file(marker) and marker.read_bytes() == _MARKER
    except LinkedPathError:
        return False


def refuse_links(stage_dir: Path) -> None:
    """A stage folder holds only what DraftSmith wrote: a link in it (or the folder itself a link) would have the stage
    read back someone else's file as its own state, or write through it. Refused before the stage reads or writes,
    naming every link."""
    links = links_under(stage_dir)
    if links:
        shown = "\n  ".join(link_problem(link) for link in links[:10])
        more = f"\n  and {len(links) - 10} more" if len(links) > 10 else ""
        raise LinkedPathError(f"{stage_dir} holds {len(links)} symbolic link(s) it did not make:\n  {shown}{more}")


def pinned(stage_dir: Path) -> dict:
    """The settings pinned to `stage_dir` ({} when none are yet)."""
    path = Path(stage_dir) / SETTINGS_NAME
    return read_json(path) if own_file(path) else {}


def _changes(stage_dir: Path, settings: dict, noted: frozenset = frozenset()) -> dict[str, str]:
    """{dotted key: what differs} between `settings` and the ones pinned to `stage_dir` (nothing pinned: nothing).
    A key in `noted` (the stage's notes) says what its absence from a folder means, so it always counts."""
    if not own_file(Path(stage_dir) / SETTINGS_NAME):
        return {}
    old, new = _flatten(pinned(stage_dir)), _flatten(json.loads(json.dumps(settings)))
    defaults = _recipe_defaults()
    added_at_default = {k for k in set(new) - set(old) - noted if new[k] == defaults.get(k, _NO_DEFAULT)}
    return {k: f"{k}: {old.get(k)!r} in the folder, {new.get(k)!r} now" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and k not in added_at_default}


_NO_DEFAULT = object()


@functools.cache  # the schema is fixed for the process: walked once, not per key and folder
def _recipe_defaults() -> dict:
    """{dotted recipe key: its default, as JSON reads it back}. A key pinned now but absent from a folder was added to
    DraftSmith after the folder was made; at its default it matches, since a new key's default keeps what runs did
    before it existed (core/schema.py): an upgrade does not strand a half-trained run. A key whose default changed
    after it was added (cache.encoding) carries a stage note, and a note keeps the key counted."""
    return {row["key"]: json.loads(json.dumps(row["default"], default=str))
            for row in recipe_keys() if "[]" not in row["key"]}


def begin(stage_dir: Path, settings: dict, is_main: bool = True, notes: dict[str, str] | None = None) -> None:
    """Pin `settings` to `stage_dir` (first run) or check they match what the folder was made with. `notes`: a
    sentence per (dotted) key, added to the refusal when that key differs (what a digest's change means)."""
    refuse_links(stage_dir)
    _check_and_pin(stage_dir, settings, is_main, notes)


def _check_and_pin(stage_dir: Path, settings: dict, is_main: bool, notes: dict[str, str] | None) -> None:
    """`begin` on a folder already checked for links."""
    diff = _changes(stage_dir, settings, frozenset(notes or ()))
    if diff:
        explained = [note for key, note in (notes or {}).items() if key in diff]
        raise StageMismatchError(
            f"{stage_dir} was made with other settings:\n  " + "\n  ".join(diff.values())
            + "".join(f"\n{note}" for note in explained)
            + f"\nUse another --out, or delete {stage_dir} to rebuild it."
        )
    if is_main and not own_file(Path(stage_dir) / SETTINGS_NAME):
        _pin(stage_dir, settings)


def _pin(stage_dir: Path, settings: dict) -> None:
    """settings.json, after the marker that makes the folder DraftSmith's (a crash between them leaves a marked
    folder with nothing pinned, which the rerun pins)."""
    if not is_ours(stage_dir):
        atomic_write_bytes(Path(stage_dir) / MARKER_NAME, _MARKER)
    atomic_write_json(Path(stage_dir) / SETTINGS_NAME, settings)


def start(stage_dir: Path, settings: dict, name: str, is_main: bool = True, on_change: str = "refuse",
          notes: dict[str, str] | None = None) -> dict | None:
    """`begin`, then the stage's DONE.json contents when it is already complete (the caller skips), else None.

    on_change="rerun" (stages that only derive a report from inputs they pin, like eval and export): other settings
    than the folder's unpin it and run the stage again instead of refusing; nothing costly is lost."""
    if on_change not in ("refuse", "rerun"):
        raise ValueError(f"on_change must be 'refuse' or 'rerun', got {on_change!r}")
    refuse_links(stage_dir)
    diff = _changes(stage_dir, settings) if on_change == "rerun" else {}
    if diff and is_main:
        print(f"[{name}] {stage_dir} was made with other settings; running it again:\n  "
              + "\n  ".join(diff.values()), flush=True)
        (Path(stage_dir) / DONE_NAME).unlink(missing_ok=True)  # first: a crash from here on leaves it not done
        _pin(stage_dir, settings)
    _check_and_pin(stage_dir, settings, is_main, notes)
    if not is_done(stage_dir):
        return None
    if is_main:
        print(f"[{name}] {stage_dir} is complete; skipping", flush=True)
    return read_done(stage_dir)


def is_done(stage_dir: Path) -> bool:
    """Whether the stage finished: its DONE.json, a regular file (a link there is not the stage's, and `begin`
    refuses it)."""
    done = Path(stage_dir) / DONE_NAME
    return done.is_file() and not done.is_symlink()


OUTPUTS_KEY = "outputs"  # DONE.json: {file name: {"bytes": n, "sha256": hex}} of what later stages read


def mark_done(stage_dir: Path, stats: dict, outputs=()) -> None:
    """Write DONE.json: the stage is complete. `outputs`: the files (relative to `stage_dir`) later stages read,
    recorded by size and sha256 so that damage done after the stage finished is refused, not used."""
    stage_dir = Path(stage_dir)
    recorded = {name: {"bytes": (stage_dir / name).stat().st_size, "sha256": sha256_file(stage_dir / name)}
                for name in outputs}
    atomic_write_json(stage_dir / DONE_NAME, {**stats, OUTPUTS_KEY: recorded} if recorded else stats)


def verify_outputs(stage_dir: Path) -> dict[str, str]:
    """Before a later stage reads a finished stage's outputs: each must be as that stage recorded it when it
    finished; DamagedOutputError names the first file that is missing, cut or changed (a DONE.json written before
    outputs were recorded is not checked). Returns {file name: sha256} of what was verified, so a reader that pins
    a digest need not hash the file again."""
    stage_dir = Path(stage_dir)
    recorded = read_done(stage_dir).get(OUTPUTS_KEY, {})
    for name, was in recorded.items():
        path = stage_dir / name
        if not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != was["bytes"]:
            problem = f"is {path.stat().st_size} bytes, {was['bytes']} when its stage finished (cut or appended to)"
        elif sha256_file(path) != was["sha256"]:
            problem = "is damaged: its sha256 differs from the one its stage recorded when it finished"
        else:
            continue
        raise DamagedOutputError(f"{path} {problem} ({stage_dir / DONE_NAME}): refusing to read it. "
                                 f"Restore the file, or delete {stage_dir} to make it again")
    return {name: was["sha256"] for name, was in recorded.items()}


RUN_RECIPE_NAME = "recipe.yaml"  # what a run last started with, beside its stage folders (pipeline.py writes it)
RUN_LOCK_NAME = ".draftsmith.lock"  # the run's lock (pipeline.py)


def enclosing_run(path) -> Path | None:
    """The run folder `path` is or lies in (resolved: `..` and links followed), found by what the pipeline leaves
    there, never by a folder's name: a stage folder (its marker), or a folder holding the run's recipe.yaml with
    the run's lock or a stage folder beside it (a user's own recipe.yaml alone is not a run). None outside runs."""
    path = Path(path).resolve()
    for folder in (path, *path.parents):
        if is_ours(folder):
            return folder.parent
        if os.path.isfile(folder / RUN_RECIPE_NAME) and (
                os.path.isfile(folder / RUN_LOCK_NAME) or any(is_ours(folder / d) for d in STAGE_DIRS)):
            return folder
    return None


def verify_published(folder: Path) -> None:
    """Before a draft folder is read: its files as its checksums.json lists them (core/io.verify_checksums). Where a
    finished stage published the folder (train/final, opd/final), that stage's DONE.json records the checksums.json
    itself, so a deleted or edited one is refused too, not taken for a folder written before checksums existed. A
    draft a stage published (its folder's parent is a marked stage folder) is always checksummed: without
    checksums.json it is refused even when DONE.json's record of it was stripped too (or DONE.json deleted), since
    nothing else could tell damaged weights from sound ones. A checkpoint's draft is covered by its checkpoint's."""
    folder = Path(folder)
    recorded = f"{folder.name}/{CHECKSUMS_NAME}"
    published = is_done(folder.parent) and recorded in read_done(folder.parent).get(OUTPUTS_KEY, {})
    if published:
        verify_outputs(folder.parent)
    verify_checksums(folder, required=published or is_ours(folder.parent))


def read_done(stage_dir: Path) -> dict:
    return read_json(Path(stage_dir) / DONE_NAME)


def throughput(tokens: float, seconds: float) -> dict:
    """The timing fields every stage records in DONE.json."""
    return {"seconds": round(seconds, 2), "tokens_this_run": int(tokens),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0}


def throughput_line(stats: dict) -> str:
    return (f"this run: {stats['tokens_this_run']} tokens in {stats['seconds']:.1f} s "
            f"({stats['tokens_per_s']} tok/s)")
