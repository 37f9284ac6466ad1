"""The engine core: add / abort / step over a scheduler, a block manager and a model runner.

Torch-free. Scheduling, block accounting, text and stop handling, request validation and pacing
live here once; what computes the tokens is a `ModelRunner`: the torch model (`Engine`, engine.py)
or a deterministic stand-in (`SimulatedEngine`, simulated.py). It knows nothing of Redis.
`generate` is the offline batch API on top of the same loop.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from qworker.engine.aging import Aging
from qworker.engine.block_groups import KVGroup, make_blocks
from qworker.engine.block_manager import BlockManager
from qworker.engine.chat import render_chat
from qworker.engine.config import EngineConfig
from qworker.engine.kv_events import DEFAULT_LIMIT, KVEvent, KVEventLog
from qworker.engine.output import Arm, OutputParser, Pieces
from qworker.engine.pacer import PrefillPacer
from qworker.engine.reasoning import THINK_CLOSE, prompt_opens_thinking, thinks
from qworker.engine.request import (
    FinishReason,
    Prompt,
    Request,
    RequestRejectedError,
    SamplingParams,
    StepOutput,
    StructuredOutputs,
)
from qworker.engine.scheduler import ScheduledStep, Scheduler, SchedulerLimits
from qworker.engine.sequence import Sequence, Status
from qworker.engine.speculation import SpeculationLimits, Speculator
from qworker.engine.structured import Grammars, Matcher
from qworker.engine.text import Detokenizer, TextStream
from qworker.engine.tool_calls import FORMATS, format_of_template
from qworker.engine.tool_grammar import call_grammar, whole_grammar
from qworker.engine.validation import ModelLimits, check_prompt_chars, check_request


class ModelRunner(Protocol):
    """Computes scheduled tokens and samples the next token of sequences that reach their end."""

    @property
    def vocab_size(self) -> int: ...  # token ids the model takes: 0 .. vocab_size - 1

    @property
    def max_context(self) -> int: ...  # positions the model has

    def run(self, work: list[tuple[Sequence, int]]) -> dict[Sequence, int]: ...

    def warm_up(self) -> None: ...

    def kernel_report(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class Vocabulary:
    """What the core needs of a tokenizer."""

    tokenizer: Any  # encode(text) for `generate`; the service renders and encodes jobs with it
    detokenizer: Callable[[], Detokenizer]  # a fresh incremental detokenizer per sequence
    eos_token_ids: tuple[int, ...]
    max_token_chars: int | None  # see validation.max_token_chars


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "" when it failed
    error: str | None = None  # the exception its step raised (see StepOutput.error)


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner, vocab: Vocabulary,
                 num_blocks: int, kv_groups: tuple[KVGroup, ...] | None = None) -> None:
        """`kv_groups`: the pools of the model's KV groups (block_groups.py); None: one pool of
        `num_blocks`, as a model without sliding windows has."""
        self.config = config
        self.runner = runner
        self.tokenizer = vocab.tokenizer
        # the model's own sampling defaults, for what a request leaves unset (request.py)
        self.sampling_defaults: dict[str, float | int] = {}
        self._detokenizer = vocab.detokenizer
        self.eos_token_ids = vocab.eos_token_ids
        self.blocks = make_blocks(kv_groups or (KVGroup(num_blocks),), config.block_size,
                                  config.prefix_caching,
                                  min(config.prefill_chunk, config.max_batched_tokens))
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_batched_tokens, config.prefill_chunk,
                            int(config.watermark * num_blocks)),
            self.blocks, Aging(config.priority_aging_s),
        )
        self.max_model_len = min(config.max_model_len or runner.max_context, runner.max_context)
        self.limits = ModelLimits(vocab_size=runner.vocab_size, max_model_len=self.max_model_len,
                                  cache_tokens=self.blocks.capacity * config.block_size,
                                  max_token_chars=vocab.max_token_chars)
        # no sequence can outgrow the model's context nor the whole cache
        self.max_seq_len = self.limits.max_seq_len
        self.grammars = Grammars(vocab.tokenizer, runner.vocab_size, vocab.eos_token_ids)
        template = getattr(vocab.tokenizer, "chat_template", None)
        self.tool_format = (format_of_template(template) if config.tool_call_parser == "auto"
                            else FORMATS[config.tool_call_parser])
        self.thinks = thinks(template)  # its thinking is split off the answer (reasoning.py)
        self._seqs: dict[str, Sequence] = {}
        self._ready: list[StepOutput] = []  # outputs decided outside a step (resumed, finished)
        self._arrivals = itertools.count()
        self.pacer = (PrefillPacer(config.decode_stretch, config.max_batched_tokens)
                      if config.decode_stretch else None)
        self.speculator = (Speculator(
            SpeculationLimits(config.num_speculative_tokens, config.speculate_max_batch,
                              config.speculate_min_acceptance, int(config.watermark * num_blocks),
                              config.speculate_measured),
            self.blocks, self.max_seq_len)
            if config.num_speculative_tokens and isinstance(self.blocks, BlockManager) else None)
        self.num_preemptions = 0
        self.num_steps = 0
        self.last_schedule = ScheduledStep()
        self.kv_events: KVEventLog | None = None  # off until `record_kv_events`
        # where the cache lives, in vLLM's `medium` words
        self.kv_medium = "GPU" if config.device == "cuda" else "CPU"

    def warm_up(self) -> None:
        """Runs one tiny forward, so that no request pays for first-call costs."""
        self.blocks.drop_cache()  # the forward writes block 0
        self.runner.warm_up()

    def add(self, request: Request) -> None:
        if request.request_id in self._seqs:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        check_request(request, self.limits)
        params = request.params
        # compiled before anything is taken: an invalid one is a RequestRejectedError here
        matcher = (self.grammars.matcher(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        seq = Sequence(
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            params=params,
            seed=params.seed if params.seed is not None else random.getrandbits(63),
            priority=request.priority,
            waited_s=request.queued_s,
            arrival=next(self._arrivals),
            text=TextStream(self._detokenizer(), params.stop),
            isolate=request.isolate,
            cache_salt=request.cache_salt,
            # a resumed request already published its prompt's logprobs with its first token
            prompt_logprobs=([] if params.prompt_logprobs is not None
                             and not request.output_token_ids else None),
        )
        seq.matcher = matcher
        seq.output = self._output_parser(request)
        if request.tools is not None and request.tools.forced and request.tools.choice != "none":
            if matcher is not None:
                raise RequestRejectedError("invalid_request", "tool_choice required or named "
                                           "cannot go with structured_outputs")
            seq.matcher = self._tool_matcher(whole_grammar(
                self.tool_format, request.tools.allowed, request.tools.parallel, self._term))
        self._seqs[seq.request_id] = seq
        for token in request.output_token_ids:  # replay what an earlier run already streamed
            if (out := self._append(seq, token)).finished:  # it had ended; only `done` was lost
                out.new_token_ids, out.text_delta, out.first_index = [], "", len(
                    request.output_token_ids)
                self._ready.append(out)
                return
        self.scheduler.add(seq)

    # ---- the front door of text: prompts in, parsers beside the detokenizer -----------------

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt as the token ids to run: given, a text (with the special tokens its
        vocabulary adds, as vLLM's and llama.cpp's completions do), or a chat rendered through
        the model's template (which writes its own special tokens), tools and all."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if prompt.messages is not None:
            if getattr(self.tokenizer, "chat_template", "") is None:
                raise RequestRejectedError("invalid_request", "the model has no chat template (a "
                                           "base model): send a plain `prompt` to complete, not "
                                           "`messages`")
            text = render_chat(self.tokenizer, prompt.messages, prompt.tools, self.tool_format)
        else:
            text = prompt.text or ""
        self.check_prompt_text(text)  # far too long for the context: rejected untokenized
        return list(self.tokenizer.encode(text, add_special_tokens=prompt.messages is None))

    def token_text(self, token_id: int) -> str:
        """A token's own text, decoded alone (part of a UTF-8 character shows as U+FFFD)."""
        return str(self.tokenizer.decode([token_id]))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "has_chat_template", False))

    def _output_parser(self, request: Request) -> OutputParser | None:
        tools = request.tools if request.tools is not None and request.tools.functions else None
        if tools is None and not self.thinks:
            return None  # the answer is the text, as it always was
        inside = self.thinks and prompt_opens_thinking(
            self.tokenizer.decode(request.prompt_token_ids[-8:]))
        return OutputParser(request.request_id, self.tool_format, tools, self.thinks, inside,
                            request.max_reasoning_tokens)

    def _term(self, marker: str) -> str:
        """A marker in a grammar: its token where it is one special token, else its text."""
        ids = self.tokenizer.encode(marker)
        token = getattr(self.tokenizer, "token_to_id", lambda _m: None)(marker)
        if len(ids) == 1 and token is not None and ids[0] == token and self._is_special(token):
            return f"<[{token}]>"
        return json.dumps(marker)

    def _is_special(self, token: int) -> bool:
        backend = getattr(self.tokenizer, "backend", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        return token in added and bool(added[token].special)

    def _tool_matcher(self, lark: str) -> Matcher:
        return self.grammars.matcher(StructuredOutputs(grammar=lark))

    def check_prompt_text(self, text: str) -> None:
        """Before tokenizing: rejects a text that cannot fit whatever its tokens (validation.py)."""
        check_prompt_chars(len(text), self.limits)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        self._ready = [out for out in self._ready if out.request_id != request_id]

    def kernel_report(self) -> dict[str, str]:
        """Which kernel runs each op, for the worker's logs, metrics and liveness key."""
        return self.runner.kernel_report()

    @property
    def clock(self) -> Callable[[], float]:
        """What priority aging reads the time from (time.monotonic; tests set their own)."""
        return self.scheduler.aging.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.scheduler.aging.clock = clock

    def free_slots(self, priority: int | None = None) -> int:
        """How many more requests admission would take now; with `priority`, how many new ones
        of that priority it would take, counting the slots held by running requests they would
        displace (aging.py) and by waiting ones they would go before, so a full worker still
        takes urgent work."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        held = running + waiting
        displaceable = False
        if priority is not None:
            aging = self.scheduler.aging
            rank = aging.new_rank(priority)
            kept = [seq for seq in running if not aging.may_displace(priority, rank, seq)]
            displaceable = len(kept) < len(running)
            held = kept + [seq for seq in waiting if aging.rank(seq) <= rank]
        if self.blocks.num_free <= self.scheduler.limits.watermark_blocks and not displaceable:
            return 0
        return max(0, self.config.max_num_seqs - len(held))

    def stats(self) -> dict[str, int]:
        """Plain numbers for the service's metrics."""
        work = self.last_schedule.work
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_free": self.blocks.num_free, "blocks_total": self.blocks.num_blocks,
                "batch_seqs": len(work), "batch_tokens": sum(n for _, n in work),
                **self._prefix_cache_stats(),
                **(self.speculator.stats() if self.speculator else {})}

    def _prefix_cache_stats(self) -> dict[str, int]:
        cache = self.blocks.cache
        if cache is None:
            return {}
        return {"prefix_cache_queries": cache.queries, "prefix_cache_hits": cache.hits,
                "blocks_cached": self.blocks.num_cached}

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._ready)

    def record_kv_events(self, limit: int | None = DEFAULT_LIMIT) -> None:
        """From now on the block managers record KV events (kv_events.py), at most `limit` blocks
        between two `take_kv_events` (None: no more events). The first is `AllBlocksCleared`: a
        consumer starts this engine from nothing (a cache that held blocks is dropped, so that
        it is true)."""
        self.kv_events = KVEventLog(limit) if limit is not None else None
        self.blocks.record_events(self.kv_events)
        if self.kv_events is not None:
            self.blocks.drop_cache()
            self.kv_events.cleared()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call, in order ([] when not recording)."""
        return self.kv_events.take() if self.kv_events is not None else []

    def solo_next(self) -> str | None:
        """The request that the next step runs alone (an isolated one), if any: the service
        records it before the step, so that a crash in it is charged to that request."""
        seq = self.scheduler.next_alone()
        return seq.request_id if seq is not None else None

    def step(self) -> list[StepOutput]:
        outputs, self._ready = self._ready, []
        budget = self.pacer.budget(self.scheduler.has_decodes()) if self.pacer else None
        step = self.last_schedule = self.scheduler.schedule(budget)
        self.num_preemptions += len(step.preempted)
        if self.config.requeue_preempted:
            outputs += [self._hand_back(seq) for seq in step.preempted]
        if step.work:
            self.num_steps += 1
            decodes = sum(1 for seq, _ in step.work if not seq.is_prefill)
            drafted = self.speculator is not None and self.speculator.draft(step)
            started = time.perf_counter()
            work = step.work
            try:
                sampled = self.runner.run(work)
            except Exception as exc:  # whatever it is, it costs only the sequences it concerns
                sampled, failed = (self._run_isolating(work) if len(work) > 1
                                   else ({}, {work[0][0]: exc}))
                outputs += [self._fail(seq, exc) for seq, exc in failed.items()]
                work = [(seq, n) for seq, n in work if seq not in failed]
            else:
                seconds = time.perf_counter() - started
                if self.pacer and not drafted:  # a verify step is no decode step's measure
                    self.pacer.observe(decodes, step.prefill_tokens, seconds)
                if self.speculator is not None and decodes == len(work):
                    made = sum(1 + seq.num_accepted for seq, _ in work)
                    self.speculator.observe(decodes, drafted, seconds, made)
            for seq, n in work:
                seq.num_computed += n - len(seq.draft)  # a draft counts once accepted
                self.blocks.commit(seq)
                seq.isolate = seq.isolate and seq not in sampled
            outputs += [self._take(seq, token) for seq, token in sampled.items()]
            for seq, _ in step.work:
                seq.draft, seq.num_accepted = [], 0
        if self.kv_events is not None and self.kv_events.overflowed:
            self.blocks.drop_cache()  # nobody took them: the cache goes, and says so (cleared)
        return outputs

    def _take(self, seq: Sequence, token: int) -> StepOutput:
        """The tokens a run gave `seq`: its accepted draft tokens, then `token`, appended one by
        one until one ends it; then the blocks past its tokens (a rejected draft's) are freed."""
        tokens = seq.draft[: seq.num_accepted] + [token]
        if seq.draft and self.speculator is not None:
            self.speculator.settle(seq)
        out = self._append(seq, tokens[0])
        for token in tokens[1:]:
            if out.finished:
                break
            seq.num_computed += 1  # the token before was an accepted draft: computed
            self.blocks.commit(seq)
            out = _joined(out, self._append(seq, token))
        if seq.draft and seq.status is Status.RUNNING:
            assert isinstance(self.blocks, BlockManager)  # one KV group: no speculator else
            self.blocks.shrink(seq, len(seq.token_ids))
        seq.sampled_logprobs = []
        return out

    def _run_isolating(self, work: list[tuple[Sequence, int]]
                       ) -> tuple[dict[Sequence, int], dict[Sequence, Exception]]:
        """A step of 2+ sequences that raised, run again in halves until each failure is down to
        one sequence (k culprits among n: about 2k log2(n) runs).

        Nothing of the failed run was committed (`num_computed` moves only after success), so every
        half recomputes from its sequences' own tokens; K/V slots it had written are written again
        with the same values. Returns the tokens of the parts that ran and the culprits' errors."""
        sampled: dict[Sequence, int] = {}
        failed: dict[Sequence, Exception] = {}
        half = len(work) // 2
        for part in (work[:half], work[half:]):
            try:
                sampled |= self.runner.run(part)
            except Exception as exc:
                if len(part) == 1:
                    failed[part[0][0]] = exc
                    continue
                part_sampled, part_failed = self._run_isolating(part)
                sampled |= part_sampled
                failed |= part_failed
        return sampled, failed

    def _fail(self, seq: Sequence, exc: Exception) -> StepOutput:
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        return StepOutput(seq.request_id, [], first_index=seq.num_output_tokens, finished=True,
                          num_prompt_tokens=seq.num_prompt_tokens,
                          error=f"{type(exc).__name__}: {exc}"[:500])

    def generate(self, prompts: Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Offline batch API: runs every prompt to completion with continuous batching."""
        prompts = list(prompts)
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        ids = [p if isinstance(p, list) else self._encode(p) for p in prompts]
        tokens: dict[str, list[int]] = {}
        done: dict[str, StepOutput] = {}
        for i, (prompt, p) in enumerate(zip(ids, params, strict=True)):
            self.add(Request(f"generate-{i}", prompt, p))
            tokens[f"generate-{i}"] = []
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = out
        return [
            Completion(rid, ids[i], tokens[rid], done[rid].text or "",
                       done[rid].finish_reason or "", done[rid].error)
            for i, rid in enumerate(tokens)
        ]

    def _encode(self, text: str) -> list[int]:
        self.check_prompt_text(text)
        return list(self.tokenizer.encode(text, add_special_tokens=True))  # as the worker does

    def _hand_back(self, seq: Sequence) -> StepOutput:
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]
        return StepOutput(seq.request_id, [], first_index=seq.num_output_tokens, preempted=True,
                          num_prompt_tokens=seq.num_prompt_tokens)

    @staticmethod
    def _take_logprobs(seq: Sequence, out: StepOutput) -> None:
        """Moves what the runner computed for this token (and, with the first token, for the
        prompt) onto its output. A replayed token (Request.output_token_ids) has none."""
        if seq.sampled_logprobs:
            entry = seq.sampled_logprobs.pop(0)
            assert entry.token_id == out.new_token_ids[0], "another token's"
            out.logprobs = [entry]
        if seq.prompt_logprobs is not None:
            assert len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1, "prompt logprobs missing"
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        """Adds a generated token; decides whether the sequence is finished."""
        if seq.matcher is not None and not seq.matcher.advance(token):  # a mask let it through?
            if seq.output is None or seq.output.armed is None:
                return self._fail(seq, ValueError(f"token {token} does not fit "
                                                  f"structured_outputs: {seq.matcher.error[:200]}"))
            seq.matcher, seq.output.armed = None, None  # an armed call lost its place: free
        index = seq.num_output_tokens
        seq.token_ids.append(token)
        if seq.output is not None:
            seq.output.count_token()
        p = seq.params
        count = index + 1
        reason: FinishReason | None
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            delta, reason = seq.text.flush(), "stop"  # the stop token's own text is not shown
        else:
            delta = seq.text.add(token, check_stop=count >= p.min_tokens)
            reason = "stop" if seq.text.stopped else None
            if reason is None and seq.matcher is not None and seq.matcher.done:
                if seq.output is not None and seq.output.armed is not None:
                    seq.matcher = None  # an armed call or the end of thinking is written
                    if seq.output.released():
                        delta, reason = delta + seq.text.flush(), "stop"
                else:
                    delta, reason = delta + seq.text.flush(), "stop"  # its grammar is complete
            if reason is None and (count >= p.max_tokens or len(seq.token_ids) >= self.max_seq_len):
                delta, reason = delta + seq.text.flush(), "length"
        out = StepOutput(seq.request_id, [token], delta, first_index=index,
                         num_prompt_tokens=seq.num_prompt_tokens)
        self._take_logprobs(seq, out)
        if seq.output is not None:
            reason = self._parse(seq, out, reason)
        if reason is not None:
            out.finished, out.finish_reason = True, reason
            out.text = seq.output.text if seq.output is not None else seq.text.final_text
            seq.finish_reason = reason
            if seq.status is not Status.FINISHED:
                self.scheduler.remove(seq)
            self._seqs.pop(seq.request_id, None)
        return out

    def _parse(self, seq: Sequence, out: StepOutput, reason: FinishReason | None
               ) -> FinishReason | None:
        """The answer, thinking and calls of this token's text; arms a grammar the next token
        needs. A sequence that made calls and stopped finishes `tool_calls`."""
        output = seq.output
        assert output is not None
        pieces = output.feed(out.text_delta)
        if reason is not None:
            end = output.finish()
            pieces = Pieces(pieces.text + end.text, pieces.reasoning + end.reasoning,
                            pieces.tool_calls + end.tool_calls)
        out.text_delta, out.reasoning_delta = pieces.text, pieces.reasoning
        out.tool_call_deltas = pieces.tool_calls or None
        if reason is None:
            if (arm := output.to_arm()) is not None and seq.matcher is None:
                self._arm(seq, output, arm)
            return None
        out.reasoning = output.reasoning or None
        out.tool_calls = output.tool_calls or None
        return "tool_calls" if reason == "stop" and output.tool_calls else reason

    def _arm(self, seq: Sequence, output: OutputParser, arm: Arm) -> None:
        """A temporary grammar from here: the rest of a call the model opened (the text it
        already wrote of it fed to the grammar), or the end-of-thinking marker."""
        try:
            if arm.kind == "think":
                matcher = self._tool_matcher(f"start: {self._term(THINK_CLOSE)}")
            else:
                assert output.tools is not None
                matcher = self._tool_matcher(call_grammar(
                    self.tool_format, output.tools.allowed, arm.opener, self._term))
                # the grammar starts at the marker (Llama's leading space is not in it)
                marker = arm.opener if arm.opener == self.tool_format.open else ""
                written = self.tokenizer.encode(marker + arm.written)
                if not all(matcher.advance(t) for t in written):
                    return  # what it wrote does not fit any call: left free
        except RequestRejectedError:
            return  # a tool schema the grammar engine refuses: the call stays free
        seq.matcher, output.armed = matcher, arm.kind

def _joined(first: StepOutput, then: StepOutput) -> StepOutput:
    """One request's outputs of one step (several tokens: an accepted draft) as one."""
    first.new_token_ids += then.new_token_ids
    first.text_delta += then.text_delta
    first.reasoning_delta += then.reasoning_delta
    if then.tool_call_deltas:
        first.tool_call_deltas = (first.tool_call_deltas or []) + then.tool_call_deltas
    first.reasoning, first.tool_calls = then.reasoning, then.tool_calls
    if then.logprobs is not None:
        first.logprobs = (first.logprobs or []) + then.logprobs
    first.finished, first.finish_reason = then.finished, then.finish_reason
    first.text, first.error = then.text, then.error
    return first
