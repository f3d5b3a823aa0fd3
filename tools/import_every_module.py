"""Import every module of megarl and kernels, and name each that fails with its error.

The GPU smoke kit's first question on a new machine (another torch, no vLLM): does megarl import there?
Modules import their optional packages (vLLM, mlflow, math-verify, Transformer Engine) only where they
are used, so every module must import with megarl's core requirements alone; a module that exists for
one optional package (the Triton kernel) is reported as skipped where that package is absent. Exits 1
if any fails.

    python tools/import_every_module.py
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megarl", "kernels")
OPTIONAL = ("triton", "transformer_engine", "apex", "vllm")


def module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        path = [str(ROOT / package)]
        names += [info.name for info in pkgutil.walk_packages(path, prefix=f"{package}.")]
    return names


def main() -> int:
    sys.path.insert(0, str(ROOT))
    names, failed, skipped = module_names(), [], []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name and error.name.split(".")[0] in OPTIONAL:
                skipped.append(f"{name} ({error.name} absent)")
            else:
                failed.append(name)
                print(f"FAIL {name}: {error}")
        except Exception as error:  # noqa: BLE001 - every failure is the finding
            failed.append(name)
            where = traceback.extract_tb(error.__traceback__)[-1]
            print(f"FAIL {name}: {type(error).__name__}: {error} ({where.filename}:{where.lineno})")
    import torch

    print(f"{len(names) - len(failed) - len(skipped)} of {len(names)} modules import (torch {torch.__version__})"
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
