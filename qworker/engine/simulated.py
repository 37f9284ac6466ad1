"""A simulated engine: the real engine's interface and scheduling rules, no model, no torch.

Selected with `--model sim` or `--model sim:step_ms=5,max_model_len=4096,...`. Used by the service
tests and the scale-out benchmark, where what matters is the service around the engine.

- Tokenizer: bytes. A token is a byte value (vocab 256); decode is UTF-8 with errors replaced.
  Chat messages render as `<role>: <content>\\n` lines followed by `assistant: `.
- "Model": the next token is a hash of all tokens before it (prompt and output) and the job's seed,
  mapped to printable ASCII. So a text is a pure function of the request: a job resumed after
  preemption or on another worker continues exactly as an uninterrupted run.
- Scheduling as in DESIGN §4: `max_num_seqs`, a token budget (`max_batched_tokens`) for prefill
  chunks of at most `prefill_chunk`, a KV block pool (`num_blocks` x `block_size`, watermark at
  admission), preemption of the newest running sequence when a running one needs a block and none
  is free. With `requeue_preempted` the preempted request is handed back (`preempted=True`) and
  forgotten; otherwise it waits again and is recomputed (prompt + generated tokens).
- Time: every step that has work sleeps `step_ms` (+ `token_us` per computed token).

Options (`sim:key=value,...`): step_ms (default 5), token_us (0), max_model_len (4096),
eos_every (0: never; N: a token is EOS, id 0, when its hash is divisible by N), num_blocks,
block_size, max_num_seqs, max_batched_tokens, prefill_chunk (these four override the config).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from qworker.engine.config import EngineConfig
from qworker.engine.request import Request, StepOutput
from qworker.engine.validation import ModelLimits, check_prompt_chars, check_request

_MASK = (1 << 64) - 1
_FNV_PRIME = 0x100000001B3
_FNV_OFFSET = 0xCBF29CE484222325
EOS_TOKEN_ID = 0
VOCAB_SIZE = 256
SIM_PREFIX = "sim"


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
        config_keys = {"num_blocks", "block_size", "max_num_seqs", "max_batched_tokens",
                       "prefill_chunk"}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"sim option {item!r}: expected key=value")
            if key in ("step_ms", "token_us"):
                opts[key] = float(value)
            elif key in ("max_model_len", "eos_every"):
                opts[key] = int(value)
            elif key in config_keys:
                overrides[key] = int(value)
            else:
                raise ValueError(f"unknown sim option {key!r}")
        return cls(**opts), overrides  # type: ignore[arg-type]


class ByteTokenizer:
    """Token = byte value. Round-trips any UTF-8 text."""

    vocab_size = VOCAB_SIZE
    eos_token_id = EOS_TOKEN_ID

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages: Iterable[object]) -> str:
        lines = []
        for m in messages:
            role = m["role"] if isinstance(m, dict) else m.role  # type: ignore[attr-defined]
            content = m["content"] if isinstance(m, dict) else m.content  # type: ignore[attr-defined]
            lines.append(f"{role}: {content}\n")
        return "".join(lines) + "assistant: "

    def encode_chat(self, messages: Iterable[object]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _mix(h: int) -> int:
    """splitmix64 finalizer: spreads a rolling hash over all bits."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 31)


@dataclass(eq=False)  # identity: compared in list membership every step
class _Seq:
    request: Request
    arrival: int
    tokens: list[int]  # prompt + generated (including replayed ones)
    num_prompt: int
    computed: int = 0  # tokens whose (simulated) KV is in the cache
    state: int = _FNV_OFFSET  # rolling hash over computed tokens
    blocks: int = 0
    emitted_chars: int = 0  # text already handed out
    sampled_this_run: bool = False
    isolated: bool = False  # runs alone in its steps until it samples a token (Request.isolate)

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def prefilling(self) -> bool:
        return not self.sampled_this_run


