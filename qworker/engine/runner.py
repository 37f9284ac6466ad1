"""Runs one scheduled step: packs it into a ragged batch, runs the model, samples."""

from __future__ import annotations

import time

import torch

from qworker.engine.logprobs import token_logprobs
from qworker.engine.sampler import Allowed, SampleRow, sample
from qworker.engine.sequence import Sequence
from qworker.engine.structured import MaskFuture
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel
from qworker.model.kv_cache import KVCache


class Runner:
    def __init__(self, model: DecoderModel, cache: KVCache, eos_token_ids: tuple[int, ...]) -> None:
        self.model = model
        self.cache = cache
        self.eos_token_ids = eos_token_ids
        self.forward_seconds = 0.0  # time spent in the model, for the benchmarks

    @property
    def vocab_size(self) -> int:
        return int(self.model.embed_tokens.weight.shape[0])

    @property
    def max_context(self) -> int:
        return self.model.config.context_length

    def kernel_report(self) -> dict[str, str]:
        """Which kernel runs each op (`DecoderModel.kernel_report`)."""
        return self.model.kernel_report()

    def run(self, work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        """Computes `n` new tokens of each sequence; returns the sampled token of those whose
        computed tokens now reach their end."""
        # decodes first, shortest first: the model groups them by length in consecutive runs
        work = sorted(work, key=lambda item: (item[1] > 1, len(item[0].block_table)))
        two_groups = self.cache.layer_groups is not None  # a windowed group's tables too
        inputs = [
            SequenceInput(
                token_ids=seq.token_ids[seq.num_computed : seq.num_computed + n],
                num_cached=seq.num_computed,
                block_table=seq.block_table,
                need_logits=seq.num_computed + n == len(seq.token_ids),
                all_logits=bool(seq.prompt_logprob_positions(n)),
                window_table=seq.window_table if two_groups else None,
            )
            for seq, n in work
        ]
        batch = build_batch(inputs, self.cache.block_size, self.model.device)
        masks = _start_masks(work, inputs)  # computed beside the forward
        started = time.perf_counter()
        logits = self.model(batch, self.cache)
        self.forward_seconds += time.perf_counter() - started
        sampled = [seq for (seq, _), inp in zip(work, inputs, strict=True) if inp.need_logits]
        if any(inp.all_logits for inp in inputs):  # rows beside the sampling ones
            logits = self._collect_prompt_logprobs(work, inputs, logits)
        if not sampled:
            return {}
        tokens = sample(logits, [self._row(seq) for seq in sampled], _allowed(sampled, masks))
        asking = [r for r, seq in enumerate(sampled) if seq.params.logprobs is not None]
        if asking:  # the raw logits: the sampler edits only its own copy
            found = token_logprobs(logits, asking, [tokens[r] for r in asking],
                                   [sampled[r].params.logprobs or 0 for r in asking])
            for r, entry in zip(asking, found, strict=True):
                sampled[r].sampled_logprobs = entry
        return dict(zip(sampled, tokens, strict=True))

    @staticmethod
    def _collect_prompt_logprobs(work: list[tuple[Sequence, int]], inputs: list[SequenceInput],
                                 logits: torch.Tensor) -> torch.Tensor:
        """Appends each asking sequence's prompt logprobs of this chunk; returns the sampling
        rows' logits alone (one per sequence that reaches its end), in order."""
        sampling_rows: list[int] = []
        row = 0
        for (seq, n), inp in zip(work, inputs, strict=True):
            if not inp.all_logits:
                if inp.need_logits:
                    sampling_rows.append(row)
                row += int(inp.need_logits)
                continue
            positions = seq.prompt_logprob_positions(n)
            assert seq.prompt_logprobs is not None
            assert len(seq.prompt_logprobs) == positions.start, "a prompt position was skipped"
            first = row + positions.start - seq.num_computed
            targets = [seq.token_ids[p + 1] for p in positions]
            k = seq.params.prompt_logprobs or 0
            seq.prompt_logprobs += token_logprobs(logits, list(range(first, first + len(targets))),
                                                  targets, [k] * len(targets))
            if inp.need_logits:
                sampling_rows.append(row + n - 1)
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

    def _row(self, seq: Sequence) -> SampleRow:
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
        return SampleRow(p, seq.seed, seq.num_output_tokens, seq.token_ids,
                         seq.num_prompt_tokens, banned)


def _start_masks(work: list[tuple[Sequence, int]], inputs: list[SequenceInput]
                 ) -> MaskFuture | None:
    """Starts computing the token masks of the constrained sequences that sample this step."""
    matchers = [seq.matcher for (seq, _), inp in zip(work, inputs, strict=True)
                if inp.need_logits and seq.matcher is not None]
    return MaskFuture(matchers) if matchers else None


def _allowed(sampled: list[Sequence], masks: MaskFuture | None) -> Allowed | None:
    if masks is None:
        return None
    rows = [r for r, seq in enumerate(sampled) if seq.matcher is not None]
    return Allowed(rows, torch.from_numpy(masks.result()))
