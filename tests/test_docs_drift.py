"""The docs name what exists: every script path README.md, benchmarks/README.md and the Makefile cite, every recipe key
README.md and the Makefile cite, and every prompt source (the schema's doc, README's list) is one the code has; the
recipe-key table (recipes/KEYS.md) is the one generated from the schema in core/recipe.py. Each check is shown
catching a planted stale name."""

from __future__ import annotations

import re

from conftest import ROOT
from core.recipe import SourceConfig, recipe_keys
from data.sources.registry import BUILTIN_SOURCES
from draftsmith import keys_table

DOCS = ("README.md", "benchmarks/README.md", "Makefile")
KEY_DOCS = ("README.md", "Makefile")  # benchmarks/README.md also names modules (eval.compare) the way keys look
KEYS_FILE = "recipes/KEYS.md"
PACKAGES = ("benchmarks", "tests", "train", "eval", "export", "data", "core", "modeling", "recipes")
# a path of a script or recipe under one of the project's folders, or a top-level script; not one inside a run folder
# (`runs/x/eval/sts.json` is an output, not a file of the project)
SCRIPT = re.compile(rf"(?<![\w/.-])((?:{'|'.join(PACKAGES)})/[\w/.-]*\w\.(?:py|yaml)|(?:eval|pipeline)\.py)\b")


def stale_scripts(text: str) -> list[str]:
    return sorted({path for path in SCRIPT.findall(text) if not (ROOT / path).is_file()})


def _valid_keys() -> set[str]:
    leaves = {row["key"].replace("[]", "") for row in recipe_keys()}
    return leaves | {key.rsplit(".", 1)[0] for key in leaves if "." in key}  # sections: `data.sources`, `regen`


def stale_keys(text: str) -> list[str]:
    valid = _valid_keys()
    sections = sorted({key.split(".")[0] for key in valid if "." in key})
    dotted = re.compile(rf"(?<![\w/.-])((?:{'|'.join(sections)})(?:\.[a-z_][a-z0-9_]*)+)(?![\w/-])")
    found = {name for name in dotted.findall(text) if not name.endswith(".py")}  # eval.py is a script
    return sorted(found - valid)


def readme_sources(text: str) -> set[str]:
    """The bare names in README's prompt-source list (between "mixed by `weight`:" and "any local")."""
    start = text.index("mixed by `weight`:")
    return set(re.findall(r"`([a-z0-9]+)`", text[start + len("mixed by `weight`:"): text.index("any local", start)]))


def schema_sources() -> set[str]:
    doc = next(f.metadata["doc"] for f in SourceConfig.__dataclass_fields__.values() if f.name == "name")
    return {name.strip() for name in doc.split("|") if re.fullmatch(r"[a-z0-9]+", name.strip())}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def benchmark_sections() -> set[str]:
    return {line.lstrip("#").strip() for line in (ROOT / "benchmarks/README.md").read_text().splitlines()
            if line.startswith("#")}


def stale_sections(text: str) -> list[str]:
    """Links into benchmarks/README.md (`benchmarks/README.md#anchor`, `(#anchor)` inside it) and citations of its
    sections by title (`benchmarks/README.md, "Title"`) that name no heading there."""
    sections = benchmark_sections()
    anchors = {_anchor(title) for title in sections}
    linked = set(re.findall(r"benchmarks/README\.md#([\w-]+)", text)) - anchors
    cited = {re.sub(r"[\s#]+", " ", title) for title in re.findall(r'benchmarks/README\.md,\s+"([^"]+)"', text)}
    titled = {title for title in cited if not any(heading.startswith(title) for heading in sections)}
    return sorted(linked | titled)


def test_every_benchmark_section_cited_exists():
    files = [ROOT / "README.md", *[p for folder in PACKAGES if folder != "tests" for p in (ROOT / folder).rglob("*")
                                   if p.suffix in (".py", ".yaml")]]
    stale = {str(p.relative_to(ROOT)): found for p in files if (found := stale_sections(p.read_text()))}
    inner = set(re.findall(r"\]\(#([\w-]+)\)", (ROOT / "benchmarks/README.md").read_text()))
    stale |= {"benchmarks/README.md": sorted(inner - {_anchor(t) for t in benchmark_sections()})} if inner - {
        _anchor(t) for t in benchmark_sections()} else {}
    assert stale == {}, f"benchmark sections cited but not in benchmarks/README.md: {stale}"


def test_every_script_the_docs_cite_exists():
    stale = {doc: found for doc in DOCS if (found := stale_scripts((ROOT / doc).read_text()))}
    assert stale == {}, f"scripts cited but not in the repository: {stale}"


def test_every_recipe_key_the_docs_cite_exists():
    stale = {doc: found for doc in KEY_DOCS if (found := stale_keys((ROOT / doc).read_text()))}
    assert stale == {}, f"recipe keys cited but not in core/recipe.py: {stale}"


def test_the_documented_prompt_sources_are_the_code_s():
    assert schema_sources() == set(BUILTIN_SOURCES), "core/recipe.py SourceConfig.name's doc"
    assert readme_sources((ROOT / "README.md").read_text()) == set(BUILTIN_SOURCES), "README.md's prompt sources"


def test_the_key_table_is_the_schema_s():
    assert (ROOT / KEYS_FILE).read_text() == keys_table(recipe_keys()), (
        f"{KEYS_FILE} is stale: regenerate it with `python -m draftsmith recipes --keys --markdown > {KEYS_FILE}`")


def test_every_key_has_a_doc_and_every_number_a_bound():
    rows = recipe_keys()
    assert [r["key"] for r in rows if not r["doc"]] == []
    numbers = [r["key"] for r in rows if re.search(r"\b(int|float)\b", r["type"]) and not r["bound"]]
    assert numbers == []


def test_each_check_catches_a_planted_stale_name():
    readme = (ROOT / "README.md").read_text()
    assert stale_scripts(readme + "\nrun `python benchmarks/levers.py` first\n") == ["benchmarks/levers.py"]
    assert stale_scripts("see `runs/x/eval/sts.json` and eval.py") == []  # an output path, a script that exists
    assert stale_sections('[x](benchmarks/README.md#the-overfit-gate), (benchmarks/README.md, "Loss memory")') == []
    assert stale_sections('[x](benchmarks/README.md#the-overfit-gates) (benchmarks/README.md, "Lost memory")') == [
        "Lost memory", "the-overfit-gates"]
    assert stale_sections('(benchmarks/README.md, "Hidden-state\n    # cache encoding")') == []  # a wrapped comment
    assert stale_keys(readme + "\n`--set train.max_step=10`, `loss.vocab_sise`\n") == [
        "loss.vocab_sise", "train.max_step"]
    assert stale_keys("`data.sources[0].weight`, `regen`, `data.sources`, eval.py") == []
    planted = readme.replace("`wordmath`", "`wordmaths`", 1)
    assert readme_sources(planted) == set(BUILTIN_SOURCES) - {"wordmath"} | {"wordmaths"}
