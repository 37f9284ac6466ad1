"""Log-probabilities of chosen tokens, from raw logits: logit - logsumexp(row), and the top k.

As vLLM's default, they describe the model's own distribution: before temperature, penalties,
bans and any other edit the sampler makes to its copy of the logits. No log_softmax is
materialized and no row copied: the native kernel reads the asked rows where they are (a pass
for the chunks' maxes, one for the sum of exp, the top k from the few chunks that can hold it).
Without it, the torch path: log_softmax of a copy of the asked rows, then gather and topk.
"""

from __future__ import annotations

import torch

from qworker.engine.request import TokenLogprobs
from qworker.model.kernels import native


def token_logprobs(logits: torch.Tensor, rows: list[int], token_ids: list[int], top: list[int],
                   native_kernel: bool = True) -> list[TokenLogprobs]:
    """For each i: row rows[i] of the raw logits [*, vocab], the logprob of token_ids[i] in it and
    its top[i] most likely tokens, best first. The logits are not changed. native_kernel=False:
    the torch path even where the kernel runs (tests, benchmarks/logprobs_step.py)."""
    assert len(rows) == len(token_ids) == len(top), "one row, one token and one k each"
    if not rows:
        return []
    k = max(top)
    row_index = torch.tensor(rows, dtype=torch.long)
    chosen_ids = torch.tensor(token_ids, dtype=torch.long)
    if native_kernel and logits.device.type == "cpu" and native.library() is not None:
        if logits.dtype != torch.float32:  # only the asked rows, in float32
            logits, row_index = logits[row_index].float(), torch.arange(len(rows))
        chosen, values, ids = native.logprobs(logits, row_index, chosen_ids, k)
    else:
        chosen, values, ids = _torch_logprobs(logits, row_index.to(logits.device),
                                              chosen_ids.to(logits.device), k)
    chosen_list, value_lists, id_lists = chosen.tolist(), values.tolist(), ids.tolist()
    return [TokenLogprobs(token_ids[i], chosen_list[i],
                          tuple(zip(id_lists[i][: top[i]], value_lists[i][: top[i]], strict=True)))
            for i in range(len(rows))]


def _torch_logprobs(logits: torch.Tensor, rows: torch.Tensor, chosen_ids: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What native.logprobs computes, in float32 torch (no native build, or not on the CPU)."""
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    values, ids = lp.topk(k, dim=-1)  # sorted, best first
    return lp.gather(1, chosen_ids[:, None]).squeeze(1), values, ids
