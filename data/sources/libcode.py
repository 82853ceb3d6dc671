"""Code prompts made from the functions of an installed Python library: a training source for code that is not an
eval source.

A third of the held-out set is code (HumanEval), while chat data holds ~3-4% code prompts and none shaped like a
function-completion request (issue 39). This source walks the Python files under a folder (the standard library of
the interpreter running DraftSmith by default) with ``ast``, never importing them, and turns every public function and
method that has a docstring into one user prompt: either a completion request showing its signature and docstring
("Complete the following Python function: ...") or an instruction made from the docstring's first sentence ("Write
a Python function that returns ..."). The target writes the code; the library's own body is never shown.

Deterministic: the same folder (the same Python version, for the standard library) gives the same prompts in the
same order, each shaped by a template picked by a hash of its qualified name; a recipe's seed then picks and orders
them like any source read whole (prompts.py). Every function whose name HumanEval uses is left out (the caller
passes those names), so that no held-out function reaches training under its own name.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from data.sources.rows import IdMaker, Prompt

__all__ = ["LibFunction", "library_functions", "library_prompts", "render_prompt"]

#: folders never walked: test suites, GUI and demo code, vendored installers, installed third-party packages
_SKIP_PARTS = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
                         "site-packages", "dist-packages"})
_MIN_WORDS = 4  # a docstring shorter than this says too little to write the function from
_MAX_DOC_CHARS = 600  # the docstring's paragraphs shown, up to this many characters (the first always)
_MAX_SENTENCE_WORDS = 40
_DECORATOR_CHARS = 40

# Imperative first words of docstrings that make "Write a Python function that <verb>s ...": the ~100 most frequent
# in the standard library's docstrings (PEP 257's "Return ...", "Get ...").
_VERBS = frozenset("""
    accept acquire add append apply arrange assert attach bind build calculate call cancel change check clean clear
    close collapse combine compare compile compress compute configure connect construct convert copy create decide
    decode decompress define delete deserialize detect determine disable discard display divide do draw dump emit
    encode ensure escape evaluate execute expand extract fetch feed fill find finish flush format generate get guess
    handle import indicate insert install interpret invoke iterate join list load lock log look make mark merge move
    normalize obtain open parse perform pop prepare print process produce push put quote read receive register release
    reload remove rename replace report represent request reset resolve retrieve return run scan schedule search
    select send serialize set skip split start stop store strip take terminate test transform translate try turn
    unregister update upgrade validate wait walk wrap write yield
""".split())


@dataclass(frozen=True)
class LibFunction:
    """A public function or method of a library file, as much of it as a prompt shows."""

    module: str  # dotted module name relative to the walked folder, e.g. "email.utils"
    cls: str | None  # the class of a method, None for a module-level function
    name: str
    header: str  # decorators and the `def` line, e.g. "@staticmethod\ndef f(x: int) -> str:"
    params: str  # the parameter list, e.g. "x: int, y=2"
    doc: str  # the docstring, cleaned (inspect.cleandoc) and cut to _MAX_DOC_CHARS at a paragraph

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.cls}.{self.name}" if self.cls else f"{self.module}.{self.name}"


# --------------------------------------------------------------------------------------
# Walking the library
# --------------------------------------------------------------------------------------


def _module_name(rel: Path) -> str | None:
    """The dotted name of a .py file relative to the walked folder; None for private, test or non-module files."""
    parts = [*rel.parts[:-1], rel.stem]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p in _SKIP_PARTS or p.startswith("_") or not p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def _excerpt(doc: str) -> str:
    """The docstring's first paragraph and as many following ones as fit _MAX_DOC_CHARS."""
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    kept = [paragraphs[0][:_MAX_DOC_CHARS].rsplit("\n", 1)[0] if len(paragraphs[0]) > _MAX_DOC_CHARS
            else paragraphs[0]]
    for paragraph in paragraphs[1:]:
        if sum(len(p) + 2 for p in kept) + len(paragraph) > _MAX_DOC_CHARS:
            break
        kept.append(paragraph)
    return "\n\n".join(kept)


def _header(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's short decorators and its `def` line."""
    decorators = [f"@{ast.unparse(d)}" for d in node.decorator_list if len(ast.unparse(d)) <= _DECORATOR_CHARS]
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return "\n".join([*decorators, f"{keyword} {node.name}({ast.unparse(node.args)}){returns}:"])


def _function(module: str, cls: str | None, node: ast.AST) -> LibFunction | None:
    """The node as a LibFunction when it is a public function with a docstring worth a prompt."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    if not doc or len(doc.split()) < _MIN_WORDS:
        return None  # too short to write the function from
    doc = _excerpt(doc)
    if '"""' in doc or doc.endswith(('"', "\\")):
        return None  # it would not close the docstring it is shown in
    return LibFunction(module, cls, node.name, _header(node), ast.unparse(node.args), doc)


def _file_functions(module: str, tree: ast.Module) -> Iterator[LibFunction]:
    """The module-level functions and the methods of module-level public classes, in file order."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from filter(None, (_function(module, node.name, m) for m in node.body))
        elif (fn := _function(module, None, node)) is not None:
            yield fn


def _python_files(root: Path) -> Iterator[tuple[Path, str]]:
    """(path, module name) of the public .py files under ``root`` (or ``root`` itself), in sorted order, without
    entering skipped folders (a stdlib's site-packages may hold thousands of files)."""
    if root.is_file():
        module = _module_name(Path(root.name))
        yield from [(root, module)] if module else []
        return
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if _module_name(Path(d, "__init__.py")) is not None)
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder, name)
            module = _module_name(path.relative_to(root))
            if module is not None:
                yield path, module


