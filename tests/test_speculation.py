"""Speculative decoding (speculation.py): the same tokens as decoding without it, greedy and
seeded, through rejected drafts, preemption, prefix caching, logprobs and structured output; the
sampled distribution unchanged (chi-square); the rule of when to speculate."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams, StepOutput, StructuredOutputs
from qworker.engine.scheduler import ScheduledStep
from qworker.engine.sequence import Sequence
from qworker.engine.simulated import SimulatedEngine
from qworker.engine.speculation import (
    NgramIndex,
    SpeculationLimits,
    Speculator,
    accepted_length,
)
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker.service.metrics import Metrics
from tests.engine_fixtures import tiny_engine, tiny_model

SPEC = dict(num_speculative_tokens=5, speculate_max_batch=8, speculate_min_acceptance=0.0,
            speculate_measured=False)  # every step drafts: the rule is under test, not the gate
Result = tuple[list[int], str | None]


def run(engine: EngineCore, requests: list[Request]) -> dict[str, StepOutput]:
    """Every request to its end, checking after each step that the pool is consistent and that
    no sequence holds a block past its tokens (a rejected draft's are freed); returns one joined
    output per request (its tokens, logprobs, finish)."""
    for request in requests:
        engine.add(request)
    joined: dict[str, StepOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in joined:
                joined[out.request_id] = out
                continue
            first = joined[out.request_id]
            first.new_token_ids += out.new_token_ids
            first.logprobs = (first.logprobs or []) + (out.logprobs or [])
            first.finished, first.finish_reason = out.finished, out.finish_reason
            first.error = out.error
        live = engine.scheduler.running + engine.scheduler.waiting
        engine.blocks.check(live)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= engine.blocks.blocks_for(len(seq.token_ids))
            assert not seq.draft
    return joined


def tokens(outputs: dict[str, StepOutput]) -> dict[str, Result]:
    return {rid: (out.new_token_ids, out.finish_reason) for rid, out in outputs.items()}


def repeating_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span of themselves (what prompt lookup drafts from)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        span = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12))]
        head = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 6))]
        prompts.append(head + span + [rng.randrange(3, vocab)] + span[: rng.randrange(1, 4)])
    return prompts


def requests(prompts: list[list[int]], params: Callable[[int], SamplingParams]) -> list[Request]:
    return [Request(f"r{i}", p, params(i)) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return tiny_model(4096, seed=3)  # a small vocabulary: the sampler's sort is short


def oracle(reference: dict[str, list[int]], wrong_at: int | None = None
           ) -> Callable[[Sequence, int], list[int]]:
    """A proposer that drafts what the sequence will really say (from a reference run), with
    draft token `wrong_at` replaced by another: every draft is then accepted up to there."""
    def propose(seq: Sequence, k: int) -> list[int]:
        draft = reference[seq.request_id][seq.num_output_tokens : seq.num_output_tokens + k]
        if wrong_at is not None and wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % 1000 + 3
        return draft
    return propose


def test_ngram_lookup_drafts_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex()
    assert index.propose([1, 2, 3], 4) == []  # nothing repeats
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3]
    assert index.propose(tokens, 4) == [4, 9, 2, 3]  # (1, 2, 3) last ended at 2
    tokens += [4, 9, 8]
    assert index.propose(tokens, 2) == []  # (4, 9, 8), (9, 8), (8) never seen
    tokens += [2, 3]
    assert index.propose(tokens, 3) == [4, 9, 8]  # (8, 2, 3) unseen; (2, 3) last ended at 12
    assert NgramIndex().propose([7, 7, 7, 7], 5) == [7]  # the latest match ends just before


def test_accepted_length_is_the_run_of_agreeing_rows() -> None:
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_length([], [4]) == 0


def test_greedy_and_seeded_sampling_give_the_same_tokens(smollm2_tokenizer: Tokenizer,
                                                         model: DecoderModel) -> None:
    prompts = repeating_prompts(9, 4000) + [[7, 8, 9, 10, 11, 12, 13, 14, 15] * 3]
    shared = [21, 22, 23, 24, 25, 26, 27, 28, 29]  # two blocks cached for the later ones
    prompts += [shared + p for p in repeating_prompts(3, 4000, seed=1)]

    def params(i: int) -> SamplingParams:
        if i % 3 == 0:
            return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=24, temperature=0.8 + 0.1 * (i % 4), seed=i,
                              top_p=0.95, repetition_penalty=1.0 + 0.1 * (i % 2),
                              presence_penalty=0.3 * (i % 3 == 2), min_tokens=4,
                              ignore_eos=bool(i % 2))

    plain = tokens(run(tiny_engine(smollm2_tokenizer, model, prefix_caching=False),
                       requests(prompts, params)))
    spec = tiny_engine(smollm2_tokenizer, model, **SPEC)
    assert tokens(run(spec, requests(prompts, params))) == plain
    stats = spec.stats()
    assert stats["spec_drafted"] > stats["spec_accepted"] > 0, "no draft was accepted or rejected"
    assert stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("wrong_at", [0, 2, None])
def test_rejected_drafts_roll_back_through_preemption(smollm2_tokenizer: Tokenizer,
                                                      model: DecoderModel,
                                                      wrong_at: int | None) -> None:
    """Drafts wrong at their first token, at their third, or right throughout (each spans
    blocks of 4), in a pool so small that sequences are preempted: the same tokens."""
    prompts = repeating_prompts(6, 3000, seed=2)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 1.0, seed=i,
                              ignore_eos=True)

    roomy = tiny_engine(smollm2_tokenizer, model)
    plain = tokens(run(roomy, requests(prompts, params)))
    tight = tiny_engine(smollm2_tokenizer, model, num_blocks=16, **SPEC)
    assert tight.speculator is not None
    tight.speculator.proposer = oracle({rid: t for rid, (t, _) in plain.items()}, wrong_at)
    assert tokens(run(tight, requests(prompts, params))) == plain
    assert tight.num_preemptions > 0
    drafted, accepted = tight.speculator.drafted, tight.speculator.accepted
    assert drafted > 0
    if wrong_at == 0:
        assert accepted == 0
    elif wrong_at is None:
        assert accepted == drafted
    else:
        assert 0 < accepted < drafted


def test_a_draft_past_a_stop_token_ends_there(smollm2_tokenizer: Tokenizer,
                                              model: DecoderModel) -> None:
    prompts = repeating_prompts(4, 3000, seed=5)
    free = SamplingParams(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True)
    unstopped = tokens(run(tiny_engine(smollm2_tokenizer, model),
                           requests(prompts, lambda i: free)))
    stops = {f"r{i}": unstopped[f"r{i}"][0][10] for i in range(len(prompts))}

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=1.0, seed=9,
                              stop_token_ids=(stops[f"r{i}"],))

    plain = tokens(run(tiny_engine(smollm2_tokenizer, model), requests(prompts, params)))
    spec = tiny_engine(smollm2_tokenizer, model, **SPEC)
    assert spec.speculator is not None
    spec.speculator.proposer = oracle({rid: t for rid, (t, _) in unstopped.items()})
    assert tokens(run(spec, requests(prompts, params))) == plain
    assert all(reason == "stop" for _, reason in plain.values())


def test_logprobs_of_accepted_tokens_are_those_of_plain_decoding(
        smollm2_tokenizer: Tokenizer, model: DecoderModel) -> None:
    prompts = repeating_prompts(5, 3000, seed=3)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 1.0, seed=i,
                              ignore_eos=True, logprobs=3)

    plain = run(tiny_engine(smollm2_tokenizer, model), requests(prompts, params))
    spec_engine = tiny_engine(smollm2_tokenizer, model, **SPEC)
    assert spec_engine.speculator is not None
    spec_engine.speculator.proposer = oracle({rid: o.new_token_ids for rid, o in plain.items()},
                                             wrong_at=3)
    spec = run(spec_engine, requests(prompts, params))
    assert spec_engine.speculator.accepted > 0
    for rid, out in plain.items():
        assert spec[rid].new_token_ids == out.new_token_ids
        got, want = spec[rid].logprobs or [], out.logprobs or []
        assert len(got) == len(want) == 16
        for a, b in zip(got, want, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-9)


def test_constrained_drafts_are_cut_by_the_grammar_and_opted_out_jobs_not_drafted(
        smollm2_tokenizer: Tokenizer) -> None:
    model = tiny_model(smollm2_tokenizer.vocab_size, seed=3)  # the grammar's vocabulary
    prompts = repeating_prompts(4, 3000, seed=4)
    schema = ('{"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, '
              '"required": ["a"], "additionalProperties": false}')
    constraints = {0: StructuredOutputs(regex="[a-z]{3,14}"), 3: StructuredOutputs(json=schema)}

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i,
                              structured_outputs=constraints.get(i), speculate=i != 1)

    plain = tokens(run(tiny_engine(smollm2_tokenizer, model), requests(prompts, params)))
    spec = tiny_engine(smollm2_tokenizer, model, **SPEC)
    assert spec.speculator is not None
    asked: list[str] = []
    right = oracle({rid: t for rid, (t, _) in plain.items()}, wrong_at=3)

    def propose(seq: Sequence, k: int) -> list[int]:
        asked.append(seq.request_id)
        return right(seq, k) + [5, 6]  # past its end: tokens the grammar refuses there
    spec.speculator.proposer = propose
    accepted: dict[str, int] = {}
    settle = spec.speculator.settle

    def counting(seq: Sequence) -> None:
        accepted[seq.request_id] = accepted.get(seq.request_id, 0) + seq.num_accepted
        settle(seq)
    spec.speculator.settle = counting  # type: ignore[method-assign]
    assert tokens(run(spec, requests(prompts, params))) == plain
    assert set(asked) == {"r0", "r2", "r3"}, "every job but the one that opted out"
    assert accepted["r0"] > 0 and accepted["r3"] > 0, accepted
    assert plain["r3"][1] == "stop", "the JSON is complete"


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """The p-value of observed `counts` against `probs` (bins expecting under 5 pooled)."""
    total = sum(counts)
    bins: list[tuple[float, float]] = []
    pooled = [0.0, 0.0]
    for count, p in zip(counts, probs, strict=True):
        if p * total >= 5:
            bins.append((count, p * total))
        else:
            pooled = [pooled[0] + count, pooled[1] + p * total]
    if pooled[1] > 0:
        bins.append((pooled[0], pooled[1]))
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    dof = torch.tensor((len(bins) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_tokens_keep_the_model_distribution(smollm2_tokenizer: Tokenizer) -> None:
    """A 16-token model at temperature 2: the first token (verified with a draft) and the second
    after an accepted draft token, over 1,500 seeds, against the model's own probabilities."""
    vocab, samples, temperature = 16, 1500, 2.0
    model = tiny_model(vocab, seed=11)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(0.3)  # flatter: not one token almost surely
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]  # a chunk of 8, then one token: a decode with a draft
    settings = dict(max_num_seqs=128, max_batched_tokens=1024, prefill_chunk=8)

    def distribution(context: list[int]) -> list[float]:
        """The probabilities the sampler draws from: softmax(logits / temperature)."""
        engine = tiny_engine(smollm2_tokenizer, model, **settings)
        [out] = run(engine, [Request("p", context, SamplingParams(
            max_tokens=1, logprobs=vocab, ignore_eos=True))]).values()
        assert out.logprobs is not None
        logprob = dict(out.logprobs[0].top)
        probs = torch.softmax(torch.tensor([logprob[t] for t in range(vocab)],
                                           dtype=torch.float64) / temperature, dim=0)
        return probs.tolist()

    first = distribution(prompt)
    likely = max(range(vocab), key=first.__getitem__)  # drafted: often accepted, often not
    second = distribution(prompt + [likely])
    engine = tiny_engine(smollm2_tokenizer, model, **settings, **{**SPEC,
                                                                 "speculate_max_batch": 128})
    assert engine.speculator is not None
    engine.speculator.proposer = lambda seq, k: [likely, (likely + 1) % vocab][:k]
    params = [SamplingParams(max_tokens=2, temperature=temperature, seed=s, ignore_eos=True)
              for s in range(samples)]
    outs = run(engine, [Request(f"s{s}", prompt, p) for s, p in enumerate(params)])
    firsts = [out.new_token_ids[0] for out in outs.values()]
    after = [out.new_token_ids[1] for out in outs.values() if out.new_token_ids[0] == likely]
    assert 0.1 < len(after) / samples < 0.9, "the draft should be accepted only sometimes"
    assert engine.speculator.drafted >= samples
    assert chi_square_p([firsts.count(t) for t in range(vocab)], first) > 1e-3
    assert chi_square_p([after.count(t) for t in range(vocab)], second) > 1e-3
    always = [likely] * samples  # what accepting every draft would give: far off
    assert chi_square_p([always.count(t) for t in range(vocab)], first) < 1e-6


