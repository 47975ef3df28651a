"""`make gpu-kit`: the wheels a bare GPU machine lacks for `tools/gpu_check.py --quick`, in
`.gpu-kit/` (ignored by git), with the one command line that installs them and runs the check.

The bare machine (docs/GPU.md) has Python 3.12, a CUDA PyTorch, Triton, numpy, transformers and
einops, no network, and receives at most 64 MiB of files. What the check imports beyond that:
megatron-core (the model, schedules and the patched hooks; its compiled helper is per Python
version, hence `--python-version 3.12`) and fla-core (Megatron's GatedDeltaNet kernels, pure
Python + Triton). Transformer Engine, flash-attn and mamba-ssm ship as source only (a build does
not fit the time) and torch is never downloaded. Wheels are fetched with
`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform ...` and installed
there by unpacking them into a private directory on PYTHONPATH (pure packages plus
.dist-info), so nothing else is pulled or replaced.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

KIT = (("megatron-core", "0.19.2"), ("fla-core", "0.5.2"))
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux2014_x86_64", "any")
LIMIT_MIB = 64
SITE = "/tmp/prefix-reuse-kit"
COMMAND = ("python3 -c \"import glob, zipfile; [zipfile.ZipFile(w).extractall('" + SITE + "') "
           "for w in glob.glob('.gpu-kit/wheels/*.whl')]\" && "
           f"export PYTHONPATH={SITE}:$PWD && python3 -m megatron_patches apply && "
           "python3 tools/gpu_check.py --quick --budget-s 360 --json ${OUT:-.}/gpu_quick.json")
"""Run from the repository root with .gpu-kit carried; the JSON goes to $OUT (or here). The
wheels are unpacked, not pip-installed (a bare Python may lack pip): build() checks that each
holds only its packages and its .dist-info (no .data tree a plain unpack would misplace)."""


def pip_download(requirement: str, dest: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON, *platforms, "-d", str(dest), requirement], check=True)


def build(kit: Path, download=pip_download) -> dict:
    """Download every wheel of KIT into kit/wheels, check the size, write kit/COMMAND.txt.
    ValueError (before writing the command) when the kit exceeds LIMIT_MIB."""
    wheels = kit / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for name, version in KIT:
        download(f"{name}=={version}", wheels)
    files = sorted(wheels.glob("*.whl"))
    wanted = {name.replace("-", "_") for name, _ in KIT}
    found = {f.name.split("-")[0].lower() for f in files}
    if not wanted <= found:
        raise ValueError(f"missing wheels for {sorted(wanted - found)} in {wheels}")
    for f in files:
        with zipfile.ZipFile(f) as wheel:
            data = [n for n in wheel.namelist() if n.split("/")[0].endswith(".data")]
        if data:
            raise ValueError(f"{f.name} has a .data tree ({data[0]} ...): unpacking would not install it")
    size = sum(f.stat().st_size for f in files)
    if size > LIMIT_MIB * 2**20:
        raise ValueError(f"the kit is {size / 2**20:.1f} MiB, over the {LIMIT_MIB} MiB a GPU call "
                         f"carries: {[f.name for f in files]}")
    (kit / "COMMAND.txt").write_text(COMMAND + "\n")
    return dict(wheels=[f.name for f in files], mib=size / 2**20, command=COMMAND)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kit", type=Path, default=Path(".gpu-kit"))
    args = parser.parse_args(argv)
    result = build(args.kit)
    print(f"{args.kit}: {len(result['wheels'])} wheels, {result['mib']:.1f} MiB "
          f"(limit {LIMIT_MIB}): {', '.join(result['wheels'])}")
    print("on the GPU machine, from the repository root with .gpu-kit carried:")
    print(result["command"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
