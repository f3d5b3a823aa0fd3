"""The config reference (docs/config_reference.md), generated from the dataclass schemas.

    python -m megarl.config.reference           # (re)write docs/config_reference.md
    python -m megarl.config.reference --check   # exit 1 if the file is stale

Field docstrings are the string literals right under each field in `megarl/config/schema.py`;
Python keeps no record of them at run time, so they are read from the source with `ast`. Fields
inherited from a base class (`ActorConfig` from `EngineConfig` and `ParallelConfig`) take the
docstring written in the base.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import typing
from pathlib import Path

from omegaconf import MISSING

from megarl.config import schema

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"
REGENERATE = "python -m megarl.config.reference"

HEADER = f"""# Config reference

Generated from `megarl/config/schema.py` by `{REGENERATE}`; do not edit by hand.
Every key can be set in a YAML file (`configs/*.yaml`) or overridden on the command line with its
dotted name (`actor.tp=2 data.train_files=[a.parquet]`). A key marked **required** has no default.
"""


def field_docstrings(cls: type) -> dict[str, str]:
    """{field name: docstring} of a dataclass, from its source and its bases' (nearest class wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        class_node = ast.parse(inspect.getsource(klass)).body[0]
        body = class_node.body
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _format_default(value) -> str:
    if value is MISSING:
        return "**required**"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{json.dumps(value)}`"


def _allowed_values(text: str) -> str:
    """Spell out the schema's tuples of allowed values (DTYPES, ...) that a docstring names."""
    named = [name for name, value in vars(schema).items()
             if name.isupper() and isinstance(value, tuple) and re.search(rf"\b{name}\b", text)]
    return "".join(f" ({name}: {', '.join(f'`{v}`' for v in vars(schema)[name])})" for name in named)


def _cell(text: str) -> str:
    """Docstrings are plain text: keep `|`, `*` and `<` from acting as Markdown or HTML."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _section(cls: type, prefix: str, lead: str) -> list[str]:
    """The Markdown of one section and, after it, of each nested section (dotted keys)."""
    docs, types = field_docstrings(cls), typing.get_type_hints(cls)
    heading = prefix.rstrip(".") or "sections"
    lines = [f"## {heading}", "", f"`{cls.__name__}`: {_cell(' '.join(lead.split()))}", "",
             "| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for field in dataclasses.fields(cls):
        key, description = prefix + field.name, docs.get(field.name, "")
        if dataclasses.is_dataclass(types[field.name]):
            nested.append((types[field.name], key + ".", field))
            default = f"section [`{key}`](#{key.replace('.', '')})"
        else:
            default = _format_default(_default(field))
        description = _cell(description) + _allowed_values(description)
        lines.append(f"| `{key}` | `{_cell(str(field.type))}` | {default} | {description} |")
    for nested_cls, nested_prefix, field in nested:
        lead = nested_cls.__doc__ if _has_own_docstring(nested_cls) else docs.get(field.name, "")
        lines += ["", *_section(nested_cls, nested_prefix, lead)]
    return lines


def _has_own_docstring(cls: type) -> bool:
    # dataclasses invent a docstring (the signature) for classes without one.
    return bool(cls.__doc__) and not cls.__doc__.startswith(cls.__name__ + "(")


def render_reference() -> str:
    """The whole reference as Markdown: the top-level sections, then each section's keys."""
    lines = _section(schema.RunConfig, "", "a run's sections; each is described below.")
    return HEADER + "\n" + "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the schema")
    args = parser.parse_args(argv)
    text = render_reference()
    if args.check:
        if not REFERENCE_PATH.is_file() or REFERENCE_PATH.read_text() != text:
            print(f"{REFERENCE_PATH} is stale: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{REFERENCE_PATH} is up to date")
        return 0
    REFERENCE_PATH.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE_PATH.write_text(text)
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
