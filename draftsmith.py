"""`draftsmith`: the one command the package installs, over the three command lines it runs.

    draftsmith train --recipe dspark_smollm2_135m --set data.num_prompts=64   # = python train/main.py ...
    torchrun --nproc_per_node 2 -m draftsmith train --recipe dspark_smollm2_135m
    draftsmith eval --draft runs/dspark_smollm2_135m/train/final              # = python eval.py ...
    draftsmith export --checkpoint runs/x/train/final --to sglang --out exports/x   # = python export/main.py ...
    draftsmith recipes [--keys [SECTION]] [--markdown]

Each subcommand hands the rest of the command line, untouched, to the same `main` that `train/main.py` (the driver,
pipeline.py), `eval.py` and `export/main.py` run, so both spellings take the same flags and give the same help and
exit codes. This module sits beside those scripts, in the top layer (tests/test_layout.py: the command may import
them, nothing imports it), and imports them only when their subcommand runs, so that `draftsmith --help` answers at
once.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # an installed console script starts from its own bin/ folder
    sys.path.insert(0, str(ROOT))

from core.recipe import RECIPES_DIR, list_recipes, recipe_keys  # noqa: E402

#: subcommand -> (what it does, the script it is); the order `draftsmith --help` lists them in
COMMANDS = {
    "train": ("run a recipe's stages: regenerate, cache, train, opd, eval, export", "train/main.py"),
    "eval": ("measure a draft's accept length in the lossless loop, beside prompt lookup", "eval.py"),
    "export": ("write a trained draft as an SGLang or vLLM serving checkpoint", "export/main.py"),
    "recipes": ("list the recipes, or (--keys) every recipe key with its type, default, bound and doc", None),
}


def _parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<8} {what}" + (f" (= python {script} ...)" if script else "")
             for name, (what, script) in COMMANDS.items()]
    return argparse.ArgumentParser(
        prog="draftsmith", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="draftsmith {train,eval,export,recipes} [ARGS ...]",
        description="Train speculative-decoding drafters (DFlash, DSpark, DFlash2, Eagle3) for a target LLM, measure them "
                    "beside prompt lookup, export them for SGLang and vLLM.\n\ncommands:\n" + "\n".join(lines),
        epilog="`draftsmith COMMAND --help` shows a command's flags. Several ranks: torchrun --nproc_per_node N -m "
               "draftsmith train --recipe NAME (from the repository root).")


def recipe_summary(name: str, width: int = 100) -> str:
    """A recipe's one-line description: the first sentence of the comment that opens its file."""
    lines = (RECIPES_DIR / f"{name}.yaml").read_text().splitlines()
    opening = " ".join(line[1:].strip() for line in itertools.takewhile(lambda l: l.startswith("#"), lines))
    sentence = opening.split(". ")[0].split("   ")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: width - 3].rsplit(" ", 1)[0] + " ..."


def keys_table(rows: list[dict]) -> str:
    """The key table in Markdown, one row a key (recipes/KEYS.md is this, for every key)."""
    lines = ["| key | type | default | bound | what |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        default = yaml.safe_dump(row["default"], default_flow_style=True, width=10_000).strip().removesuffix("...")
        lines.append(f"| `{row['key']}` | {row['type']} | `{default.strip()}` | {row['bound']} | "
                     f"{row['doc'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def run_recipes(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith recipes", description="List the recipes in recipes/ with "
                                     "their one-line descriptions, or every recipe key (--keys).")
    parser.add_argument("--keys", nargs="?", const="", default=None, metavar="SECTION",
                        help="list every recipe key (or one section's: train, loss, ...) with its type, default, "
                             "bound and doc, from the schema in core/recipe.py")
    parser.add_argument("--markdown", action="store_true", help="with --keys: the Markdown table (recipes/KEYS.md)")
    args = parser.parse_args(argv)
    if args.markdown and args.keys is None:  # else the plain list, as if --markdown had done what it says
        parser.error("--markdown formats the key table: give it with --keys (draftsmith recipes --keys --markdown)")
    if args.keys is None:
        names = list_recipes()
        width = max(map(len, names))
        print("\n".join(f"{name:<{width}}  {recipe_summary(name)}" for name in names))
        return 0
    rows = [row for row in recipe_keys() if row["key"].startswith(args.keys)]
    if not rows:
        sections = sorted({row["key"].split(".")[0] for row in recipe_keys() if "." in row["key"]})
        print(f"error: no recipe key starts with {args.keys!r}; sections: {', '.join(sections)}", file=sys.stderr)
        return 2
    if args.markdown:
        print(keys_table(rows), end="")
        return 0
    width = max(len(row["key"]) for row in rows)
    for row in rows:
        bound = f"; {row['bound']}" if row["bound"] else ""
        print(f"{row['key']:<{width}}  {row['type']} = {row['default']!r}{bound}\n{'':<{width}}  {row['doc']}")
    return 0


def _script_main(command: str):
    """The `main` of the script a subcommand is (imported only now: torch and the models load with it)."""
    if command == "train":
        from pipeline import main
        return main
    if command == "export":
        from export.main import main
        return main
    # eval.py sits beside the eval package, so it has no importable name of its own: it is loaded from its file
    path = ROOT / "eval.py"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: `draftsmith eval` runs eval.py from a source checkout "
                         f"(pip install -e .)")
    spec = importlib.util.spec_from_file_location("eval_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    if command == "recipes":
        return run_recipes(rest)
    # each script names its program in its usage and errors (its own file's name run alone): told the subcommand's
    return _script_main(command)(rest, prog=f"draftsmith {command}")


if __name__ == "__main__":
    sys.exit(main())
