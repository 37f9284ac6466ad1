"""Loading: HF safetensors folders and GGUF files -> ModelConfig + HF-named tensors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from qworker.model.config import LayerAttention, ModelConfig, UnsupportedModelError
from qworker.model.loading import gguf_checkpoint
from qworker.model.loading.checkpoint import load_checkpoint
from qworker.model.loading.hf_folder import hf_config
from qworker.model.loading.tensors import LoaderError, expected_shapes
from tests.gguf_writer import Q, write_gguf
from tests.quant_fixtures import KEPT, write_tiny_gguf

TINY = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).eval()


def hf_state(model: torch.nn.Module, tie: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight")
    return state


def save(model: torch.nn.Module, folder: Path, **kwargs: object) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].float(), tensor.float()), name


def edit_json(file: Path, **changes: object) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.mark.parametrize("tie", [False, True])
def test_hf_folder_roundtrip(tmp_path: Path, tie: bool) -> None:
    model = tiny_llama(tie)
    config, tensors = load_checkpoint(save(model, tmp_path))
    assert_same_tensors(tensors, hf_state(model, tie))
    assert config == ModelConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=50000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_ids=(2,),
    )


def test_hf_sharded_folder(tmp_path: Path) -> None:
    model = tiny_llama()
    save(model, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    _, tensors = load_checkpoint(tmp_path)
    assert_same_tensors(tensors, hf_state(model, tie=False))


def test_qwen2_folder_has_biases(tmp_path: Path) -> None:
    model = tiny_qwen2()
    config, tensors = load_checkpoint(save(model, tmp_path))
    assert config.arch.name == "qwen2" and config.attention_bias
    assert "model.layers.1.self_attn.k_proj.bias" in tensors
    assert_same_tensors(tensors, hf_state(model, tie=True))


def test_expected_shapes_match_transformers() -> None:
    model = tiny_qwen2()
    config = hf_config(model.config.to_dict())
    want = {k: tuple(v.shape) for k, v in hf_state(model, tie=True).items()}
    assert expected_shapes(config) == want


def test_truncated_safetensors(tmp_path: Path) -> None:
    save(tiny_llama(), tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(LoaderError) as err:
        load_checkpoint(tmp_path)
    assert str(weights) in str(err.value)
    assert "safetensors" in str(err.value)


def test_missing_shard(tmp_path: Path) -> None:
    save(tiny_llama(), tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(LoaderError, match=f"shard {shard.name} does not exist"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("change", "tensor", "want", "got"),
    [
        ({"intermediate_size": 128}, "model.layers.0.mlp.gate_proj.weight", (128, 64), (96, 64)),
        ({"hidden_size": 32}, "model.embed_tokens.weight", (101, 32), (101, 64)),
        ({"vocab_size": 100}, "model.embed_tokens.weight", (100, 64), (101, 64)),
    ],
)
def test_config_weights_mismatch(
    tmp_path: Path, change: dict[str, int], tensor: str, want: tuple[int, ...],
    got: tuple[int, ...],
) -> None:
    save(tiny_llama(), tmp_path)
    edit_json(tmp_path / "config.json", **change)
    with pytest.raises(LoaderError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "model.safetensors") in message
    assert f"{tensor!r} has shape {got}, but the config implies {want}" in message


def test_missing_tensor(tmp_path: Path) -> None:
    model = tiny_llama()
    save(model, tmp_path)
    state = hf_state(model, tie=False)
    del state["model.layers.1.post_attention_layernorm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(LoaderError, match=r"missing tensor 'model\.layers\.1\.post_attention_lay"):
        load_checkpoint(tmp_path)


def test_unexpected_tensor(tmp_path: Path) -> None:
    model = tiny_llama()
    save(model, tmp_path)
    state = hf_state(model, tie=False) | {"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(LoaderError, match=r"safetensors: unexpected tensor 'model\.layers\.2"):
        load_checkpoint(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    save(tiny_llama(), tmp_path)
    edit_json(tmp_path / "config.json", model_type="dbrx")
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(tmp_path)
    assert isinstance(err.value, LoaderError)
    assert str(tmp_path / "config.json") in str(err.value) and "'dbrx'" in str(err.value)


@pytest.mark.parametrize("other", ["BertConfig", "T5Config", "Gemma2Config"])
def test_another_kind_of_model_is_refused_for_what_it_is(tmp_path: Path, other: str) -> None:
    config = getattr(transformers, other)()
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(tmp_path)
    assert f"config.json: unsupported architecture {config.model_type!r}; supported: " in str(
        err.value)


@pytest.mark.parametrize(("fields", "windows"), [
    ({"model_type": "mistral", "sliding_window": 48}, (48, 48)),
    ({"model_type": "mistral", "sliding_window": None}, ()),
    ({"model_type": "qwen2", "sliding_window": 48, "use_sliding_window": False}, ()),
    ({"model_type": "qwen2", "sliding_window": 48, "use_sliding_window": True,
      "max_window_layers": 1}, (48,)),
    ({"model_type": "qwen2", "sliding_window": 48, "use_sliding_window": True,
      "layer_types": ["sliding_attention", "full_attention"]}, (48,)),
    ({"model_type": "gemma3_text", "sliding_window": 48, "sliding_window_pattern": 2}, (48,)),
])
def test_sliding_windows_are_read_as_transformers_reads_them(
        fields: dict[str, object], windows: tuple[int, ...]) -> None:
    config = hf_config(TINY | {"tie_word_embeddings": False} | fields)
    assert config.windows == windows
    assert config.context_length == 128  # a window hides positions; it does not cap them


GEMMA3_OLD_CONFIG = {  # as google/gemma-3-4b's text config said it before transformers 5
    "model_type": "gemma3_text", "num_hidden_layers": 7, "head_dim": 32, "sliding_window": 16,
    "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


def test_a_gemma3_config_of_either_era_is_read_as_transformers_reads_it() -> None:
    old = TINY | GEMMA3_OLD_CONFIG
    new = transformers.Gemma3TextConfig(**old).to_dict()  # rope_parameters per layer type
    assert "rope_parameters" in new and "rope_local_base_freq" not in new
    for raw in (old, new):
        config = hf_config(raw)
        assert config.arch.name == "gemma3" and config.activation == "gelu_tanh"
        assert config.tie_word_embeddings and config.attention_scale == 24**-0.5
        assert (config.rope_theta, config.rope_scaling) == (
            1e6, {"rope_type": "linear", "factor": 8.0} | ({"rope_theta": 1e6} if raw is new
                                                            else {}))
        layers = [config.attention_of(i) for i in range(7)]
        assert [a.window for a in layers] == [16] * 5 + [None, 16]
        assert [a.rope_theta for a in layers] == [10000.0] * 5 + [None, 10000.0]


@pytest.mark.parametrize(("fields", "says"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "bidirectional attention is not supported"),
])
def test_what_gemma3_runs_not_is_refused_at_the_config(fields: dict[str, object],
                                                       says: str) -> None:
    with pytest.raises(UnsupportedModelError, match=says):
        hf_config(TINY | GEMMA3_OLD_CONFIG | fields)


def test_a_multimodal_gemma3_config_is_read_for_its_text_model_as_transformers_reads_it() -> None:
    raw = {"model_type": "gemma3", "eos_token_id": [1, 106], "vision_config": {},
           "text_config": {  # google/gemma-3-4b-it's: only what differs from the defaults
               "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
               "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
               "sliding_window": 1024}}
    text = transformers.Gemma3Config(**raw).text_config
    config = hf_config(raw)
    assert config.arch.name == "gemma3" and config.eos_token_ids == (1, 106)
    assert (config.vocab_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.max_position_embeddings, config.rms_norm_eps) == (
        text.vocab_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim,
        text.max_position_embeddings, text.rms_norm_eps)
    assert config.attention_scale == text.query_pre_attn_scalar**-0.5
    assert config.rope_theta == text.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    local = text.rope_parameters["sliding_attention"]["rope_theta"]
    assert [config.attention_of(i) for i in range(34)] == [
        LayerAttention(1024, local) if kind == "sliding_attention" else LayerAttention()
        for kind in text.layer_types]


@pytest.mark.parametrize("scalar", [0, -4, "256"])
def test_an_attention_scalar_not_a_positive_number_is_refused(scalar: object) -> None:
    with pytest.raises(ValueError, match=f"query_pre_attn_scalar is {scalar!r}, not a positive"):
        hf_config(TINY | GEMMA3_OLD_CONFIG | {"query_pre_attn_scalar": scalar})


def _gemma3_metadata(path: Path, layers: int, pattern: object = None) -> Path:
    """A GGUF of Gemma 3's metadata alone (as llama.cpp's converter writes it; no tensors)."""
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_embedding_length(1152)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(6912)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(256)
    writer.add_value_length(256)
    writer.add_sliding_window(512)
    writer.add_rope_freq_base(1e6)
    if pattern is not None:
        writer.add_array("gemma3.attention.sliding_window_pattern", pattern)
    writer.add_token_list([f"t{i}" for i in range(8)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("layers", "pattern", "local"), [
    (7, None, [True] * 5 + [False, True]),  # llama.cpp's every sixth global
    (3, [True, False, True], [True, False, True]),  # a flag a layer, where the file has them
])
def test_gemma3_gguf_layers_as_llama_cpp_runs_them(
        tmp_path: Path, layers: int, pattern: object, local: list[bool]) -> None:
    path = _gemma3_metadata(tmp_path / "g.gguf", layers, pattern)
    config = gguf_checkpoint.gguf_config(gguf_checkpoint.open_gguf(path), path)
    attends = [config.attention_of(i) for i in range(layers)]
    assert [a.window for a in attends] == [512 if w else None for w in local]
    assert [a.rope_theta for a in attends] == [10000.0 if w else None for w in local]
    assert config.rope_theta == 1e6 and config.attention_scale == 256**-0.5


def test_gemma3_27b_gguf_scales_attention_by_hidden_over_heads(tmp_path: Path) -> None:
    path = _gemma3_metadata(tmp_path / "g.gguf", 62)  # llama.cpp's rule for the 62-layer 27B
    config = gguf_checkpoint.gguf_config(gguf_checkpoint.open_gguf(path), path)
    assert config.attention_scale == (1152 // 4) ** -0.5


@pytest.mark.parametrize(("fields", "says"), [
    ({"partial_rotary_factor": 0.75}, "partial rotary embeddings"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
     "rope scaling 'longrope'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope scaling 'dynamic'"),
    ({"hidden_act": "relu"}, "activation 'relu'"),
    ({"layer_types": ["full_attention", "chunked_attention"], "sliding_window": 8},
     "layer types ['chunked_attention']"),
])
def test_what_the_layers_do_not_run_is_refused_at_the_config(
        tmp_path: Path, fields: dict[str, object], says: str) -> None:
    save(tiny_llama(), tmp_path)
    edit_json(tmp_path / "config.json", **fields)
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(tmp_path)
    assert f"config.json: {says}" in str(err.value) or f"unsupported {says}" in str(err.value)


@pytest.mark.parametrize(("field", "value"), [("hidden_size", 0), ("num_hidden_layers", -1),
                                              ("vocab_size", "many"), ("num_key_value_heads", 3)])
def test_a_config_of_impossible_sizes_says_which(tmp_path: Path, field: str,
                                                 value: object) -> None:
    save(tiny_llama(), tmp_path)
    edit_json(tmp_path / "config.json", **{field: value})
    with pytest.raises(LoaderError, match="config.json: "):
        load_checkpoint(tmp_path)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match="no such file or directory"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(LoaderError, match="neither a config.json nor a .gguf"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY | {"model_type": "llama"}))
    with pytest.raises(LoaderError, match=r"no \*\.safetensors weights"):
        load_checkpoint(tmp_path)


def test_broken_config_json(tmp_path: Path) -> None:
    save(tiny_llama(), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LoaderError, match="config.json: cannot read JSON"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------
# GGUF files written here from a tiny HF model

def roundtrip(tensor: torch.Tensor, kind: Q) -> torch.Tensor:
    if tensor.ndim == 1 or kind == Q.F32:
        return tensor.float()
    if kind == Q.F16:
        return tensor.half().float()
    if kind == Q.BF16:
        return tensor.bfloat16().float()
    quantized = gguf.quants.quantize(tensor.numpy(), kind)
    return torch.from_numpy(gguf.quants.dequantize(quantized, kind))


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_llama_roundtrip(tmp_path: Path, kind: Q) -> None:
    model = tiny_llama()
    state = hf_state(model, tie=False)
    config, tensors = load_checkpoint(write_gguf(tmp_path / "tiny.gguf", model.config, state,
                                                 qtype=kind))
    assert config == hf_config(model.config.to_dict())
    assert_same_tensors(tensors, {k: roundtrip(v, kind) for k, v in state.items()})
    stored = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(kind, torch.float32)
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == stored


@pytest.mark.parametrize("kind", KEPT)
def test_native_expansion_equals_gguf_s_dequantization_bit_for_bit(
        tmp_path: Path, kind: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", kind)
    assert gguf_checkpoint.native_loaded(), "the native build is installed (make install)"
    _, native = load_checkpoint(path)
    monkeypatch.setattr(gguf_checkpoint, "native_loaded", lambda: False)
    _, reference = load_checkpoint(path)
    assert_same_tensors(native, reference)  # type: ignore[arg-type]


def test_gguf_qwen2_is_not_permuted(tmp_path: Path) -> None:
    model = tiny_qwen2()
    state = hf_state(model, tie=True)
    write_gguf(tmp_path / "qwen.gguf", model.config, state)
    config, tensors = load_checkpoint(tmp_path)  # a folder holding one .gguf
    assert config.arch.name == "qwen2" and config.attention_bias and config.tie_word_embeddings
    assert_same_tensors(tensors, state)


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    model = tiny_llama()
    path = write_gguf(tmp_path / "odd.gguf", model.config, hf_state(model, tie=False),
                      types={"model.layers.1.input_layernorm.weight": Q.I32})
    with pytest.raises(LoaderError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert str(path) in message and "'blk.1.attn_norm.weight'" in message and "I32" in message


def test_gguf_corrupt_and_ambiguous(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(LoaderError, match="bad.gguf: not a readable GGUF file"):
        load_checkpoint(bad)
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(LoaderError, match="holds 2 .gguf files"):
        load_checkpoint(tmp_path)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    model = tiny_llama()
    path = write_gguf(tmp_path / "x.gguf", model.config, hf_state(model, tie=True), arch="gemma")
    with pytest.raises(UnsupportedModelError, match="x.gguf: unsupported architecture 'gemma'"):
        load_checkpoint(path)


# ---------------------------------------------------------------------------------------------
# The real default model, against transformers' own GGUF loading


def test_smollm2_gguf_matches_transformers(smollm2_path: Path,
                                           smollm2_reference: torch.nn.Module) -> None:
    config, tensors = load_checkpoint(smollm2_path)
    reference = smollm2_reference
    hf = reference.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size
    )
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    )
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.max_position_embeddings == hf.max_position_embeddings == 8192
    assert config.tie_word_embeddings and hf.tie_word_embeddings
    assert config.bos_token_id == hf.bos_token_id
    assert config.eos_token_ids[0] == hf.eos_token_id
    want = hf_state(reference, tie=True)
    assert sorted(tensors) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(tensors[name], tensor, atol=1e-6, rtol=0, msg=name)