def speculator(num_free: int = 100, max_batch: int = 2, floor: float = 0.5) -> Speculator:
    from qworker.engine.block_manager import BlockManager

    return Speculator(SpeculationLimits(4, max_batch, floor), BlockManager(num_free, 4), 1000,
                      proposer=lambda seq, k: [1, 2, 3, 4][:k])


def decoding(rid: str, params: SamplingParams | None = None) -> Sequence:
    from qworker.engine.text import TextStream

    seq = Sequence(rid, [5, 6, 7, 8, 9], 4, params or SamplingParams(), 0, 0, 0,
                   TextStream(None))  # type: ignore[arg-type]
    seq.num_computed = 4
    return seq


def test_the_rule_speculates_in_small_batches_and_pauses_on_low_acceptance() -> None:
    spec = speculator()
    one, two, three = decoding("a"), decoding("b"), decoding("c")
    for seq in (one, two, three):
        spec.blocks.grow(seq, 5)
    assert not spec.draft(ScheduledStep(work=[(one, 1), (two, 1), (three, 1)]))  # too many
    step = ScheduledStep(work=[(one, 1), (two, 1)])
    assert spec.draft(step)
    assert step.work == [(one, 5), (two, 5)] and one.draft == [1, 2, 3, 4]
    assert len(one.block_table) == 3  # 5 tokens and 4 drafted: 9 slots
    attempts = 1
    while True:  # nothing accepted: its recent rate falls 1 -> 0.75 -> 0.56 -> 0.42 < 0.5
        one.num_accepted = 0
        spec.settle(one)
        one.draft = []
        if not spec.draft(ScheduledStep(work=[(one, 1)])):
            break
        attempts += 1
    assert attempts == 3, "paused after its third rejected draft"
    one.token_ids += [1] * 17  # its correction token, then 16 later it tries again
    one.num_computed = len(one.token_ids) - 1
    assert spec.draft(ScheduledStep(work=[(one, 1)]))
    assert (spec.drafted, spec.accepted) == (12, 0)


