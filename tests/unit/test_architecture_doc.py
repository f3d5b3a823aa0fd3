"""docs/architecture.md's layer order holds, and the docs' relative links resolve.

The layer order is read from the fenced `layers` block of docs/architecture.md (lowest layer first, one
layer a line). Every package and top-level module of megarl/ must sit in exactly one layer, and no module
may import (an `import` or `from ... import` statement, anywhere in the file) a package of a higher layer
than its own; the packages' import graph must have no cycles. The graph is read from the source with
`ast`, not by importing anything.

    python tests/unit/test_architecture_doc.py    # prints the current package import graph
"""

from __future__ import annotations

import ast
import graphlib
import os
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megarl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYERS_BLOCK = re.compile(r"^```layers\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _unit(path: Path) -> str:
    """The package (or top-level module) of megarl/ that a source file belongs to."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import statement in `source`, a module of `package`; relative
    imports resolved, `from megarl import device` read as the module megarl.device."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if base == "megarl" else base))
    return found


def _sources() -> list[Path]:
    """megarl's source files, those of megarl/kernels (a link to the top-level kernels/ folder) included."""
    return sorted(Path(folder, name) for folder, _, names in os.walk(PACKAGE, followlinks=True)
                  for name in names if name.endswith(".py"))


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    package = ".".join(path.relative_to(ROOT).parts[:-1])
    return _imports(path.read_text(), package)


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{importing unit: {imported unit: ["file:line", ...]}} over megarl/, self-imports left out."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _sources():
        if path == PACKAGE / "__init__.py":
            continue
        source = _unit(path)
        graph[source]  # a unit that imports nothing of megarl is still a node
        for line, module in _imported_modules(path):
            parts = module.split(".")
            if parts[0] == "megarl" and len(parts) > 1 and parts[1] != source:
                graph[source][parts[1]].append(f"{path.relative_to(ROOT)}:{line}")
    return graph


def units() -> set[str]:
    return {_unit(path) for path in _sources() if path != PACKAGE / "__init__.py"}


def stated_layers(text: str) -> dict[str, int]:
    """{unit: layer index, 0 the lowest} from the `layers` block: one layer a line, names split by spaces,
    anything after `#` a comment."""
    match = LAYERS_BLOCK.search(text)
    assert match, f"{ARCHITECTURE.name} has no ```layers block"
    layer_of: dict[str, int] = {}
    lines = [line.split("#")[0].split() for line in match["body"].splitlines()]
    for index, names in enumerate(line for line in lines if line):
        for name in names:
            assert name not in layer_of, f"{name} is listed in two layers of {ARCHITECTURE.name}"
            layer_of[name] = index
    return layer_of


def upward_imports(graph, layer_of: dict[str, int]) -> list[str]:
    return [
        f"{where}: {source} (layer {layer_of[source]}) imports megarl.{target} (layer {layer_of[target]})"
        for source, targets in sorted(graph.items())
        for target, places in sorted(targets.items())
        if layer_of[target] > layer_of[source]
        for where in places
    ]


def test_every_unit_has_one_layer():
    layer_of = stated_layers(ARCHITECTURE.read_text())
    assert units() - layer_of.keys() == set(), f"missing from the layers of {ARCHITECTURE.name}"
    assert layer_of.keys() - units() == set(), f"listed in {ARCHITECTURE.name} but not under megarl/"


def test_no_module_imports_a_higher_layer():
    layer_of = stated_layers(ARCHITECTURE.read_text())
    assert upward_imports(import_graph(), layer_of) == []


def test_package_graph_has_no_cycles():
    graph = import_graph()
    graphlib.TopologicalSorter({source: set(targets) for source, targets in graph.items()}).prepare()


def test_layer_rule_catches_an_upward_import():
    """The checks above would see a violation: a lowest-layer unit importing the trainer."""
    layer_of = stated_layers(ARCHITECTURE.read_text())
    graph = {"seeding": {"trainer": ["megarl/seeding.py:1"]}, "trainer": {}}
    assert upward_imports(graph, layer_of) == [
        "megarl/seeding.py:1: seeding (layer 0) imports megarl.trainer (layer 8)"]


def test_imports_are_read_as_modules():
    source = "\n".join(["import megarl.data.sampler", "from megarl import device", "from ..models import builder",
                         "from . import batch"])
    assert [name for _, name in _imports(source, "megarl.engine")] == [
        "megarl.data.sampler", "megarl.device", "megarl.models", "megarl.engine"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_launchers_reach_the_trainer_only_through_its_entry_points():
    """train_ppo.py and train_sft.py import the trainer's entry points alone; generate.py and evaluate.py nothing of
    the trainer (they stand on megarl.generation)."""
    reached = {path.name: sorted({module for _, module in _imports(path.read_text(), "launchers")
                                  if module.startswith("megarl.trainer")})
               for path in sorted((ROOT / "launchers").glob("*.py"))}
    assert reached == {"evaluate.py": [], "generate.py": [], "train_ppo.py": ["megarl.trainer.main"],
                       "train_sft.py": ["megarl.trainer.main"]}


def test_the_trainer_does_not_branch_on_the_placement():
    """The loop drives a `Placement`; which one it is, is decided in `megarl.placement.make_placement`."""
    source = (PACKAGE / "trainer" / "rl_trainer.py").read_text()
    assert "self.world" not in source and "SplitPlacement" not in source and "ColocatedPlacement" not in source


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        text = re.sub(r"`[^`\n]*`", "", text)  # links inside inline code are not links
        for match in LINK.finditer(text):
            target = match["target"]
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not linked.exists():
                broken.append(where + " (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(where + " (no such heading)")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / match["target"].partition("#")[0]).resolve() for match in LINK.finditer(readme)}
    unlinked = [str(page.relative_to(ROOT)) for page in _pages()[1:] if page.resolve() not in linked]
    assert unlinked == []


if __name__ == "__main__":
    for source, targets in sorted(import_graph().items()):
        print(f"{source:12} -> {' '.join(sorted(targets)) or '-'}")
