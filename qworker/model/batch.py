"""A packed (ragged) forward batch: the new tokens of several sequences, concatenated.

Dense layers run once over all packed tokens; attention splits them back per sequence: single-token
decodes are attended in a few batched calls (grouped by length), prefill chunks one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# decode groups: a group takes sequences up to GROUP_SPREAD times its shortest (in blocks), and
# at least MIN_GROUP of them, so that a few calls cover any mix of lengths
GROUP_SPREAD = 1.5
MIN_GROUP = 8


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a step: its new tokens and where its cache stands."""

    token_ids: list[int]  # the new tokens computed this step (a prefill chunk, or one decode token)
    num_cached: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # cache blocks of the sequence, in order; enough for all its tokens
    need_logits: bool = True  # whether the last new token's logits are wanted
    # logits of every new token (prompt logprobs), in order; includes the last one
    all_logits: bool = False
    # the blocks of the model's windowed KV group (kv_cache.KVLayout), where it has two: as long
    # as block_table, the entries behind the window null (never read)
    window_table: list[int] | None = None
    # its tokens attended as decodes, one row each (a speculative draft's verification): every
    # layer writes all rows' keys and values before it attends, so row i reads the rows before
    # it as a chunk would, and the step stays one the decode kernels (and graph) serve
    as_decodes: bool = False


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token sequences of similar context length, attended in one batched call."""

    rows: slice | torch.Tensor  # their rows in the packed batch (a slice when consecutive)
    block_tables: torch.Tensor  # [D, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [D] tokens each attends to (cached + the new one)


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's multi-token chunk: packed rows [start, end), causal after num_cached."""

    start: int
    end: int
    num_cached: int
    block_table: torch.Tensor  # [blocks covering num_cached + chunk length]


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] absolute positions
    slot_mapping: torch.Tensor  # [N] flat cache slot (block * block_size + offset) per token
    logits_indices: torch.Tensor  # [S_out] packed rows whose logits are returned, in input order
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    block_size: int
    # the same batch through the windowed KV group's block tables (its own slots, decode and
    # chunk tables), where the model has two groups
    window: ForwardBatch | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_batch(
    seqs: list[SequenceInput], block_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    batch = _build(seqs, block_size, device)
    if not seqs or seqs[0].window_table is None:
        return batch
    assert all(s.window_table is not None for s in seqs), "window tables for some sequences"
    window = _build([replace(s, block_table=s.window_table or []) for s in seqs], block_size,
                    device)
    return replace(batch, window=window)


def _build(
    seqs: list[SequenceInput], block_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    for seq in seqs:
        start, n = len(ids), len(seq.token_ids)
        total = seq.num_cached + n
        assert n >= 1, "a scheduled sequence computes at least one token"
        assert len(seq.block_table) * block_size >= total, "block table too short"
        ids.extend(seq.token_ids)
        for pos in range(seq.num_cached, total):
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        if seq.all_logits:
            logits_rows.extend(range(start, start + n))
        elif seq.need_logits:
            logits_rows.append(start + n - 1)
        if n == 1 or seq.as_decodes:
            for row, length in enumerate(range(seq.num_cached + 1, total + 1), start=start):
                decode_rows.append(row)
                decode_tables.append(seq.block_table[: -(-length // block_size)])
                decode_lens.append(length)
        else:
            table = torch.tensor(seq.block_table[: -(-total // block_size)], dtype=torch.long)
            prefills.append(PrefillChunk(start, start + n, seq.num_cached, table.to(device)))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=as_tensor(ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        logits_indices=as_tensor(logits_rows),
        decodes=_decode_groups(decode_rows, decode_tables, decode_lens, device),
        prefills=tuple(prefills),
        block_size=block_size,
    )


def _decode_groups(
    rows: list[int], tables: list[list[int]], lens: list[int], device: torch.device | str
) -> tuple[DecodeGroup, ...]:
    """Groups decodes of similar length, so padding every table to the longest wastes little.
    Decodes given in order of length (as the runner gives them) make groups of consecutive rows."""
    order = sorted(range(len(rows)), key=lambda i: len(tables[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) < MIN_GROUP or
                       len(tables[i]) <= GROUP_SPREAD * len(tables[groups[-1][0]])):
            groups[-1].append(i)
        else:
            groups.append([i])
    return tuple(_decode_group([rows[i] for i in g], [tables[i] for i in g],
                               [lens[i] for i in g], device) for g in groups)


def _decode_group(
    rows: list[int], tables: list[list[int]], lens: list[int], device: torch.device | str
) -> DecodeGroup:
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeGroup(
        rows=slice(rows[0], rows[0] + len(rows)) if consecutive
        else torch.tensor(rows, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device),
        context_lens=torch.tensor(lens, dtype=torch.long, device=device),
    )