def test_a_draft_takes_only_blocks_beyond_the_reserve() -> None:
    from qworker.engine.block_manager import BlockManager

    blocks = BlockManager(3, 4)
    spec = Speculator(SpeculationLimits(4, 4, 0.5, reserve_blocks=1), blocks, 1000,
                      proposer=lambda seq, k: [1, 2, 3, 4][:k])
    seq = decoding("a", SamplingParams(max_tokens=10))
    blocks.grow(seq, 5)  # 2 blocks; the last one left is the reserve's
    step = ScheduledStep(work=[(seq, 1)])
    assert spec.draft(step)
    assert seq.draft == [1, 2, 3] and step.work == [(seq, 4)]  # fits its blocks: 8 slots
    seq.draft = []
    seq.params = SamplingParams(max_tokens=3)  # one generated; a draft of one, then one more
    assert spec.draft(ScheduledStep(work=[(seq, 1)])) and seq.draft == [1]


def test_the_simulated_engine_speculates_alike() -> None:
    prompts = [list(b"abcabcabcabcabc"), list(b"the cat and the cat and the")]
    requests_ = [Request(f"s{i}", p, SamplingParams(max_tokens=30, seed=i, logprobs=2))
                 for i, p in enumerate(prompts)]
    requests_.append(Request("s2", list(b"abab"), SamplingParams(
        max_tokens=30, seed=2, structured_outputs=StructuredOutputs(regex="(ab|ba)+c"))))
    plain = run(SimulatedEngine(EngineConfig(model="sim")), requests_)
    engine = SimulatedEngine(EngineConfig(model="sim", **SPEC))  # type: ignore[arg-type]
    assert engine.speculator is not None
    engine.speculator.proposer = oracle({r: o.new_token_ids for r, o in plain.items()},
                                        wrong_at=2)
    requests_ = [Request(r.request_id, r.prompt_token_ids, r.params) for r in requests_]
    spec = run(engine, requests_)
    assert tokens(spec) == tokens(plain)
    assert [o.logprobs for o in spec.values()] == [o.logprobs for o in plain.values()]
    assert engine.speculator.accepted > 0


