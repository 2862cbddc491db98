"""Options records: frozen dataclasses whose fields are a public constructor's keywords, each field
documented where it is declared.

`AutoTrainer` and `Tuner` keep their flat keywords (what users call and their editors show); inside,
the options travel as one record, built once from those keywords by name (`build`), and the rooms
below read the record instead of a keyword each. An option is a field here (its default and its
doc) and a keyword in each signature that shows it, and nothing in between: tuning/arguments.py
renders the fields' docs into the classes' docstrings, and tests/tuning/test_options.py holds the
records and the signatures to each other (names and defaults).

Owns how a field carries its doc, and the reading by name. Touches nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

R = TypeVar("R")


def option(default: Any, doc: str, *, trainer: str | None = None) -> Any:
    """A field of an options record: its default (the `Tuner`'s keyword's) and its user doc, one
    paragraph (re-wrapped where it is shown). `trainer`: `AutoTrainer`'s doc where it says more
    or otherwise than the Tuner's (`seed` also orders its epochs)."""
    return dataclasses.field(default=default, metadata={"doc": _paragraph(doc),
                                                        "trainer": _paragraph(trainer) if trainer else None})


def part(record: type) -> Any:
    """A field that is a record of its own (the step's options in the Tuner's), built from the same keywords."""
    return dataclasses.field(default_factory=record, metadata={"part": record})


class Documented(NamedTuple):
    """One keyword of a record, flattened out of its parts: its name, default and docs."""

    name: str
    default: Any
    doc: str
    trainer: str | None  # AutoTrainer's, where it differs


def keywords(record: type) -> Iterator[Documented]:
    """Every keyword `record` is built from, parts flattened, in declaration order."""
    for f in dataclasses.fields(record):
        if "part" in f.metadata:
            yield from keywords(f.metadata["part"])
        else:
            yield Documented(f.name, f.default, f.metadata["doc"], f.metadata["trainer"])


def build(record: type[R], given: Mapping[str, Any]) -> R:
    """`record` from a constructor's keywords (`locals()` at its first line): each field by its name,
    its parts from the same keywords. Every field must be among them: an option declared here and
    missing from the signature is an error at the first construction, not a default used silently."""
    values = {}
    for f in dataclasses.fields(record):
        if "part" in f.metadata:
            values[f.name] = build(f.metadata["part"], given)
        elif f.name in given:
            values[f.name] = given[f.name]
        else:
            raise TypeError(f"{record.__name__}.{f.name} is not a keyword of the constructor building it: "
                            f"add `{f.name}` to its signature")
    return record(**values)


def _paragraph(text: str) -> str:
    return " ".join(text.split())
