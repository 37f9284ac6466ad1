"""Architectures: one small file each, declaring how a family differs from Llama (architecture.py).
A family is supported once it is in ARCHITECTURES."""

from qworker.model.arch.architecture import Architecture
from qworker.model.arch.gemma3 import GEMMA3
from qworker.model.arch.llama import LLAMA
from qworker.model.arch.mistral import MISTRAL
from qworker.model.arch.mixtral import MIXTRAL
from qworker.model.arch.phi3 import PHI3
from qworker.model.arch.qwen2 import QWEN2
from qworker.model.arch.qwen3 import QWEN3
from qworker.model.arch.qwen3_moe import QWEN3_MOE

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3)}
ARCHITECTURES[QWEN3_MOE.name] = QWEN3_MOE
ARCHITECTURES[MIXTRAL.name] = MIXTRAL
# HF `model_type` by a GGUF's `general.architecture`, where llama.cpp names the family otherwise
GGUF_NAMES = {"qwen3moe": QWEN3_MOE.name}
# a GGUF family whose files with experts (`<arch>.expert_count`) are another family's
GGUF_WITH_EXPERTS = {"llama": MIXTRAL.name}
ARCHITECTURES[GEMMA3.name] = GEMMA3