def test_speculation_figures_reach_the_metrics() -> None:
    class Stats:
        figures = {"spec_drafted": 10, "spec_accepted": 4}

        def stats(self) -> dict[str, int]:
            return self.figures

    metrics, engine = Metrics(), Stats()
    metrics.tick(engine)
    engine.figures = {"spec_drafted": 30, "spec_accepted": 24}
    metrics.tick(engine)
    value = metrics.registry.get_sample_value
    assert value("qworker_spec_draft_tokens_total") == 30
    assert value("qworker_spec_accepted_tokens_total") == 24
    assert value("qworker_spec_acceptance_rate") == pytest.approx(0.8)
    assert value("qworker_engine_threads") == 0  # not reported: never set
    engine.figures = {"threads": 1}
    metrics.tick(engine)
    assert value("qworker_engine_threads") == 1


COPY = ("Repeat this code exactly, but rename the function to `total`:\n\n"
        "def add_all(values):\n    result = 0\n    for value in values:\n"
        "        result += value\n    return result\n")
EXTRACT = ("From the text below, copy the sentence that names the capital.\n\nThe river runs "
           "north. Paris is the capital of France and its largest city. Bread is baked daily.")


def test_smollm2_greedy_is_identical_with_speculation(smollm2_path: Path,
                                                      smollm2_tokenizer: Tokenizer) -> None:
    model = load_model(smollm2_path, dtype=torch.float32)
    chats = [COPY, EXTRACT, "What is the capital of France?",
             'Return this JSON unchanged: {"name": "Ada", "born": 1815, "tags": ["math"]}']
    prompts = [smollm2_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats]
    config = dict(num_blocks=128, block_size=16, max_num_seqs=8, prefill_chunk=64,
                  max_batched_tokens=512)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = Engine(model, smollm2_tokenizer, EngineConfig(**config))  # type: ignore[arg-type]
    spec = Engine(model, smollm2_tokenizer, EngineConfig(**config, **SPEC))  # type: ignore[arg-type]
    want = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in spec.generate(prompts, params)] == want
    stats = spec.stats()
    assert stats["spec_accepted"] > 10, stats
    assert "total" in smollm2_tokenizer.decode(want[0]), "the model did not copy the code"


