"""Each bad model input gets one clear line and exit code 2 from `qworker generate` and `qworker
serve`, never a traceback and never a worker that starts: another kind of model, an architecture
not supported, a missing tensor, a tensor of the wrong shape, truncated, empty, text or flipped
GGUF files, a truncated safetensors file, a name that is neither a path nor a known model; and a
chat asked of a base model (no chat template) from `qworker generate`."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from structlog.testing import capture_logs

from qworker_client.cli import main
from tests.quant_fixtures import Q, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
NO_REDIS = "redis://127.0.0.1:1/0"  # never reached: the model is loaded first


def _hf_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _gguf(folder: Path, arch: str = "llama") -> Path:
    return write_tiny_gguf(folder / "m.gguf", Q.Q8_0, arch=arch)


def bert(tmp: Path) -> Path:
    (tmp / "config.json").write_text(json.dumps(transformers.BertConfig().to_dict()))
    return tmp


def gemma2_gguf(tmp: Path) -> Path:
    return _gguf(tmp, arch="gemma2")


def missing_tensor(tmp: Path) -> Path:
    folder = _hf_folder(tmp)
    state = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    del state["model.layers.1.post_attention_layernorm.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def wrong_shape(tmp: Path) -> Path:
    folder = _hf_folder(tmp)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    return folder


def _cut(path: Path, keep: int) -> Path:
    path.write_bytes(path.read_bytes()[:keep])
    return path


def truncated_gguf(tmp: Path) -> Path:
    path = _gguf(tmp)
    return _cut(path, path.stat().st_size * 2 // 3)


def truncated_gguf_header(tmp: Path) -> Path:
    return _cut(_gguf(tmp), 100)


def empty_gguf(tmp: Path) -> Path:
    path = tmp / "empty.gguf"
    path.write_bytes(b"")
    return path


def text_gguf(tmp: Path) -> Path:
    path = tmp / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n")
    return path


def flipped_gguf(tmp: Path) -> Path:
    """The version written big-endian, as a byte-swapped file has it."""
    path = _gguf(tmp)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack(">I", struct.unpack("<I", data[4:8])[0])
    path.write_bytes(bytes(data))
    return path


def truncated_safetensors(tmp: Path) -> Path:
    folder = _hf_folder(tmp)
    _cut(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size // 2)
    return folder


def no_such_model(tmp: Path) -> Path:
    return tmp / "nowhere" / "model.gguf"


def _moe_folder(folder: Path, **changes: object) -> Path:
    """A tiny Qwen3-MoE (4 experts) saved, then its config.json changed by `changes`."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | changes))
    return folder


def moe_missing_expert(tmp: Path) -> Path:
    from safetensors.torch import load_file

    folder = _moe_folder(tmp)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, folder / "model.safetensors")
    return folder


def moe_fewer_experts(tmp: Path) -> Path:
    return _moe_folder(tmp, num_local_experts=3)  # transformers >= 5 saves num_experts so


BAD: dict[str, tuple[Callable[[Path], Path], str]] = {
    "bert": (bert, "config.json: unsupported architecture 'bert'; supported: "),
    "gemma2-gguf": (gemma2_gguf, "m.gguf: unsupported architecture 'gemma2'; supported: "),
    "missing-tensor": (missing_tensor,
                       "missing tensor 'model.layers.1.post_attention_layernorm.weight'"),
    "wrong-shape": (wrong_shape, "'model.layers.0.mlp.gate_proj.weight' has shape (64, 32), "
                                 "but the config implies (96, 32)"),
    "truncated-gguf": (truncated_gguf, "m.gguf: not a readable GGUF file: tensor "),
    "truncated-gguf-header": (truncated_gguf_header, "m.gguf: not a readable GGUF file: "
                                                     "truncated"),
    "empty-gguf": (empty_gguf, "empty.gguf: not a readable GGUF file: truncated"),
    "text-gguf": (text_gguf, "notes.gguf: not a readable GGUF file: no GGUF magic"),
    "flipped-gguf": (flipped_gguf, "m.gguf: not a readable GGUF file: GGUF version 50331648"),
    "truncated-safetensors": (truncated_safetensors, "not a readable safetensors file"),
    "no-such-model": (no_such_model, "is neither an existing path nor a known model name"),
    "moe-missing-expert": (moe_missing_expert,
                           "missing tensor 'model.layers.1.mlp.experts.2.up_proj.weight'"),
    "moe-fewer-experts": (moe_fewer_experts, "unexpected tensor "
                                             "'model.layers.0.mlp.experts.3.down_proj.weight'"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_generate_says_one_line_and_exits_2(bad: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    make, says = BAD[bad]
    model = make(tmp_path)
    capsys.readouterr()  # what making it printed
    assert main(["generate", "hi", "--model", str(model), "--dtype", "float32"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("qworker generate: ") and says in err, err


@pytest.mark.parametrize("bad", sorted(BAD))
def test_serve_logs_one_error_and_exits_2_before_it_takes_a_job(
        bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qworker.service import logs

    monkeypatch.setattr(logs, "configure_logging", lambda *a, **k: None)  # the process's own
    make, says = BAD[bad]
    model = make(tmp_path)
    with capture_logs() as events:
        code = main(["serve", "--redis-url", NO_REDIS, "--model", str(model)])
    assert code == 2
    errors = [e for e in events if e["log_level"] == "error"]
    assert [e["event"] for e in errors] == ["model_not_loaded"]
    assert says in errors[0]["error"] and "\n" not in errors[0]["error"]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_real_process_prints_no_traceback(command: str, tmp_path: Path) -> None:
    model = truncated_gguf(tmp_path) if command == "serve" else bert(tmp_path)
    args = (["serve", "--redis-url", NO_REDIS] if command == "serve" else ["generate", "hi"])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'producer'}"}
    done = subprocess.run([sys.executable, "-m", "qworker_client", *args, "--model", str(model)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.splitlines()
    if command == "generate":
        assert lines == [f"qworker generate: {model / 'config.json'}: unsupported architecture "
                         "'bert'; supported: gemma3, llama, mistral, mixtral, phi3, qwen2, "
                         "qwen3, qwen3_moe"]
    else:  # structured log lines: the worker's "loading engine" and stages, then the one error
        assert [line for line in lines if '"level": "error"' in line] == lines[-1:]
        assert '"event": "model_not_loaded"' in lines[-1]
        assert "m.gguf: not a readable GGUF file" in lines[-1]


def test_a_chat_asked_of_a_base_model_is_one_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tests.gguf_writer import write_gguf
    from tests.test_model_reference import hf_model

    gemma = hf_model("gemma3", seed=1)  # a Gemma 3 GGUF with no tokenizer.chat_template
    state = {k: v for k, v in gemma.state_dict().items() if k != "lm_head.weight"}
    path = write_gguf(tmp_path / "base.gguf", gemma.config, state)
    assert main(["generate", "--chat", "hi", "--model", str(path), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("qworker generate: ")
    assert "base.gguf: the model has no chat template (a base model)" in err
