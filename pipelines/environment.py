"""The environment a build ran in, as far as it can change the bytes: recorded in every manifest,
compared by `rebuild` to tell an expected difference (another kernel, GPU or library) from a
determinism bug (same fingerprint, other bytes).

Nothing that identifies a machine or a person: no host or user names, paths or timestamps.
"""
from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version

LIBRARIES = ("torch", "transformers", "safetensors", "autoawq", "auto-round", "numpy")


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in LIBRARIES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def cpu_identity() -> dict:
    """Vendor, family and model numbers (not the marketing name), and torch's vector kernel."""
    import torch

    info = {"arch": platform.machine(), "vendor": "unknown", "family": "unknown", "model": "unknown"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                field = {"vendor_id": "vendor", "cpu family": "family", "model": "model"}.get(key)
                if field and info[field] == "unknown":
                    info[field] = value
                if not line.strip():  # the first processor is enough
                    break
    except OSError:
        pass
    info["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def _nvidia_driver() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cublas_version() -> str:
    for pkg in ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12"):
        try:
            return version(pkg)
        except PackageNotFoundError:
            continue
    return "bundled with torch"


def gpu_identity(device: str) -> dict | None:
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    idx = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(idx)
    return {"name": torch.cuda.get_device_name(idx), "compute_capability": f"{major}.{minor}",
            "driver": _nvidia_driver(), "cuda": torch.version.cuda, "cublas": _cublas_version(),
            "cudnn": str(torch.backends.cudnn.version())}


def portable_cpu_attention() -> None:
    """torch's CPU flash attention packs bfloat16 for AVX512-BF16/AMX whenever the hardware has them,
    and the packing then refuses a kernel forced lower (ATEN_CPU_CAPABILITY=default or avx2 on such a
    CPU: "pack_vnni2 is only supported when avx512 is supported", torch 2.13). There, attention takes
    torch's math path instead (recorded in the fingerprint as flash_sdp: false)."""
    import torch

    bf16_units = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()  # private: absent in some builds
    if torch.backends.cpu.get_cpu_capability() != "AVX512" and bf16_units:
        torch.backends.cuda.enable_flash_sdp(False)  # the flag SDPA's backend choice reads on CPU too


def determinism_settings() -> dict:
    """Process-wide settings in force (a method that changes them for its own run records that in
    its method_details)."""
    import torch

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        "torch_compile": False,  # no stage compiles by itself; auto-round only where a profile sets enable_torch_compile (its method record)
    }


def fingerprint(device: str) -> dict:
    import torch

    return {
        "device": str(device).split(":")[0],
        "cpu": cpu_identity(),
        "gpu": gpu_identity(device),
        "threads": torch.get_num_threads(),
        "libraries": library_versions(),
        "determinism": determinism_settings(),
    }


def differences(recorded: dict, now: dict, prefix: str = "") -> list[str]:
    """'key: built with X, now Y' for every leaf that differs."""
    out = []
    for k in sorted(set(recorded) | set(now)):
        a, b = recorded.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: built with {a}, now {b}")
    return out
