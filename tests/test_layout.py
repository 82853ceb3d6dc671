"""The house rules, read from the source with `ast`: imports run one way, in the order data flows.

    core/ (plumbing), modeling/  <  data/  <  train/  <  export/  <  eval/  <  the driver and the scripts

No import from a lower layer to a higher one, no import loop, no project import hidden inside a function, nobody
imports a script (but the `draftsmith` command, which hands each subcommand to its script, and the train/main.py
shim, which runs the driver), and no file over ~600 lines without a reason written at its top. The scripts (the driver
and the command lines) may import inside a function: nothing sits above them for such an import to hide, and
deferring torch and transformers to where the work starts lets --help and a bad argument answer at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

LAYERS = {"core": 0, "modeling": 1, "data": 2, "train": 3, "export": 4, "eval": 5}
# Entry points users type: pipeline.py (the driver) and the command lines; they sit above every package.
SCRIPTS = {"pipeline": "pipeline.py", "eval_cli": "eval.py", "train.main": "train/main.py",
           "export.main": "export/main.py", "draftsmith": "draftsmith.py"}
DRIVER_LAYER = len(LAYERS)
COMMAND = "draftsmith"  # the console command, beside the scripts it runs
MAX_LINES = 620  # "~600"


def _modules() -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):  # subpackages too (data/sources, data/regen, ...)
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    modules.update({name: ROOT / rel for name, rel in SCRIPTS.items()})
    return modules


def _layer(module: str) -> int:
    if module in SCRIPTS:
        return DRIVER_LAYER
    return LAYERS[module.split(".")[0]]


def _project_imports(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function or class?) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from core import stage` imports the module core.stage; `from core.io import x` the module core.io
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            if name in known or name.split(".")[0] in LAYERS or name in ("pipeline",):
                found.append((name, node.lineno, id(node) not in top_level))
    return found


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        edges[name] = _project_imports(path, set(modules))
    return modules, edges


def test_every_package_module_is_in_a_layer(graph):
    modules, _ = graph
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"} == set(LAYERS)
    assert "eval.spec_decode" in modules and "core.io" in modules


def test_imports_run_one_way(graph):
    _, edges = graph
    upward = [f"{src} -> {dst} (line {line})" for src, targets in edges.items() for dst, line, _ in targets
              if _layer(dst) > _layer(src)]
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_project_import_hidden_in_a_function(graph):
    _, edges = graph
    hidden = [f"{src} -> {dst} (line {line})" for src, targets in edges.items() for dst, line, nested in targets
              if nested and src not in SCRIPTS]
    assert hidden == [], "function-level project imports:\n" + "\n".join(hidden)


def test_nobody_imports_a_script(graph):
    _, edges = graph
    wrong = [f"{src} -> {dst}" for src, targets in edges.items() for dst, _, _ in targets
             if dst in SCRIPTS and src != COMMAND and not (src == "train.main" and dst == "pipeline")]
    assert wrong == []


def test_no_import_loop(graph):
    _, edges = graph
    graph_edges = {src: sorted({dst for dst, _, _ in targets if dst in edges and dst != src})
                   for src, targets in edges.items()}
    state, loops = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in graph_edges[node]:
            if state.get(nxt) == "open":
                loops.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in graph_edges:
        if node not in state:
            visit(node, [node])
    assert loops == [], "import loops:\n" + "\n".join(loops)


def test_the_checker_sees_a_hidden_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from core.io import read_json\n\ndef f():\n    from eval.run import run_eval\n")
    found = _project_imports(bad, {"core.io", "eval.run"})
    assert ("core.io", 1, False) in found and ("eval.run", 4, True) in found


def test_long_files_say_why():
    files = [p for p in ROOT.glob("*.py")] + [p for package in LAYERS for p in (ROOT / package).rglob("*.py")]
    files += list((ROOT / "benchmarks").glob("*.py"))
    long = []
    for path in files:
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and "600 lines" not in doc:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert long == [], "files over ~600 lines without a reason at their top:\n" + "\n".join(long)



def _benchmark_imports(path: Path, scripts: set[str]) -> list[str]:
    """Every import of a benchmark module in `path` but `from benchmarks.harness import ...`: another script
    (`import quality`, `from benchmarks import quality`) or the harness spelled another way (`import
    benchmarks.harness`, `from benchmarks import harness`, `from .harness import x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in scripts | {"benchmarks"}]
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            found += [f"benchmarks.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in scripts | {"benchmarks"}:
            found += [node.module] if node.module != "benchmarks.harness" else []
    return found


def test_benchmark_scripts_share_only_the_harness(tmp_path):
    """What the benchmark scripts share lives in benchmarks/harness.py, imported one way (`from benchmarks.harness
    import ...`); no script imports another one (quality.py is a benchmark, not a library)."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    wrong = {p.name: found for p in sorted((ROOT / "benchmarks").glob("*.py"))
             if (found := _benchmark_imports(p, scripts))}
    assert wrong == {}
    bad = tmp_path / "bad.py"
    bad.write_text("import quality\nfrom benchmarks import harness\nfrom .harness import sets\n"
                   "from benchmarks.quality import arm_ratios\nfrom benchmarks.harness import ratio\n")
    assert sorted(_benchmark_imports(bad, {"quality", "harness"})) == [
        ".harness", "benchmarks.harness", "benchmarks.quality", "quality"]


MAX_PARAMETERS = 8  # "about 8": more, and a call site cannot be read without the signature beside it
LONG_PARAMETER_LISTS_LEFT: set[str] = set()  # none left (issue 50); a new one fails below


def long_parameter_lists(packages=("train", "eval", "export"), limit=MAX_PARAMETERS) -> dict[str, int]:
    """'path:function' -> its parameter count (self and cls not counted; *args and **kwargs each one) for every
    function in `packages` with more than `limit`."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args
                    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                    count = len(named) + bool(args.vararg) + bool(args.kwarg)
                    count -= bool(named) and named[0].arg in ("self", "cls")
                    if count > limit:
                        found[f"{path.relative_to(ROOT)}:{node.name}"] = count
    return found


def test_no_new_long_parameter_list():
    found = long_parameter_lists()
    assert set(found) - LONG_PARAMETER_LISTS_LEFT == set(), f"more than {MAX_PARAMETERS} parameters: {found}"
    assert LONG_PARAMETER_LISTS_LEFT - set(found) == set(), "shortened: take it off LONG_PARAMETER_LISTS_LEFT"


if __name__ == "__main__":  # python tests/test_layout.py: the long parameter lists, longest first
    for name, count in sorted(long_parameter_lists().items(), key=lambda item: -item[1]):
        print(f"{count:3d}  {name}")
