"""`make docker-check`: do the GPU image's pins install together, for the image's Python and platform?

Runs without Docker or a GPU, only PyPI: it asks pip to resolve (`install --dry-run --report`, nothing
installed) everything the Dockerfile's gpu target installs, as the image would see it:

1. megarl itself, as a wheel built here (pure Python), so that its own pins (torch, megatron-core,
   transformers...) take part;
2. `requirements-gpu.txt`, binary-only, for CPython of the Dockerfile's `python3.X` on manylinux x86_64;
3. Transformer Engine's PyTorch extension, published only as an sdist (the image compiles it against
   its torch): it is left out of the binary-only resolution and replaced by the requirements its sdist
   declares (PKG-INFO; reading it needs no build, which would need a CUDA torch);
4. the CUDA version torch was built with (its `cuda-toolkit` pin) against the Dockerfile's base image:
   Apex refuses to compile when nvcc's major.minor differs from torch's.

pip evaluates environment markers (`python_version > "3.11"`) for the interpreter running this script,
not the target version: run it with the image's Python for an exact answer.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SDIST_ONLY = ("transformer-engine-torch",)
# Ubuntu 24.04's glibc is 2.39: wheels for any manylinux_2_x up to it install there.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + ["manylinux2014_x86_64", "linux_x86_64"]


def _pip(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=check, env=env)


def _requirement_name(line: str) -> str:
    return re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0].lower().replace("_", "-")


def read_requirements(path: Path) -> list[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def dockerfile_targets(dockerfile: Path) -> tuple[str, str]:
    """(CUDA major.minor of the gpu target's base image, its Python major.minor)."""
    text = dockerfile.read_text()
    cuda = re.search(r"^FROM nvidia/cuda:(\d+\.\d+)\.\d+-\S+ AS gpu$", text, re.MULTILINE)
    python = re.search(r"python(3\.\d+) -m venv", text)
    if not cuda or not python:
        raise ValueError(f"{dockerfile}: expected 'FROM nvidia/cuda:X.Y.Z-... AS gpu' and 'python3.N -m venv'")
    return cuda.group(1), python.group(1)


def sdist_requirements(requirement: str, workdir: Path) -> list[str]:
    """Requires-Dist of `requirement`'s sdist. pip unpacks it, then fails to prepare its metadata
    without a CUDA torch; --no-clean keeps the unpacked tree, whose PKG-INFO the release wrote."""
    build = workdir / "sdist-build"
    build.mkdir()
    _pip("download", "--no-deps", "--no-binary=:all:", "--no-build-isolation", "--no-clean", "--quiet",
         "-d", str(workdir / "sdist"), requirement, env=dict(os.environ, TMPDIR=str(build)), check=False)
    found = sorted(build.glob("pip-*/*/PKG-INFO"))
    if not found:
        raise SystemExit(f"FAIL {requirement}: no sdist found on the index")
    metadata = email.parser.Parser().parsestr(found[0].read_text())
    if metadata["Version"] != requirement.split("==")[1]:
        raise SystemExit(f"FAIL {requirement}: the sdist found is version {metadata['Version']}")
    # The core library it names (transformer_engine_cuXX) is chosen at build time by torch's CUDA.
    return [r for r in metadata.get_all("Requires-Dist", [])
            if not _requirement_name(r).startswith("transformer-engine-cu")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requirements", type=Path, default=ROOT / "requirements-gpu.txt")
    parser.add_argument("--dockerfile", type=Path, default=ROOT / "Dockerfile")
    args = parser.parse_args(argv)

    base_cuda, python = dockerfile_targets(args.dockerfile)
    requirements = read_requirements(args.requirements)
    binary = [r for r in requirements if _requirement_name(r) not in SDIST_ONLY]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        extra = [req for r in requirements if _requirement_name(r) in SDIST_ONLY
                 for req in sdist_requirements(r, workdir)]
        source = workdir / "megarl-source"  # a copy: building in place would leave build/ in the repository
        # megarl/kernels, a link to the top-level kernels/ folder, is copied as a folder.
        shutil.copytree(ROOT / "megarl", source / "megarl", ignore=shutil.ignore_patterns("__pycache__"))
        for file in ("setup.py", "requirements-gpu.txt"):
            shutil.copy(ROOT / file, source / file)
        _pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(workdir / "wheel"), str(source))
        megarl = next((workdir / "wheel").glob("megarl-*.whl"))
        report = workdir / "report.json"
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        result = _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                      "--python-version", python, *platforms, "--only-binary=:all:",
                      f"{megarl}[test]", *binary, *extra, check=False)
        if result.returncode:
            print(result.stdout[-4000:], result.stderr[-8000:], sep="\n")
            print(f"FAIL: {args.requirements.name} and megarl's pins do not resolve for Python {python}")
            return 1
        installed = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]
                     for item in json.loads(report.read_text())["install"]}
    torch = installed["torch"]
    toolkit = next((r for r in torch.get("requires_dist", []) if _requirement_name(r) == "cuda-toolkit"), None)
    torch_cuda = re.search(r"==(\d+\.\d+)", toolkit or "")
    if not torch_cuda or torch_cuda.group(1) != base_cuda:
        print(f"FAIL: torch {torch['version']} is built for CUDA {torch_cuda and torch_cuda.group(1)}, "
              f"the Dockerfile's base image has CUDA {base_cuda}")
        return 1
    print(f"OK {len(installed)} packages resolve for CPython {python} manylinux x86_64 (torch {torch['version']}, "
          f"vllm {installed['vllm']['version']}, megatron-core {installed['megatron-core']['version']}); "
          f"torch needs CUDA {torch_cuda.group(1)} = the base image's; "
          f"{', '.join(SDIST_ONLY)} sdist found, its requirements resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
