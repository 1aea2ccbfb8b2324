"""What this Python can run: torch build, CUDA, GPUs, and which of the trainer's modules are missing.

    python bench/gpu_check/probe.py [--output env.json] [--mode gpu|cpu]

Standard library only (plus torch when it imports), because it runs before anything is installed.
Prints `key=value` lines for bench/gpu_check.sh and, with --output, writes the same facts (and the GPU
names) as JSON for bench/gpu_summary.py.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import socket
import sys
from pathlib import Path

# Modules the trainer imports beyond the standard library and torch (`python -m trainer` imports all of
# them at start; safetensors when it loads or exports a Hugging Face directory), and the wheels that
# provide them (bench/gpu_check.sh --fetch-wheels downloads these and their dependencies).
TRAINER_MODULES = {"pydantic": "pydantic", "yaml": "PyYAML", "numpy": "numpy", "tensorboardX": "tensorboardX",
                   "boto3": "boto3", "botocore": "botocore", "jinja2": "jinja2", "tokenizers": "tokenizers",
                   "safetensors": "safetensors"}


def probe() -> dict:
    facts: dict = {"python": sys.version.split()[0], "python_executable": sys.executable,
                   "platform": platform.platform(), "hostname": socket.gethostname(),
                   "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   "missing_modules": [m for m in TRAINER_MODULES if importlib.util.find_spec(m) is None]}
    try:
        import torch
    except ImportError as e:
        facts.update(torch_version=None, torch_error=str(e), cuda_version=None, cuda_available=False,
                     gpu_count=0, gpu_names=[])
        return facts
    cuda_available = bool(torch.version.cuda) and torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda_available else 0
    facts.update(torch_version=torch.__version__, torch_path=str(Path(torch.__file__).parent),
                 cuda_version=torch.version.cuda, cuda_available=cuda_available, gpu_count=count,
                 gpu_names=[torch.cuda.get_device_name(i) for i in range(count)],
                 gpu_memory_bytes=[torch.cuda.get_device_properties(i).total_memory for i in range(count)])
    if cuda_available:
        nccl = getattr(torch.cuda, "nccl", None)
        try:
            version = nccl.version() if nccl else None
            facts["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
        except Exception:
            facts["nccl_version"] = None
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--output", type=Path, help="write the facts as JSON here")
    parser.add_argument("--mode", choices=["gpu", "cpu"], help="recorded in the JSON: the check's mode")
    args = parser.parse_args(argv)
    facts = probe()
    if args.mode:
        facts["mode"] = args.mode
    for key in ("torch_version", "cuda_version", "cuda_available", "gpu_count"):
        print(f"{key}={'' if facts[key] is None else facts[key]}")
    print(f"gpu_name={facts['gpu_names'][0] if facts['gpu_names'] else ''}")
    print(f"missing={','.join(facts['missing_modules'])}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(facts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
