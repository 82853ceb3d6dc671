"""How a recipe key is declared (core/recipe.py's schema is written with these): `setting(default, doc, bound=...)`
puts a key's default, one-line doc and valid range beside its type annotation, so that the validator
(`bound_problems`), the key listing (`dataclass_keys`: `draftsmith recipes --keys`, recipes/KEYS.md) and the docs
read one declaration. A key added later defaults to what runs did before it existed: stage folders made before it
then still match (core/stage.py), and a half-trained run resumes under the new version."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Bound:
    """A numeric key's valid range: `low`/`high` (None: open-ended), exclusive where `*_open`. `says` replaces the
    generated "in [low, high)" wording; `then` follows the bad value in the message (the fix, or why)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    says: str = ""
    then: str = ""

    def holds(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        if self.says:
            return self.says
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


POSITIVE = Bound(low=0, low_open=True)
NON_NEGATIVE = Bound(low=0)
FRACTION_BELOW_ONE = Bound(low=0, high=1, high_open=True)  # [0, 1): a rate whose 1 would mean "never changes"
# DFlash2's candidate selector (modeling/selector.py), bounded at load: its tables are 2 x vocabulary x rank parameters
# (Qwen3's 151,936 tokens at rank 4096: 1.2 B, 20 GB with Adam's state), and each slot scores K x K candidate pairs
SELECTOR_RANK = Bound(low=0, high=4096, then=": the predecessor/successor tables are 2 x vocabulary x rank parameters "
                      "(the [dflash2] base sets 256)")
SELECTOR_TOP_K = Bound(low=2, high=1024, then=": each draft slot scores K x K candidate pairs, and a target vocabulary "
                       "holds more than 1024 tokens (the [dflash2] base sets 16)")


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, bound: Bound | None = None, factory=None):
    """One recipe key: its default (or `factory` for a list or section), its bound and its one-line doc."""
    metadata = {"doc": doc, "bound": bound}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def dataclass_keys(cls, prefix: str = "") -> list[dict]:
    """Every leaf key, in declaration order: dotted name, type, default, bound and doc (what --keys and the generated
    key table print). A list of sections (data.sources) is listed by its item's keys, as `data.sources[].name`."""
    hints = typing.get_type_hints(cls)
    rows = []
    for spec in dataclasses.fields(cls):
        tp, dotted = hints[spec.name], f"{prefix}{spec.name}"
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            rows += dataclass_keys(tp, dotted + ".")
        elif item is not None and dataclasses.is_dataclass(item):
            rows += dataclass_keys(item, dotted + "[].")
        else:
            default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
            bound = spec.metadata.get("bound")
            rows.append({"key": dotted, "type": _type_text(tp), "default": default,
                         "bound": bound.text() if bound else "", "doc": spec.metadata.get("doc", "")})
    return rows


def _type_text(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " / ".join(map(str, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " / ".join(_type_text(a) for a in typing.get_args(tp) if a is not type(None)) + " / null"
    if origin is list:
        return f"list[{_type_text(typing.get_args(tp)[0])}]"
    return type_name(tp)


def type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))



def bound_problems(obj, prefix: str = "") -> list[str]:
    """Each key outside the bound declared beside it, named by dotted key (an item of a list of sections as
    `data.sources[].weight`, with its index; a list of numbers once, whole)."""
    problems = []
    for spec in dataclasses.fields(obj):
        value, dotted, bound = getattr(obj, spec.name), f"{prefix}{spec.name}", spec.metadata.get("bound")
        if dataclasses.is_dataclass(value):
            problems += bound_problems(value, dotted + ".")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                problems += [f"{p} ({dotted}[{i}])" for p in bound_problems(item, dotted + "[].")]
        elif bound is not None and value is not None:
            numbers = value if isinstance(value, list) else [value]
            if not all(bound.holds(v) for v in numbers if isinstance(v, (int, float)) and math.isfinite(v)):
                problems.append(f"{dotted} must be {bound.text()}, got {value}{bound.then}")
    return problems