@functools.lru_cache(maxsize=4)
def library_functions(root: Path) -> tuple[LibFunction, ...]:
    """Every public documented function and method of the Python files under ``root``, in sorted file order.

    ``root`` may be one .py file. Files that do not parse (another Python's syntax) are skipped.
    """
    out: list[LibFunction] = []
    for path, module in _python_files(root):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue
        out.extend(_file_functions(module, tree))
    return tuple(out)


# --------------------------------------------------------------------------------------
# Prompt templates
# --------------------------------------------------------------------------------------


def _indent(text: str, spaces: int) -> str:
    return "\n".join((" " * spaces + line) if line else line for line in text.split("\n"))


def _code(fn: LibFunction) -> str:
    """The signature and docstring as code, inside its class for a method (the body is what the target writes)."""
    body = f"{fn.header}\n{_indent(chr(34) * 3 + fn.doc + chr(34) * 3, 4)}"
    return f"class {fn.cls}:\n{_indent(body, 4)}" if fn.cls else body


def _task(fn: LibFunction) -> str | None:
    """The docstring's first sentence as what a function does ("returns the ..."), when it starts with a verb."""
    first = " ".join(fn.doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[a-z0-9)`'\"])\.(\s|$)", first, maxsplit=1)[0].rstrip(".")
    words = sentence.split()
    if not 3 <= len(words) <= _MAX_SENTENCE_WORDS:
        return None
    verb = words[0].lower()
    if verb.endswith("s") and (verb[:-1] in _VERBS or verb[:-2] in _VERBS):
        return " ".join([verb, *words[1:]])
    if verb not in _VERBS:
        return None
    conjugated = (verb[:-1] + "ies" if verb.endswith("y") and verb[-2] not in "aeiou"
                  else verb + "es" if verb.endswith(("s", "sh", "ch", "x", "z", "o")) else verb + "s")
    return " ".join([conjugated, *words[1:]])


def _what(fn: LibFunction) -> str:
    return f"method of the Python class `{fn.cls}`" if fn.cls else "Python function"


_COMPLETIONS: tuple[Callable[[LibFunction], str], ...] = (
    lambda fn: f"Complete the following {_what(fn)}:\n\n```python\n{_code(fn)}\n```",
    lambda fn: (f"Implement this {_what(fn)} from the `{fn.module}` module. Write its body.\n\n"
                f"```python\n{_code(fn)}\n```"),
    lambda fn: f"```python\n{_code(fn)}\n```\n\nFill in the body of the {'method' if fn.cls else 'function'} above.",
)
_INSTRUCTIONS: tuple[Callable[[LibFunction, str], str], ...] = (
    lambda fn, task: f"Write a {_what(fn)} that {task}.",
    lambda fn, task: (f"Write a {'method' if fn.cls else 'Python function'} `{fn.name}({fn.params})`"
                      f"{f' for the Python class `{fn.cls}`' if fn.cls else ''} that {task}."),
    lambda fn, task: f"In Python, how would you write a {'method' if fn.cls else 'function'} `{fn.name}` that {task}? "
                     "Show the code.",
)


def render_prompt(fn: LibFunction) -> str:
    """The user prompt for one function, in the template its qualified name's hash picks: a completion request, or,
    when the docstring opens with a verb, possibly an instruction."""
    task = _task(fn)
    templates = [*_COMPLETIONS, *(functools.partial(t, task=task) for t in _INSTRUCTIONS if task)]
    pick = int.from_bytes(hashlib.sha256(f"draftsmith-libcode\0{fn.qualname}".encode()).digest()[:8], "big")
    return templates[pick % len(templates)](fn)


def _mentions(fn: LibFunction, names: frozenset[str]) -> bool:
    """Whether the function, its class or a function its docstring defines is named in ``names``."""
    return bool({fn.name, fn.cls} & names) or any(m in names for m in re.findall(r"\bdef\s+(\w+)", fn.doc))


def library_prompts(root: Path, source: str, exclude_names: frozenset[str]) -> list[Prompt]:
    """One prompt per documented public function or method under ``root`` (see library_functions), leaving out every
    one that ``_mentions`` a name of ``exclude_names``. id = f"{source}:{qualified name}"."""
    make_id = IdMaker(source)
    return [Prompt(make_id(fn.qualname), (render_prompt(fn),), None, source)
            for fn in library_functions(root) if not _mentions(fn, exclude_names)]
