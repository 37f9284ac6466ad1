"""Our paged, packed decoder equals transformers' logits on tiny random checkpoints of every
family (a HF safetensors folder each)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from qworker.model.arch import ARCHITECTURES
from qworker.model.decoder import load_model
from qworker.model.kernels import native
from tests.gguf_writer import write_gguf
from tests.model_harness import (
    RUNNABLE_FAMILIES,
    TEST_DEVICE,
    Step,
    greedy,
    kernel_family,
    run_schedule,
)

VOCAB = 96
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
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
    # a window wider than every test sequence: it hides nothing (the decode graph serves it)
    "mistral-window": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=64, tie_word_embeddings=False,
    ),
    # a window shorter than the test sequences: every layer sees only its last 16 positions
    "mistral-short-window": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=16, tie_word_embeddings=False,
    ),
    # 7 layers: 5 local (window 8, base 10000), the 6th global (base 1e6), a 7th local; the
    # attention scale of head_dim 256 (transformers' GGUF reader assumes that too)
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256, max_position_embeddings=256,
        sliding_window=8,
    ),
    # its own attention scale and a linear RoPE scaling of the global layers (Gemma 3 4B+)
    "gemma3-scaled": lambda: transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=8, query_pre_attn_scalar=24,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "qwen3": lambda: transformers.Qwen3Config(  # q/k norms; head_dim 128, not hidden / heads
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "phi3": lambda: transformers.Phi3Config(  # q/k/v and gate/up stored fused
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    # Llama 3's RoPE scaling, over a short original context so that it moves most frequencies
    "llama3-rope": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE,
    ),
    # routed experts, top 2 of 8 normalized, layer 1 dense (mlp_only_layers); q/k norms as Qwen3
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    # every second layer sparse (decoder_sparse_step), weights not renormalized, tied, GQA 4:1
    "qwen3-moe-step": lambda: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, num_experts=6,
        num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
        max_position_embeddings=256, tie_word_embeddings=True,
    ),
    # routed experts in every layer, always normalized; no q/k norms (Mixtral's own names)
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "llama-gelu-tanh": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
    ),
}
# each architecture's variant for the tests that run one of each (every supported one has one)
OF_ARCHITECTURE = {"llama": "llama-gqa-tied", "mistral": "mistral-window", "qwen2": "qwen2-bias",
                   "qwen3": "qwen3", "phi3": "phi3"}
OF_ARCHITECTURE["qwen3_moe"] = "qwen3-moe"
OF_ARCHITECTURE["mixtral"] = "mixtral"
OF_ARCHITECTURE["gemma3"] = "gemma3"
HF_FAMILIES = {"gemma3_text": "gemma3"}  # HF model_types named otherwise in ARCHITECTURES
WINDOWS = {"mistral-window": (64,) * 2, "mistral-short-window": (16,) * 2, "gemma3": (8,) * 6,
           "gemma3-scaled": (8,) * 6}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}


def hf_model(variant: str, seed: int) -> transformers.PreTrainedModel:
    """The variant's model with random weights, biases and norms (so a missing or misplaced one
    shows)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant]())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
            elif "norm" in name:  # Gemma's scale by 1 + w
                param.uniform_(0.5, 1.5).sub_(1.0 if model.config.model_type == "gemma3_text"
                                              else 0.0)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = hf_model(request.param, seed=sorted(VARIANTS).index(request.param))
    path = tmp_path_factory.mktemp(request.param) / request.param  # named as the variant
    model.save_pretrained(path, safe_serialization=True)
    return path


def reference_logits(path: Path, sequences: list[list[int]],
                     dtype: torch.dtype) -> list[torch.Tensor]:
    # experts: transformers' own loop (its default, grouped_mm, takes no float64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                           attn_implementation="sdpa",
                                                           experts_implementation="eager")
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


def test_sliding_windows_are_read_and_do_not_cap_the_context(checkpoint: Path) -> None:
    model = load_model(checkpoint)
    variant = checkpoint.name
    assert model.config.windows == WINDOWS.get(variant, ())
    assert model.config.context_length == 256 == model.rope.cos.shape[0]
    if variant.startswith("gemma3"):  # local layers on their own base, unscaled
        local, global_ = model.config.attention_of(0), model.config.attention_of(5)
        assert (local.rope_theta, global_.rope_theta, global_.window) == (10000.0, None, None)
        assert model.config.rope_theta == 1e6
        assert sorted(model.layer_ropes) == [10000.0]


def test_every_supported_architecture_has_a_variant() -> None:
    assert set(OF_ARCHITECTURE) == set(ARCHITECTURES)
    assert all(HF_FAMILIES.get(VARIANTS[v]().model_type, VARIANTS[v]().model_type) == arch
               for arch, v in OF_ARCHITECTURE.items())


