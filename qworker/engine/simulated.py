"""A simulated engine: the engine core (core.py) over a model that hashes, no torch.

Selected with `--model sim` or `--model sim:step_ms=5,max_model_len=4096,...`. Used by the service
tests and the scale-out benchmark, where what matters is the service around the engine. It
schedules, pages, preempts, paces, validates and stops exactly as the real engine, because it is
the same code; only the tokens come from elsewhere: a byte tokenizer (byte_tokenizer.py) and the
hash model (hash_runner.py).

Options (`sim:key=value,...`): step_ms (default 5), token_us (0), max_model_len (4096; the
config's max_model_len wins), eos_every (0: never), num_blocks (default 1024), block_size,
max_num_seqs, max_batched_tokens, prefill_chunk (these five override the config).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from qworker.engine.byte_tokenizer import ByteDetokenizer, ByteTokenizer
from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore, Vocabulary
from qworker.engine.hash_runner import HashRunner
from qworker.engine.request import Request

SIM_PREFIX = "sim"
DEFAULT_NUM_BLOCKS = 1024
_CONFIG_KEYS = {"num_blocks", "block_size", "max_num_seqs", "max_batched_tokens", "prefill_chunk"}


def is_simulated(model: str) -> bool:
    return model == SIM_PREFIX or model.startswith(SIM_PREFIX + ":")


@dataclass(frozen=True)
class SimOptions:
    step_ms: float = 5.0
    token_us: float = 0.0
    max_model_len: int = 4096
    eos_every: int = 0

    @classmethod
    def parse(cls, model: str) -> tuple[SimOptions, dict[str, int]]:
        """`sim:step_ms=2,num_blocks=8` -> options and engine-config overrides."""
        _, _, spec = model.partition(":")
        opts: dict[str, float | int] = {}
        overrides: dict[str, int] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"sim option {item!r}: expected key=value")
            if key in ("step_ms", "token_us"):
                opts[key] = float(value)
            elif key in ("max_model_len", "eos_every"):
                opts[key] = int(value)
            elif key in _CONFIG_KEYS:
                overrides[key] = int(value)
            else:
                raise ValueError(f"unknown sim option {key!r}")
        # each key was matched to a field of its type above, which mypy cannot follow
        return cls(**opts), overrides  # type: ignore[arg-type]


class SimulatedEngine(EngineCore):
    runner: HashRunner

    def __init__(self, config: EngineConfig, options: SimOptions | None = None) -> None:
        self.options = o = options or SimOptions()
        # a token is one byte, and a character at least one byte: 1 character per token at most
        vocab = Vocabulary(ByteTokenizer(), ByteDetokenizer, ByteTokenizer.eos_token_ids,
                           max_token_chars=1)
        runner = HashRunner(config.max_model_len or o.max_model_len, o.step_ms, o.token_us,
                            o.eos_every)
        super().__init__(config, runner, vocab, config.num_blocks or DEFAULT_NUM_BLOCKS)

    @classmethod
    def from_config(cls, config: EngineConfig) -> SimulatedEngine:
        options, overrides = SimOptions.parse(config.model)
        # the keys are _CONFIG_KEYS, all int fields; mypy checks a **dict against every field
        return cls(replace(config, **overrides), options)  # type: ignore[arg-type]


@dataclass
class OfflineResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def run_offline(engine: EngineCore, requests: Iterable[Request]) -> dict[str, OfflineResult]:
    """Run requests to completion without Redis (preempted ones are re-added with their tokens)."""
    results: dict[str, OfflineResult] = {}
    pending = {r.request_id: r for r in requests}
    for r in pending.values():
        results[r.request_id] = OfflineResult(token_ids=list(r.output_token_ids))
        engine.add(r)
    while engine.has_unfinished():
        for out in engine.step():
            res = results[out.request_id]
            if out.preempted:
                engine.add(replace(pending[out.request_id], output_token_ids=list(res.token_ids)))
                continue
            assert out.first_index == len(res.token_ids)
            res.token_ids.extend(out.new_token_ids)
            res.text += out.text_delta
            if out.finished:
                res.finish_reason = out.finish_reason
    return results
