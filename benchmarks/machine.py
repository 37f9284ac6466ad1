"""What every benchmark's JSON says about the machine it ran on: the CPU, the flags that choose
kernels, the native build loaded and the kernel family asked for."""

from __future__ import annotations

import os

import torch

from qworker.model.kernels import native
from qworker.model.kernels import native_build as nb

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def machine_info() -> dict[str, object]:
    have = nb.cpu_flags()
    status = native.status()
    return {"cpu": nb.cpu_model(), "cpu_flags": [f for f in FLAGS if f in have],
            "native": status.level or f"none: {status.reason}",
            "kernels": os.environ.get("QWORKER_KERNELS", "auto"),
            "torch_threads": torch.get_num_threads()}
