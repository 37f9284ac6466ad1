"""Turns each sampled row's logits into its next token, reproducibly per request.

A request's randomness is one uniform number per token index, derived from its seed and that
index alone: batch composition, preemption and resumption elsewhere cannot change what it samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qworker.engine.request import SamplingParams

MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A float in [0, 1) from (seed, index), by splitmix64."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    seed: int
    index: int  # index among the generated tokens of the token being sampled
    token_ids: list[int]  # prompt + generated so far (for the penalties)
    num_prompt_tokens: int
    banned: tuple[int, ...]  # token ids not allowed now (EOS and stop ids before min_tokens)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """logits: [len(rows), vocab]; returns one token id per row."""
    logits = logits.float().clone()
    for r, row in enumerate(rows):
        _penalize(logits[r], row)
        if row.banned:
            logits[r, list(row.banned)] = float("-inf")
    chosen = logits.argmax(dim=-1)
    random_rows = [r for r, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        chosen[random_rows] = _sample_random(logits[random_rows], [rows[r] for r in random_rows])
    return chosen.tolist()


def _penalize(logits: torch.Tensor, row: SampleRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                   values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(row.token_ids) > row.num_prompt_tokens:
        output = torch.tensor(row.token_ids[row.num_prompt_tokens :], dtype=torch.long)
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_random(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    temperature = torch.tensor([[row.params.temperature] for row in rows])
    probs = torch.softmax(logits / temperature, dim=-1, dtype=torch.float64)
    if any(_filters(row.params) for row in rows):
        probs, order = probs.sort(dim=-1, descending=True)
        probs = _filter_sorted(probs, rows)
    else:
        order = None
    cdf = probs.cumsum(dim=-1)
    u = torch.tensor([[uniform(row.seed, row.index)] for row in rows], dtype=torch.float64)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)
    return picked.squeeze(1) if order is None else order.gather(1, picked).squeeze(1)


def _filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _filter_sorted(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Zero out, per row, what top-k, top-p and min-p exclude (probs sorted descending)."""
    vocab = probs.shape[1]
    rank = torch.arange(vocab)[None, :]
    top_k = torch.tensor([[row.params.top_k or vocab] for row in rows])
    top_p = torch.tensor([[row.params.top_p] for row in rows], dtype=torch.float64)
    min_p = torch.tensor([[row.params.min_p] for row in rows], dtype=torch.float64)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (rank >= top_k) | (mass_before >= top_p) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False  # the most likely token always stays
    return probs.masked_fill(drop, 0.0)