class SimulatedEngine:
    """Pure-Python engine with the real engine's interface (see module docstring)."""

    def __init__(self, config: EngineConfig, options: SimOptions | None = None) -> None:
        self.config = config
        self.options = options or SimOptions()
        self.tokenizer = ByteTokenizer()
        self.max_model_len = config.max_model_len or self.options.max_model_len
        self.num_blocks = config.num_blocks or 1024
        self.block_size = config.block_size
        self._watermark_blocks = int(config.watermark * self.num_blocks)
        # a token is one byte, and a character at least one byte: 1 character per token at most
        self.limits = ModelLimits(VOCAB_SIZE, self.max_model_len,
                                  self.num_blocks * self.block_size, max_token_chars=1)
        self._free_blocks = self.num_blocks
        self._running: list[_Seq] = []  # admission order: the last one is the newest
        self._waiting: list[_Seq] = []
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_steps = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> SimulatedEngine:
        options, overrides = SimOptions.parse(config.model)
        return cls(replace(config, **overrides), options)

    # ------------------------------------------------------------------ interface

    def add(self, request: Request) -> None:
        ids = request.prompt_token_ids
        check_request(request, self.limits)
        if self._find(request.request_id) is not None:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        self._arrivals += 1
        seq = _Seq(request, self._arrivals, list(ids) + list(request.output_token_ids), len(ids),
                   isolated=request.isolate)
        seq.emitted_chars = self._emittable(seq, seq.outputs)[1]
        self._waiting.append(seq)
        self._waiting.sort(key=lambda s: (s.request.priority, s.arrival))

    def check_prompt_text(self, text: str) -> None:
        """Before tokenizing: rejects a text that cannot fit whatever its tokens."""
        check_prompt_chars(len(text), self.limits)

    def abort(self, request_id: str) -> None:
        seq = self._find(request_id)
        if seq is None:
            return
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release(seq)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def kernel_report(self) -> dict[str, str]:
        return {"native": "none: simulated engine"}

    def free_slots(self) -> int:
        slots = self.config.max_num_seqs - len(self._running) - len(self._waiting)
        reserved = sum(self._blocks_for(min(len(s.tokens), self.config.prefill_chunk))
                       for s in self._waiting)
        if self._free_blocks - reserved <= self._watermark_blocks:
            return 0
        return max(0, slots)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        return self._free_blocks

    def stats(self) -> dict[str, int]:
        """Gauges for the service's metrics (the real engine's `stats()` has the same keys).
        `batch_seqs` is the running batch: every running sequence takes part in a step unless
        the step's prefill budget ran out."""
        return {"running": len(self._running), "waiting": len(self._waiting),
                "blocks_free": self._free_blocks, "blocks_total": self.num_blocks,
                "batch_seqs": len(self._running)}

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        scheduled = self._schedule(outputs)
        if not scheduled:
            return outputs
        self.num_steps += 1
        computed = sum(work for _, work in scheduled)
        time.sleep((self.options.step_ms + self.options.token_us * computed / 1000) / 1000)
        for seq, work in scheduled:
            out = self._advance(seq, work)
            if out is not None:
                outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ scheduling

    def _schedule(self, outputs: list[StepOutput]) -> list[tuple[_Seq, int]]:
        alone = self._schedule_alone(outputs)
        scheduled = self._schedule_batch(outputs) if alone is None else alone
        assert len(scheduled) == 1 or not any(s.isolated for s, _ in scheduled), \
            "an isolated sequence shares a step"
        return scheduled

    def _schedule_alone(self, outputs: list[StepOutput]) -> list[tuple[_Seq, int]] | None:
        """As the real scheduler: an isolated sequence that runs, or may start, steps alone."""
        budget = self.config.max_batched_tokens
        seq = next((s for s in self._running if s.isolated), None)
        if seq is None:
            if not self._waiting or not self._waiting[0].isolated \
                    or len(self._running) >= self.config.max_num_seqs:
                return None
            seq = self._waiting[0]
            need = self._blocks_for(len(seq.tokens)) - seq.blocks  # its whole prefill
            if need > self._free_blocks - (self._watermark_blocks if self._running else 0):
                return None
            self._running.append(self._waiting.pop(0))
        work = self._work(seq, budget)
        return [(seq, work)] if self._reserve(seq, work, outputs) else []

    def _schedule_batch(self, outputs: list[StepOutput]) -> list[tuple[_Seq, int]]:
        scheduled: list[tuple[_Seq, int]] = []
        budget = self.config.max_batched_tokens
        for seq in list(self._running):
            if seq not in self._running:
                continue  # preempted for an older one
            work = self._work(seq, budget)
            if work == 0:
                continue
            if not self._reserve(seq, work, outputs):
                continue
            scheduled.append((seq, work))
            if seq.prefilling:
                budget -= work
        while self._waiting and len(self._running) < self.config.max_num_seqs and budget > 0:
            seq = self._waiting[0]
            if seq.isolated:
                break  # it starts alone, in a step of its own
            work = self._work(seq, budget)
            need = self._blocks_for(seq.computed + work) - seq.blocks
            watermark = self._watermark_blocks if self._running else 0
            if need > self._free_blocks - watermark:
                break
            self._waiting.pop(0)
            self._running.append(seq)
            self._allocate(seq, need)
            scheduled.append((seq, work))
            budget -= work
        return scheduled

    def _work(self, seq: _Seq, budget: int) -> int:
        remaining = len(seq.tokens) - seq.computed
        if not seq.prefilling:
            return remaining
        return max(0, min(remaining, self.config.prefill_chunk, budget))

    def _reserve(self, seq: _Seq, work: int, outputs: list[StepOutput]) -> bool:
        """Blocks for `work` more tokens of a running seq, preempting the newest ones if needed."""
        need = self._blocks_for(seq.computed + work) - seq.blocks
        while need > self._free_blocks:
            victim = self._running[-1]
            if victim is seq and len(self._running) == 1:
                # alone and still out of blocks: it can never grow, end it here
                self._running.remove(seq)
                self._release(seq)
                outputs.append(self._finish(seq, "length", flush=False))
                return False
            self._preempt(victim, outputs)
            if victim is seq:
                return False
        self._allocate(seq, need)
        return True

    def _preempt(self, seq: _Seq, outputs: list[StepOutput]) -> None:
        self.num_preemptions += 1
        self._running.remove(seq)
        self._release(seq)
        if self.config.requeue_preempted:
            outputs.append(StepOutput(seq.rid, [], first_index=len(seq.outputs), preempted=True,
                                      num_prompt_tokens=seq.num_prompt))
            return
        seq.computed, seq.state, seq.sampled_this_run = 0, _FNV_OFFSET, False
        self._waiting.insert(0, seq)

    def _allocate(self, seq: _Seq, n: int) -> None:
        if n > 0:
            self._free_blocks -= n
            seq.blocks += n

    def _release(self, seq: _Seq) -> None:
        self._free_blocks += seq.blocks
        seq.blocks = 0

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ "model"

    def _advance(self, seq: _Seq, work: int) -> StepOutput | None:
        for tok in seq.tokens[seq.computed:seq.computed + work]:
            seq.state = ((seq.state ^ tok) * _FNV_PRIME) & _MASK
        seq.computed += work
        if seq.computed < len(seq.tokens):
            return None  # prefill continues next step
        seq.sampled_this_run = True
        seq.isolated = False
        index = len(seq.outputs)
        token = self._sample(seq)
        seq.tokens.append(token)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._running.remove(seq)
            self._release(seq)
            out = self._finish(seq, reason)
            out.new_token_ids, out.first_index = [token], index
            return out
        final, emittable = self._emittable(seq, seq.outputs)
        delta = final[seq.emitted_chars:emittable]
        seq.emitted_chars = emittable
        return StepOutput(seq.rid, [token], delta, first_index=index,
                          num_prompt_tokens=seq.num_prompt)

    def _sample(self, seq: _Seq) -> int:
        seed = seq.request.params.seed or 0
        h = _mix(seq.state ^ (seed * 0x9E3779B97F4A7C15 & _MASK))
        p = seq.request.params
        allow_eos = not p.ignore_eos and len(seq.outputs) + 1 >= p.min_tokens
        if self.options.eos_every and allow_eos and h % self.options.eos_every == 0:
            return EOS_TOKEN_ID
        return 32 + (h >> 8) % 95  # printable ASCII

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        p = seq.request.params
        n = len(seq.outputs)
        if n >= p.min_tokens:
            if token in p.stop_token_ids or token == EOS_TOKEN_ID and not p.ignore_eos:
                return "stop"
            if p.stop and self._stop_at(seq, self.tokenizer.decode(seq.outputs)) is not None:
                return "stop"
        if n >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: _Seq, reason: str, flush: bool = True) -> StepOutput:
        """The final output; `flush=False` (no token to carry text): the shown text is final."""
        text = self._final_text(seq, reason)
        if not flush:
            text = text[:seq.emitted_chars]
        delta = text[seq.emitted_chars:]
        seq.emitted_chars = len(text)
        return StepOutput(seq.rid, [], delta, first_index=len(seq.outputs), finished=True,
                          finish_reason=reason, num_prompt_tokens=seq.num_prompt,  # type: ignore[arg-type]
                          text=text)

    def _final_text(self, seq: _Seq, reason: str) -> str:
        ids = seq.outputs
        p = seq.request.params
        if reason == "stop" and ids and (ids[-1] in p.stop_token_ids or ids[-1] == EOS_TOKEN_ID):
            ids = ids[:-1]  # a stop token ends the text without being part of it
        text = self.tokenizer.decode(ids)
        cut = self._stop_at(seq, text) if p.stop else None
        return text if cut is None else text[:cut]

    def _stop_at(self, seq: _Seq, text: str) -> int | None:
        hits = [i for s in seq.request.params.stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def _emittable(self, seq: _Seq, outputs: list[int]) -> tuple[str, int]:
        """(text so far, how many of its chars are safe to show): holds back an incomplete UTF-8
        character and any suffix that could start a stop string. A function of the tokens only,
        so a resumed request knows what its earlier run has shown."""
        text = self.tokenizer.decode(outputs)
        safe = len(text)
        if text.endswith("\ufffd"):
            safe -= 1
        for s in seq.request.params.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return text, max(0, safe)

    def _find(self, request_id: str) -> _Seq | None:
        for seq in self._running + self._waiting:
            if seq.rid == request_id:
                return seq
        return None


@dataclass
class OfflineResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def run_offline(engine: SimulatedEngine, requests: Iterable[Request]) -> dict[str, OfflineResult]:
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
