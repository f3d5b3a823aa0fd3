"""Loading a user's scoring function from a `.py` file or an importable module.

    compute_score = load_function("my_rewards.py", "compute_score")   # a file, by location
    compute_score = load_function("mypkg.rewards", "compute_score")   # a dotted module name

The function keeps the common signature `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict` and is used unchanged; `RewardManager` turns a dict return
("score" plus extra numeric metrics) into rewards and metrics. A function that cannot be called
with these four arguments is refused when it is loaded, before any model is built.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

from megarl.messages import one_line

SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"


def _import_file(path: str) -> ModuleType:
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"custom function file {path!r} does not exist")
    # A name unique per file, so two user files both called rewards.py do not collide.
    module_name = f"megarl_custom_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom function file {path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # registered first: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"importing custom function file {path!r} failed: "
                         f"{type(exc).__name__}: {one_line(exc)}") from exc
    return module


def _import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise ValueError(f"importing custom function module {name!r} failed: "
                         f"{type(exc).__name__}: {one_line(exc)}") from exc


def load_function(path: str, name: str) -> Callable:
    """The attribute `name` of the `.py` file or dotted module `path`; ValueError if it is missing."""
    module = _import_file(path) if path.endswith(".py") or "/" in path else _import_module(path)
    if not hasattr(module, name):
        callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"custom function {name!r} not found in {path!r}; "
                         f"its callables: {', '.join(callables) or '(none)'}")
    function = getattr(module, name)
    if not callable(function):
        raise ValueError(f"custom function {name!r} in {path!r} is a {type(function).__name__}, not callable")
    _check_signature(function, name, path)
    return function


def _check_signature(function: Callable, name: str, path: str) -> None:
    """ValueError unless `function` accepts the four arguments `RewardManager` passes, by position."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins and extension functions have none: found by calling
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", {})
    except TypeError as exc:
        raise ValueError(f"custom function {name!r} in {path!r} has the signature {name}{signature} "
                         f"({exc}); expected {SIGNATURE}") from None
