"""Runs one scheduled step: packs it into a ragged batch, runs the model, samples."""

from __future__ import annotations

import itertools
import os
import time

import torch

from qworker.engine.core_share import CoreShare
from qworker.engine.logprobs import token_logprobs
from qworker.engine.sampler import Allowed, SampleRow, sample
from qworker.engine.sequence import Sequence
from qworker.engine.speculation import accepted_length
from qworker.engine.structured import MaskFuture
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel
from qworker.model.kv_cache import KVCache


class Runner:
    def __init__(self, model: DecoderModel, cache: KVCache, eos_token_ids: tuple[int, ...],
                 follow_cores: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.eos_token_ids = eos_token_ids
        self.forward_seconds = 0.0  # time spent in the model, for the benchmarks
        self.cores = (CoreShare(torch.get_num_threads(), frozenset(os.sched_getaffinity(0)))
                      if follow_cores and model.device.type == "cpu" else None)

    @property
    def vocab_size(self) -> int:
        return int(self.model.embed_tokens.weight.shape[0])

    @property
    def max_context(self) -> int:
        return self.model.config.context_length

    def kernel_report(self) -> dict[str, str]:
        """Which kernel runs each op (`DecoderModel.kernel_report`)."""
        return self.model.kernel_report()

    def _follow_cores(self) -> None:
        """The threads this step runs on: the cores other processes leave (core_share.py)."""
        if self.cores is not None:
            threads = self.cores.threads_at(time.monotonic())
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)

    def run(self, work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        """Computes `n` new tokens of each sequence (a speculative draft's included); returns the
        sampled token of those whose computed tokens now reach their end. A sequence with a draft
        gets the token after its accepted part (`seq.num_accepted`, speculation.py)."""
        # decodes first, shortest first: the model groups them by length in consecutive runs
        work = sorted(work, key=lambda item: (item[1] > 1, len(item[0].block_table)))
        two_groups = self.cache.layer_groups is not None  # a windowed group's tables too
        inputs = [
            SequenceInput(
                token_ids=seq.token_ids[seq.num_computed : seq.num_computed + n - len(seq.draft)]
                + seq.draft,
                num_cached=seq.num_computed,
                block_table=seq.block_table,
                need_logits=seq.reaches_end(n),
                all_logits=bool(seq.draft) or bool(seq.prompt_logprob_positions(n)),
                window_table=seq.window_table if two_groups else None,
                as_decodes=bool(seq.draft),
            )
            for seq, n in work
        ]
        batch = build_batch(inputs, self.cache.block_size, self.model.device)
        masks = _start_masks(work, inputs)  # computed beside the forward
        self._follow_cores()
        started = time.perf_counter()
        try:
            logits = self.model(batch, self.cache)
        except BaseException:
            if masks is not None:
                masks.join()  # it follows drafts in the matchers: done before they go on
            raise
        self.forward_seconds += time.perf_counter() - started
        sampled = [seq for (seq, _), inp in zip(work, inputs, strict=True) if inp.need_logits]
        if any(inp.all_logits for inp in inputs):  # rows beside the sampling ones
            logits = self._sampling_logits(work, inputs, logits)
        if not sampled:
            return {}
        # one row per sequence, and one more per draft token (each after the draft before it)
        first = list(itertools.accumulate((1 + len(seq.draft) for seq in sampled), initial=0))
        rows = [self._row(seq, i) for seq in sampled for i in range(1 + len(seq.draft))]
        tokens = sample(logits, rows, _allowed(sampled, first, masks))
        chosen: dict[Sequence, int] = {}
        asking: list[tuple[Sequence, int, int]] = []  # (sequence, first row, tokens)
        for seq, start in zip(sampled, first, strict=False):
            seq.num_accepted = accepted_length(seq.draft, tokens[start : start + len(seq.draft)])
            chosen[seq] = tokens[start + seq.num_accepted]
            if seq.params.logprobs is not None:
                asking.append((seq, start, seq.num_accepted + 1))
        if asking:  # the raw logits: the sampler edits only its own copy
            asked = [start + i for _, start, count in asking for i in range(count)]
            found = token_logprobs(logits, asked, [tokens[r] for r in asked],
                                   [seq.params.logprobs or 0 for seq, _, count in asking
                                    for _ in range(count)])
            for seq, _, count in asking:
                seq.sampled_logprobs, found = found[:count], found[count:]
        return chosen

    @staticmethod
    def _sampling_logits(work: list[tuple[Sequence, int]], inputs: list[SequenceInput],
                         logits: torch.Tensor) -> torch.Tensor:
        """Appends each asking sequence's prompt logprobs of this chunk; returns the sampling
        rows' logits alone (one per sequence that reaches its end, and one per draft token), in
        order."""
        sampling_rows: list[int] = []
        row = 0
        for (seq, n), inp in zip(work, inputs, strict=True):
            if not inp.all_logits:
                if inp.need_logits:
                    sampling_rows.append(row)
                row += int(inp.need_logits)
                continue
            if seq.prompt_logprob_positions(n):
                _collect_prompt_logprobs(seq, n, logits, row)
            if inp.need_logits:
                sampling_rows.extend(range(row + n - 1 - len(seq.draft), row + n))
            row += n
        assert row == logits.shape[0], "logits rows do not match the batch"
        return logits[sampling_rows]

    def warm_up(self) -> None:
        """One tiny forward (written to block 0, which any sequence overwrites before reading),
        so that first-call costs (weight packing, kernel build) fall on no request."""
        block_size = self.cache.block_size
        window = [0] if self.cache.layer_groups is not None else None
        batch = build_batch([SequenceInput([0] * min(2, block_size), 0, [0], window_table=window)],
                            block_size, self.model.device)
        self.model(batch, self.cache)

    def _row(self, seq: Sequence, i: int = 0) -> SampleRow:
        """The sampling of its next token, or, i > 0, of the one after its draft's first i."""
        p = seq.params
        index = seq.num_output_tokens + i
        banned: tuple[int, ...] = ()
        if index < p.min_tokens:
            banned = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
        context = seq.token_ids + seq.draft[:i] if i else seq.token_ids
        return SampleRow(p, seq.seed, index, context, seq.num_prompt_tokens, banned)


def _collect_prompt_logprobs(seq: Sequence, n: int, logits: torch.Tensor, row: int) -> None:
    """Appends the prompt logprobs of the chunk of `n` tokens whose logits start at `row`."""
    positions = seq.prompt_logprob_positions(n)
    assert seq.prompt_logprobs is not None
    assert len(seq.prompt_logprobs) == positions.start, "a prompt position was skipped"
    first = row + positions.start - seq.num_computed
    targets = [seq.token_ids[p + 1] for p in positions]
    k = seq.params.prompt_logprobs or 0
    seq.prompt_logprobs += token_logprobs(logits, list(range(first, first + len(targets))),
                                          targets, [k] * len(targets))


def _start_masks(work: list[tuple[Sequence, int]], inputs: list[SequenceInput]
                 ) -> MaskFuture | None:
    """Starts computing the token masks of the constrained sequences that sample this step (a
    row per draft token too)."""
    constrained = [seq for (seq, _), inp in zip(work, inputs, strict=True)
                   if inp.need_logits and seq.matcher is not None]
    if not constrained:
        return None
    return MaskFuture([seq.matcher for seq in constrained if seq.matcher is not None],
                      [seq.draft for seq in constrained])


def _allowed(sampled: list[Sequence], first: list[int], masks: MaskFuture | None
             ) -> Allowed | None:
    """The constrained rows' masks; `first[i]`: the first row of sampled[i] (one row, and one
    more per draft token)."""
    if masks is None:
        return None
    rows = [first[r] + i for r, seq in enumerate(sampled) if seq.matcher is not None
            for i in range(1 + len(seq.draft))]
    return Allowed(rows, torch.from_numpy(masks.result()))
