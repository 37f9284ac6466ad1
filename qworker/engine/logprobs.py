"""Log-probabilities of chosen tokens, from raw logits: float32 log_softmax, then the top k.

As vLLM's default, they describe the model's own distribution: before temperature, penalties,
bans and any other edit the sampler makes to its copy of the logits.
"""

from __future__ import annotations

import torch

from qworker.engine.request import TokenLogprobs


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] raw logits -> float32 log-probabilities (a new tensor: the logits stay)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], top: list[int]
                   ) -> list[TokenLogprobs]:
    """Row r: the logprob of token_ids[r] and the top[r] most likely tokens, best first."""
    assert logprobs.shape[0] == len(token_ids) == len(top), "one token and one k per row"
    if not token_ids:
        return []
    index = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    k = max(top)
    best_values: list[list[float]] = [[] for _ in token_ids]
    best_ids: list[list[int]] = [[] for _ in token_ids]
    if k:
        values, ids = logprobs.topk(k, dim=-1)  # sorted, best first
        best_values, best_ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(token_ids[r], chosen[r],
                          tuple(zip(best_ids[r][: top[r]], best_values[r][: top[r]], strict=True)))
            for r in range(len(token_ids))]