def test_a_failing_step_with_drafts_costs_only_its_culprit(smollm2_tokenizer: Tokenizer,
                                                           model: DecoderModel) -> None:
    """A step that raises is run again in halves (core.py): the drafted sequences beside the
    culprit are verified again and give the tokens they give without the culprit."""
    prompts = repeating_prompts(4, 3000, seed=6)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True)

    plain = tokens(run(tiny_engine(smollm2_tokenizer, model), requests(prompts, params)))
    spec = tiny_engine(smollm2_tokenizer, model, **SPEC)
    assert spec.speculator is not None
    spec.speculator.proposer = oracle({rid: t for rid, (t, _) in plain.items()}, wrong_at=2)
    real_run = spec.runner.run

    def run_step(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        culprit = next((s for s, _ in work if s.request_id == "r1" and s.num_output_tokens >= 5),
                       None)
        if culprit is not None:
            raise RuntimeError("boom")
        return real_run(work)
    spec.runner.run = run_step  # type: ignore[method-assign]
    got = run(spec, requests(prompts, params))
    assert got["r1"].finished and (got["r1"].error or "").startswith("RuntimeError")
    assert {rid: r for rid, r in tokens(got).items() if rid != "r1"} == {
        rid: r for rid, r in plain.items() if rid != "r1"}
    assert spec.speculator.accepted > 0