def test_a_multimodal_gemma3_folder_runs_its_text_model(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration folder (a vision tower beside the text model): its text
    model loaded, logits those of transformers on text alone."""
    text = VARIANTS["gemma3"]().to_dict()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=7)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                       boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    torch.manual_seed(5)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                param.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    text_only = VOCAB - 3  # below the image tokens
    sequences = [[t % text_only for t in random_tokens(n, seed=30 + n)] for n in (19, 26)]
    schedule: list[Step] = [[(0, 11), (1, 20)]] + [[(0, 1), (1, 1)] for _ in range(6)]
    results = run_schedule(model, sequences, schedule, block_size=4)
    with torch.no_grad():
        reference = [hf(input_ids=torch.tensor([s])).logits[0] for s in sequences]
    for seq, pos, logits in results:
        err = (logits - reference[seq][pos]).abs().max().item()
        assert err < FAMILY_TOLERANCE, f"seq {seq} pos {pos}: max abs error {err:.3g}"


def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


FAMILY_TOLERANCE = 1e-4  # float32 logits: a native GEMM adds in another order than torch's
# transformers' GGUF reader cannot read our Qwen3-MoE file: it leaves `expert_feed_forward_length`
# unread (moe_intermediate_size stays its default) and a GGUF cannot say mlp_only_layers; it reads
# llama.cpp's Mixtral (`llama` with experts) as a Llama. The float32 GGUF holds the original's
# weights exactly, so the original is the reference there.
NO_GGUF_REFERENCE = {"qwen3_moe", "mixtral"}


@pytest.mark.parametrize("family", RUNNABLE_FAMILIES)
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("arch", sorted(OF_ARCHITECTURE))
def test_each_architecture_from_each_source_on_each_kernel_family(
        arch: str, source: str, family: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Teacher-forced logits within FAMILY_TOLERANCE of transformers' on the same file (a GGUF
    read by transformers' own GGUF loader where it reads the file), greedy tokens identical, and
    on a native family the decode steps through the decode graph where it runs the model."""
    variant = OF_ARCHITECTURE[arch]
    original = hf_model(variant, seed=len(arch))
    if source == "gguf":
        state = {k: v for k, v in original.state_dict().items()
                 if not (k == "lm_head.weight" and original.config.tie_word_embeddings)}
        write_gguf(tmp_path / "m.gguf", original.config, state)
        path = tmp_path / "m.gguf"
        hf = original if arch in NO_GGUF_REFERENCE else (
            transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval())
    else:
        original.save_pretrained(tmp_path, safe_serialization=True)
        path, hf = tmp_path, original
    sequences = [random_tokens(n, seed=20 + n) for n in (23, 30)]
    schedule: list[Step] = [[(0, 15), (1, 22)]] + [[(0, 1), (1, 1)] for _ in range(8)]
    calls: list[int] = []
    with kernel_family(family):
        real = native.decode_step
        monkeypatch.setattr(native, "decode_step",
                            lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
        model = load_model(path, dtype=torch.float32)
        results = run_schedule(model, sequences, schedule, block_size=4)
        ours = greedy(model, sequences[0][:9], 10)
    # every architecture runs its decode steps in the graph where a native family runs (routed
    # experts too: test_decode_graph_experts)
    graph = family != "torch" and model.decode_graph.refused is None
    assert calls == ([2] * 8 + [1] * 9 if graph else [])  # greedy: a prefill first
    with torch.no_grad():
        reference = [hf(torch.tensor([s])).logits[0] for s in sequences]
    for seq, pos, logits in results:
        err = (logits - reference[seq][pos]).abs().max().item()
        assert err < FAMILY_TOLERANCE, f"seq {seq} pos {pos}: max abs error {err:.3g}"
    assert ours == _hf_greedy(hf, sequences[0][:9], 10)


def test_llama3_rope_from_a_gguf_as_llama_cpp_stores_it(tmp_path: Path) -> None:
    """Llama 3's RoPE scaling arrives in a GGUF as `rope_freqs.weight`, each frequency's divisor:
    the logits equal transformers' on the original weights, which without the scaling differ."""
    original = hf_model("llama3-rope", seed=3)
    state = {k: v for k, v in original.state_dict().items() if k != "lm_head.weight"}
    path = write_gguf(tmp_path / "m.gguf", original.config, state)
    model = load_model(path, dtype=torch.float32)
    assert model.config.rope_scaling is not None
    assert model.config.rope_scaling["rope_type"] == "freq_factors"
    sequences = [random_tokens(n, seed=40 + n) for n in (40, 33)]
    schedule: list[Step] = [[(0, 20), (1, 33)]] + [[(0, 1)] for _ in range(20)]
    unscaled = transformers.AutoModelForCausalLM.from_config(
        replace_rope(original.config, {"rope_type": "default", "rope_theta": 10000.0}))
    unscaled.load_state_dict(original.state_dict())
    with torch.no_grad():
        reference = [original(torch.tensor([s])).logits[0] for s in sequences]
        plain = [unscaled.eval()(torch.tensor([s])).logits[0] for s in sequences]
    moved = max((r - p).abs().max().item() for r, p in zip(reference, plain, strict=True))
    assert moved > 10 * FAMILY_TOLERANCE  # the scaling shows far above the tolerance
    for seq, pos, logits in run_schedule(model, sequences, schedule, block_size=4):
        err = (logits - reference[seq][pos]).abs().max().item()
        assert err < FAMILY_TOLERANCE, f"seq {seq} pos {pos}: max abs error {err:.3g}"


def replace_rope(config: transformers.PretrainedConfig,
                 rope: dict[str, object]) -> transformers.PretrainedConfig:
    copy = config.__class__.from_dict(config.to_dict())
    copy.rope_parameters = rope
    return copy
