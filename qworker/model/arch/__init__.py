"""Architectures: one small file each, declaring how a family differs from Llama (architecture.py).
A family is supported once it is in ARCHITECTURES."""

from qworker.model.arch.architecture import Architecture
from qworker.model.arch.gemma3 import GEMMA3
from qworker.model.arch.llama import LLAMA
from qworker.model.arch.mistral import MISTRAL
from qworker.model.arch.phi3 import PHI3
from qworker.model.arch.qwen2 import QWEN2
from qworker.model.arch.qwen3 import QWEN3

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3)}
ARCHITECTURES[GEMMA3.name] = GEMMA3
