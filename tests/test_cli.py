"""The `draftsmith` console command: the entry point setup.cfg declares is draftsmith.main, each subcommand runs the
same main as its script (train/main.py, eval.py, export/main.py: the same flags, help and exit codes), and `recipes`
lists the recipes and the schema's keys."""

from __future__ import annotations

import configparser
import importlib
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from core.recipe import list_recipes, recipe_keys
from draftsmith import recipe_summary


def entry_point():
    """The function `pip install` binds to the `draftsmith` command, read from setup.cfg as pip reads it."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = dict(line.split("=", 1) for line in config["options.entry_points"]["console_scripts"].split("\n")
                   if line.strip())
    module, function = scripts["draftsmith "].strip().split(":") if "draftsmith " in scripts else (None, None)
    assert module, f"setup.cfg declares no draftsmith console script: {scripts}"
    assert module in config["options"]["py_modules"].replace(",", " ").split(), "the command's module is not installed"
    return getattr(importlib.import_module(module), function)


def test_help_names_every_command(capsys):
    assert entry_point()(["--help"]) == 0
    shown = capsys.readouterr().out
    for command, script in (("train", "train/main.py"), ("eval", "eval.py"), ("export", "export/main.py"),
                            ("recipes", "--keys")):
        assert f"  {command} " in shown and script in shown
    assert entry_point()([]) == 2  # no command: the help, and a failing exit code


def test_an_unknown_command_is_refused_naming_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        entry_point()(["trian"])
    assert exit_.value.code == 2 and "'trian'; choose from train, eval, export, recipes" in capsys.readouterr().err


@pytest.mark.parametrize("command, flag", [("train", "--stages"), ("eval", "--lookup-first"), ("export", "--sts")])
def test_each_command_is_its_script(command, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        entry_point()([command, "--help"])
    assert exit_.value.code == 0 and flag in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # a flag the script does not take: the script's own refusal
        entry_point()([command, "--no-such-flag"])
    err = capsys.readouterr().err  # in the subcommand's name (export's said export/main.py)
    assert exit_.value.code == 2 and f"usage: draftsmith {command} " in err and f"draftsmith {command}: error: " in err


def test_train_refuses_a_bad_recipe_as_train_main_does(capsys):
    assert entry_point()(["train", "--recipe", "dspark_smollm2_135m", "--set", "train.lr=-1"]) == 2
    ours = capsys.readouterr().err
    script = run_cli(["--recipe", "dspark_smollm2_135m", "--set", "train.lr=-1"])
    assert script.returncode == 2 and "train.lr must be > 0, got -1" in ours and ours.strip() in script.stderr


def test_recipes_lists_each_recipe_with_its_description(capsys):
    assert entry_point()(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list_recipes()
    default = next(line for line in lines if line.startswith("dspark_smollm2_135m "))
    assert default.split(None, 1)[1] == recipe_summary("dspark_smollm2_135m")
    assert recipe_summary("dspark_smollm2_135m").startswith("DSpark drafter for the embedded SmolLM2")


def test_recipes_keys_prints_the_schema(capsys):
    assert entry_point()(["recipes", "--keys", "train.lr"]) == 0
    assert capsys.readouterr().out.split() == ["train.lr", "float", "=", "0.0006;", ">", "0",
                                               *next(r["doc"] for r in recipe_keys() if r["key"] == "train.lr").split()]
    assert entry_point()(["recipes", "--keys", "trainer"]) == 2
    assert "no recipe key starts with 'trainer'; sections: cache, data," in capsys.readouterr().err


def test_python_m_draftsmith_answers_without_loading_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "draftsmith", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: draftsmith" in done.stdout
    assert " torch" not in done.stderr  # -X importtime lists every module imported


@pytest.mark.parametrize("flags", [["--family", "eagle3"], ["--family", "dspark"], ["--prompts", "p.jsonl"]])
def test_a_flag_the_recipe_would_override_is_refused(flags, capsys, drill):
    """`--recipe dspark_smollm2_135m --family eagle3` used to run the recipe's DSpark, the flag silently dropped."""
    drill("bad-input", f"--recipe with {' '.join(flags)}")
    for run in (entry_point(), None):
        argv = ["--recipe", "dspark_smollm2_135m", "--stages", "nosuch", *flags]  # no stage: the old run stops there
        if run is None:
            done = run_cli(argv)
            code, err = done.returncode, done.stderr
        else:
            with pytest.raises(SystemExit) as exit_:
                run(["train", *argv])
            code, err = exit_.value.code, capsys.readouterr().err
        assert code == 2 and "--target, --prompts and --family pick a generic recipe" in err, err
        assert err.startswith("usage: draftsmith train " if run else "usage: train/main.py "), err


def test_markdown_without_keys_is_refused(capsys, drill):
    """`draftsmith recipes --markdown` used to print the plain recipe list with rc 0: --markdown formats --keys."""
    drill("bad-input", "draftsmith recipes --markdown")
    with pytest.raises(SystemExit) as exit_:
        entry_point()(["recipes", "--markdown"])
    err = capsys.readouterr()
    assert exit_.value.code == 2 and "--markdown formats the key table: give it with --keys" in err.err
    assert err.out == ""
    assert entry_point()(["recipes", "--keys", "train.lr", "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("| key | type |")
