"""Quality of the quantized kernels: teacher-forced logits of a GGUF kept quantized against the
same file dequantized to float32, over the reference chats (tests/test_model_smollm2.py's).

    .venv/bin/python -m benchmarks.quant_quality [--model smollm2] [--new-tokens 48]
        [--dtype float32|bfloat16]

The float32 model answers each chat greedily; prompt and answer are then run through both models
in one prefill each, and every position's next-token distribution is compared: top-1 agreement
(target >= 99%) and the mean KL divergence KL(float32 || quantized), with the kernels the
measured choice runs for such a prefill (`top1_agreement`), then with every layer forced onto one
kernel (`by_setting`: "int16" is what a decode step of a few rows runs, "int8" llama.cpp's 8-bit
activations). With `--dtype bfloat16` the kept model runs in bfloat16 (the reference stays
float32) and the bfloat16 model's own kernels are forced too: "bf16x8" (weights and
activations rounded to bfloat16) and "int8x8" (the K-quants on 8-bit activations, the other
formats on bf16x8). Both greedy answers are printed. One JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch

from benchmarks.machine import machine_info
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import SamplingParams
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.kernels.kernel_choice import BUCKETS
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.kv_cache import KVCache
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]


def all_logits(model: DecoderModel, tokens: list[int]) -> torch.Tensor:
    """float32 logits at every position of one prefill."""
    block = 128
    blocks = list(range(-(-len(tokens) // block)))
    cache = KVCache.allocate(model.config, len(blocks), block, model.dtype, model.device)
    batch = build_batch([SequenceInput(tokens, 0, blocks, need_logits=True)], block, model.device)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(tokens)))
    return model(batch, cache).float()


# every layer on one kernel, whatever the bucket: "int16" is what a decode step of a few rows
# runs; "int8" (8-bit activations, llama.cpp's scheme) is never chosen, forced here to compare;
# "int8, gate_up int16" puts the MLP's input projection alone on 16-bit activations
SETTINGS: dict[str, Callable[[str], str]] = {
    "int16": lambda name: "int16",
    "int8": lambda name: "int8",
    "dequant": lambda name: "dequant",
    "int8, gate_up int16": lambda name: "int16" if name.endswith("gate_up_proj") else "int8",
}
BF16_SETTINGS: dict[str, Callable[[str], str]] = {  # after SETTINGS: these repack to x8
    "bf16x8": lambda name: "bf16x8",
    "int8x8": lambda name: "int8x8",
}


def forced(model: DecoderModel, pick: Callable[[str], str]) -> DecoderModel:
    """The model with each quantized layer on pick(its name) at every bucket (int8x8's formats
    aside on bf16x8; its own first kernel where it has not that one)."""
    for name, layer in model.named_modules():
        if isinstance(layer, QuantLinear):
            wanted = (pick(name), *(("bf16x8",) if pick(name) == "int8x8" else ()))
            kind = next((k for k in wanted if k in layer.runnable()), layer.kernels()[0])
            layer.set_choice((kind,) * len(BUCKETS))
    model.decode_graph.reset()
    return model


def agreement(model: DecoderModel, sequences: list[list[int]],
              refs: list[torch.Tensor]) -> tuple[float, float]:
    """(top-1 agreement with refs, mean KL(ref || model)) over every position."""
    agree = positions = 0
    kl_sum = 0.0
    for tokens, ref in zip(sequences, refs, strict=True):
        got = all_logits(model, tokens)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        positions += len(tokens)
        log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
        kl_sum += float((log_p.exp() * (log_p - log_q)).sum())
    return round(agree / positions, 4), float(f"{kl_sum / positions:.3g}")


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    return [c.token_ids for c in engine.generate(prompts, params)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the kept model's (the reference is float32)")
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    tokenizer = Tokenizer.load(path)
    dtypes = {"float32": torch.float32, "quantized": getattr(torch, args.dtype)}
    models = {w: load_model(path, dtype=dtypes[w], weights=w) for w in ("float32", "quantized")}
    engines = {w: Engine(m, tokenizer, EngineConfig(max_num_seqs=4, kv_cache_gb=0.1))
               for w, m in models.items()}
    for engine in engines.values():
        engine.warm_up()
    prompts = [tokenizer.encode_chat(chat) for chat in CHATS]
    answers = {w: greedy(e, prompts, args.new_tokens) for w, e in engines.items()}
    sequences = [p + a for p, a in zip(prompts, answers["float32"], strict=True)]
    refs = [all_logits(models["float32"], tokens) for tokens in sequences]
    quant = models["quantized"]
    measured = agreement(quant, sequences, refs)  # the kernels the prefill's bucket chose
    kernels = quant.kernel_report()  # before `forced` changes them
    by_setting = {}
    settings = SETTINGS | (BF16_SETTINGS if args.dtype == "bfloat16" else {})
    for name, pick in settings.items():
        by_setting[name] = agreement(forced(quant, pick), sequences, refs)
    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "weights": quant.weights_kept(), **machine_info(),
        "positions": sum(len(t) for t in sequences), "top1_agreement": measured[0],
        "mean_kl": measured[1], "kernels": kernels,
        "by_setting": {name: {"top1_agreement": a, "mean_kl": kl}
                       for name, (a, kl) in by_setting.items()},
        "greedy": [{"float32": tokenizer.decode(a), "quantized": tokenizer.decode(b)}
                   for a, b in zip(answers["float32"], answers["quantized"], strict=True)],
    }))


if __name__ == "__main__":
    main()
