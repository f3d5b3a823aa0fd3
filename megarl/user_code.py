"""Loading user code named in a config or on a command line: one spelling everywhere.

    path/to/file.py:function     a file, by location
    pkg.module:function          an importable module

Custom rewards, and later tools, environments and losses, are all named this way. Every failure
(no colon, a missing file or module, an import error, a missing or non-callable attribute) is a
one-line `ValueError` naming the spec and, where it helps, what the module does offer.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

from megarl.messages import one_line

SPELLING = "path/to/file.py:function or pkg.module:function"


def load_callable(spec: str, what: str) -> Callable:
    """The callable named by `spec`; `what` names it in errors (e.g. "reward.function")."""
    location, colon, name = spec.rpartition(":")
    if not colon or not location or not name:
        raise ValueError(f"{what}={spec!r}: expected {SPELLING}")
    is_file = location.endswith(".py") or "/" in location
    module = _import_file(location, what) if is_file else _import_module(location, what)
    if not hasattr(module, name):
        callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"{what}={spec!r}: {location} has no {name!r}; its callables: "
                         f"{', '.join(callables) or '(none)'}")
    function = getattr(module, name)
    if not callable(function):
        raise ValueError(f"{what}={spec!r}: {name!r} is a {type(function).__name__}, not callable")
    return function


def _import_file(path: str, what: str) -> ModuleType:
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"{what}: file {path!r} does not exist")
    # A name unique per file, so two user files both called rewards.py do not collide.
    module_name = f"megarl_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what}: file {path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # registered first: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"{what}: importing {path!r} failed: {type(exc).__name__}: {one_line(exc)}") from exc
    return module


def _import_module(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise ValueError(f"{what}: importing module {name!r} failed: {type(exc).__name__}: {one_line(exc)}") from exc
