"""docs/config_reference.md is current and complete: every schema key with its type, default and description.

Keys and defaults are taken from OmegaConf's view of the schema and types from `typing.get_type_hints`,
not from the generator, and compared with the rows parsed out of the committed Markdown.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing

from omegaconf import DictConfig, OmegaConf

from megarl.config import reference, schema

ROW = re.compile(r"^\| `(?P<key>[\w.]+)` \| `(?P<type>[^`]+)` \| (?P<default>.+?) \| (?P<description>.*) \|$")


def _rows() -> dict[str, dict[str, str]]:
    lines = reference.REFERENCE_PATH.read_text().splitlines()
    return {match["key"]: match.groupdict() for match in map(ROW.match, lines) if match}


def _schema_keys(node: DictConfig, hints_of: type, prefix: str = ""):
    """(dotted key, type hint, node, name) of every key the loader accepts."""
    hints = typing.get_type_hints(hints_of)
    for name in node.keys():
        yield prefix + name, hints[name], node, name
        if dataclasses.is_dataclass(hints[name]):  # a section (a dict-typed key is a DictConfig too, and a key)
            yield from _schema_keys(node._get_node(name), hints[name], f"{prefix}{name}.")


def test_committed_reference_is_current():
    assert reference.REFERENCE_PATH.is_file(), "docs/config_reference.md is missing: " + reference.REGENERATE
    assert reference.REFERENCE_PATH.read_text() == reference.render_reference(), (
        "docs/config_reference.md is stale (the schema changed): regenerate it with python -m megarl.config.reference")


def test_every_schema_key_has_type_default_and_description():
    rows = _rows()
    keys = list(_schema_keys(OmegaConf.structured(schema.RunConfig), schema.RunConfig))
    assert len(keys) > 100 and len(rows) == len(keys)
    for key, hint, parent, name in keys:
        assert key in rows, f"{key} is missing from the reference"
        row = rows[key]
        assert eval(row["type"].replace("\\|", "|"), vars(schema)) == hint, key  # `float \| None`: a table cell
        assert row["description"].strip(), f"{key} has no description"
        if dataclasses.is_dataclass(hint):
            assert row["default"].startswith("section"), key
        elif OmegaConf.is_missing(parent, name):
            assert row["default"] == "**required**", key
        else:
            expected = OmegaConf.to_container(parent, resolve=True)[name]
            assert json.loads(row["default"].strip("`")) == expected, key


def test_inherited_and_allowed_value_descriptions():
    rows = _rows()
    assert rows["actor.tp"]["description"] == "Tensor-parallel size."  # written on ParallelConfig
    assert rows["critic.optim.lr"]["description"] == "Peak learning rate, reached after the warmup."
    assert "`bfloat16`" in rows["model.dtype"]["description"]


def test_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config_reference.md"
    stale.write_text(reference.render_reference().replace("Tensor-parallel size.", "Old text."))
    monkeypatch.setattr(reference, "REFERENCE_PATH", stale)
    assert reference.main(["--check"]) == 1
    assert "python -m megarl.config.reference" in capsys.readouterr().err
    assert reference.main([]) == 0 and reference.main(["--check"]) == 0
