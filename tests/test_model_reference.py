"""Our paged, packed decoder equals transformers' logits on tiny random checkpoints of every
family (a HF safetensors folder each)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from qworker.model.arch import ARCHITECTURES
from qworker.model.config import ModelConfig, UnsupportedModelError
from qworker.model.decoder import DecoderModel, load_model
from tests.model_harness import TEST_DEVICE, Step, run_schedule

VOCAB = 96
VARIANTS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rope_theta=500.0, tie_word_embeddings=False,
    ),
    "llama-gqa-tied": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "qwen2-bias": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, use_sliding_window=False,
    ),
    # a window wider than every test sequence: the context is capped at it, nothing else changes
    "mistral-window": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=64, tie_word_embeddings=False,
    ),
    "llama-gelu-tanh": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
    ),
}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(hash(request.param) % 1000)
    config = VARIANTS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    if getattr(config, "attention_bias", False) or config.model_type == "qwen2":
        for layer in model.model.layers:  # random biases, so a missing one shows
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return path


def reference_logits(path: Path, sequences: list[list[int]],
                     dtype: torch.dtype) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                           attn_implementation="sdpa")
    hf.to(TEST_DEVICE)  # the same device as ours: libm's cos/sin differ between CPU and GPU
    with torch.no_grad():
        return [hf(torch.tensor([s], device=TEST_DEVICE)).logits[0].cpu() for s in sequences]


def check(path: Path, dtype: torch.dtype, sequences: list[list[int]], schedule: list[Step],
          block_size: int) -> None:
    model = load_model(path, dtype=dtype, device=TEST_DEVICE)
    reference = reference_logits(path, sequences, dtype)
    results = run_schedule(model, sequences, schedule, block_size)
    assert results, "schedule produced no logits"
    for seq, pos, logits in results:
        err = (logits - reference[seq][pos]).abs().max().item()
        assert err < TOLERANCE[dtype], f"seq {seq} pos {pos}: max abs error {err:.3g}"


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_whole_prompt_then_twenty_decodes(checkpoint: Path, dtype: torch.dtype,
                                          block_size: int) -> None:
    seq = random_tokens(37 + 20, seed=1)
    schedule = [[(0, 37)]] + [[(0, 1)] for _ in range(20)]
    check(checkpoint, dtype, [seq], schedule, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill(checkpoint: Path, dtype: torch.dtype, chunk: int) -> None:
    seq = random_tokens(45, seed=2)
    sizes = [min(chunk, 45 - start) for start in range(0, 45, chunk)]
    check(checkpoint, dtype, [seq], [[(0, n)] for n in sizes], block_size=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_packed_batch_mixing_prefill_chunks_and_decodes(checkpoint: Path, dtype: torch.dtype,
                                                        block_size: int) -> None:
    lengths = [30, 19, 44, 9, 27]
    sequences = [random_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    schedule: list[Step] = [
        [(0, 12), (2, 5), (4, 20)],  # sequences 1 and 3 not started yet
        [(2, 1), (0, 1), (1, 8), (4, 1), (3, 6)],
        # the mixed step: decodes interleaved with chunks starting mid-sequence and from zero
        [(0, 1), (1, 11), (4, 1), (2, 30), (3, 1)],
        [(3, 1), (0, 16), (4, 5), (2, 8)],
    ]
    check(checkpoint, dtype, sequences, schedule, block_size)


def test_a_sliding_window_caps_the_context(checkpoint: Path) -> None:
    model = load_model(checkpoint)
    windowed = checkpoint.name.rstrip("0123456789") == "mistral-window"
    assert model.config.windows == ((64, 64) if windowed else ())
    assert model.config.context_length == (64 if windowed else 256)
    assert model.rope.cos.shape[0] == model.config.context_length


@pytest.mark.parametrize("declared", [{"post_norms": True}, {"experts": True},
                                      {"norm_offset": 1.0}, {"embed_scale": True}])
def test_a_declaration_the_layers_do_not_run_is_refused(declared: dict[str, object]) -> None:
    arch = replace(ARCHITECTURES["llama"], name="test", **declared)  # type: ignore[arg-type]
    config = ModelConfig(VOCAB, 64, 96, 1, 4, 2, 16, arch=arch)
    with pytest.raises(UnsupportedModelError, match="test: not implemented: "):
        DecoderModel(config)
