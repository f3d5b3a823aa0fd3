"""`make gpu-wheels`: the wheels megarl needs on the GPU smoke kit's box, downloaded here.

The box (tools/gpu_smoke.sh) is air-gapped and already holds torch, transformers, tokenizers, safetensors,
pyarrow, psutil, matplotlib, Triton and pytest; what megarl needs beyond that image is
megatron-core and omegaconf (mlflow and math-verify are used only when a run asks for them: the kit
logs to the console and scores with a rule). Their versions are megarl's own pins, read from setup.py's
installed metadata, for CPython 3.12 on manylinux x86_64. Everything travels with the working tree,
whose limit is 64 MiB: the wheels may take at most 40 MiB of it.

    python tools/gpu_wheels.py [--out .gpu-wheels]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from docker_check import PLATFORMS  # the same platform tags, for the same Python 3.12 on x86-64 Linux
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BEYOND_THE_IMAGE = ("megatron-core", "omegaconf")
PYTHON_VERSION = "3.12"
LIMIT_BYTES = 40 * 2**20


def pins() -> list[str]:
    """megarl's requirement for each package beyond the image (`megarl` must be installed: make install)."""
    requirements = [Requirement(line) for line in importlib.metadata.requires("megarl") or ()]
    chosen = [str(r) for r in requirements if r.name in BEYOND_THE_IMAGE and r.marker is None]
    if len(chosen) != len(BEYOND_THE_IMAGE):
        raise SystemExit(f"setup.py pins {chosen}; expected one pin each of {', '.join(BEYOND_THE_IMAGE)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-wheels")
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms,
                    "--dest", str(args.out), *pins()], check=True)
    wheels = sorted(args.out.glob("*.whl"))
    total = sum(wheel.stat().st_size for wheel in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:7.2f} MiB  in {args.out} (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        print(f"gpu-wheels: {total / 2**20:.1f} MiB exceeds the kit's {LIMIT_BYTES / 2**20:.0f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
