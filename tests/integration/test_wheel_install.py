"""megarl as a wheel installs it (`pip install .`, no editable finder, no checkout on sys.path): every source
file of megarl/ and of kernels/ (the package megarl.kernels, through the link megarl/kernels) is installed, a
folder without `__init__.py` being what would leave one out; no top-level `kernels` is installed (it would
shadow PyPI's `kernels` project); and every module imports from the installed copy (tools/import_every_module.py,
run outside the checkout with the install alone on PYTHONPATH and the venv's packages for the dependencies)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SKIP = shutil.ignore_patterns("__pycache__")


def _python_files(package: Path) -> set[str]:
    return {str(Path(folder, name).relative_to(package)) for folder, _, names in os.walk(package, followlinks=True)
            if "__pycache__" not in Path(folder).parts for name in names if name.endswith(".py")}


def test_installed_megarl_holds_and_imports_every_module(tmp_path):
    source = tmp_path / "source"  # a copy: building in place leaves build/ in the checkout, stale files and all
    shutil.copytree(ROOT / "megarl", source / "megarl", symlinks=True, ignore=SKIP)
    shutil.copytree(ROOT / "kernels", source / "kernels", ignore=SKIP)
    for name in ("setup.py", "requirements-gpu.txt"):
        shutil.copy(ROOT / name, source / name)
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              "--no-build-isolation", "--target", str(site), str(source)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]

    missing = _python_files(ROOT / "megarl") - _python_files(site / "megarl")
    assert missing == set(), f"not installed (a folder without __init__.py?): {sorted(missing)}"
    assert sorted(path.name for path in site.iterdir() if not path.name.endswith(".dist-info")) == ["megarl"]

    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    result = subprocess.run([sys.executable, str(ROOT / "tools/import_every_module.py")], cwd=tmp_path,
                            env=dict(env, PYTHONPATH=str(site), PYTHONWARNINGS="ignore"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"modules of {site / 'megarl'} import" in result.stdout, result.stdout[-2000:]
