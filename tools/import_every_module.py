"""Import every module of megarl (megarl.kernels included), and name each that fails with its error.

The GPU smoke kit's first question on a new machine (another torch, no vLLM): does megarl import there?
Modules import their optional packages (vLLM, mlflow, math-verify, Transformer Engine) only where they
are used, so every module must import with megarl's core requirements alone; a module that exists for
one optional package (the Triton kernel) is reported as skipped where that package is absent. Exits 1
if any fails. The modules walked are those of the megarl that imports (an install, a checkout on
PYTHONPATH), else this checkout's; the summary names where it came from.

    python tools/import_every_module.py
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("triton", "transformer_engine", "apex", "vllm")


def module_names() -> list[str]:
    """megarl and every module under the megarl that imports (walk_packages follows the megarl/kernels link)."""
    import megarl

    return ["megarl", *(info.name for info in pkgutil.walk_packages(megarl.__path__, prefix="megarl."))]


def main() -> int:
    if importlib.util.find_spec("megarl") is None:  # neither installed nor on PYTHONPATH: this checkout's
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

    where = Path(sys.modules["megarl"].__file__).parent
    print(f"{len(names) - len(failed) - len(skipped)} of {len(names)} modules of {where} import "
          f"(torch {torch.__version__})"
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
