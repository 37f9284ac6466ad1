"""The prefill pacer sizes prefill beside decodes from measured step times."""

from __future__ import annotations

import pytest

from qworker.engine.pacer import PrefillPacer
from qworker.engine.request import Request, SamplingParams
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model


def test_steps_without_decodes_are_not_paced() -> None:
    assert PrefillPacer(stretch=2.0, max_tokens=512).budget(decoding=False) == 512


def test_it_learns_before_it_spends() -> None:
    pacer = PrefillPacer(stretch=2.0, max_tokens=512, min_tokens=16)
    assert pacer.budget(decoding=True) == 16
    pacer.observe(decodes=32, prefill_tokens=0, seconds=0.060)  # a decode-only step
    assert pacer.budget(decoding=True) == 16  # no prefill cost measured yet


def test_budget_keeps_a_mixed_step_near_stretch_times_a_decode_step() -> None:
    pacer = PrefillPacer(stretch=2.5, max_tokens=512, smoothing=1.0)
    pacer.observe(decodes=32, prefill_tokens=0, seconds=0.060)
    pacer.observe(decodes=32, prefill_tokens=100, seconds=0.160)  # 1 ms per prefill token
    budget = pacer.budget(decoding=True)
    assert budget == 90  # (2.5 - 1) * 60 ms at 1 ms a token
    # the prompt's later tokens attend to more context and cost more: the budget shrinks
    pacer.observe(decodes=32, prefill_tokens=budget, seconds=0.060 + budget * 0.003)
    assert pacer.budget(decoding=True) == 30


def test_budget_stays_within_its_bounds() -> None:
    pacer = PrefillPacer(stretch=3.0, max_tokens=256, min_tokens=8, smoothing=1.0)
    pacer.observe(decodes=4, prefill_tokens=0, seconds=0.050)
    pacer.observe(decodes=4, prefill_tokens=10, seconds=0.050)  # prefill looked free
    assert pacer.budget(decoding=True) == 256
    pacer.observe(decodes=4, prefill_tokens=10, seconds=5.0)  # prefill looked dear
    assert pacer.budget(decoding=True) == 8


def test_a_prefill_only_step_measures_the_whole_step() -> None:
    pacer = PrefillPacer(stretch=2.0, max_tokens=512, smoothing=1.0)
    pacer.observe(decodes=0, prefill_tokens=200, seconds=0.100)
    pacer.observe(decodes=10, prefill_tokens=0, seconds=0.040)
    assert pacer.budget(decoding=True) == 80  # 40 ms of room at 0.5 ms a token


@pytest.mark.parametrize("stretch", [1.0, 0.5])
def test_stretch_must_exceed_one(stretch: float) -> None:
    with pytest.raises(AssertionError):
        PrefillPacer(stretch=stretch, max_tokens=64)


def test_the_engine_setting_is_checked() -> None:
    from qworker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="decode_stretch"):
        EngineConfig(decode_stretch=1.0)


def test_every_few_paced_steps_one_decodes_alone_to_remeasure() -> None:
    pacer = PrefillPacer(stretch=2.0, max_tokens=512, refresh_every=4, smoothing=1.0)
    pacer.observe(decodes=8, prefill_tokens=0, seconds=0.050)
    pacer.observe(decodes=8, prefill_tokens=50, seconds=0.100)
    budgets = [pacer.budget(decoding=True) for _ in range(8)]
    assert budgets == [50, 50, 50, 0, 50, 50, 50, 0]
    assert pacer.budget(decoding=False) == 512  # unpaced steps do not count
    # decodes got dearer: the decode-only step measures it, and the budget follows
    pacer.observe(decodes=8, prefill_tokens=0, seconds=0.100)
    assert pacer.budget(decoding=True) == 100


def test_a_zero_budget_step_still_decodes(smollm2_tokenizer: Tokenizer) -> None:
    engine = tiny_engine(smollm2_tokenizer, tiny_model(smollm2_tokenizer.vocab_size))
    engine.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)))
    engine.step()  # prefill: a decodes from now on
    engine.add(Request("b", list(range(40, 80)), SamplingParams(max_tokens=5, ignore_eos=True)))
    step = engine.scheduler.schedule(budget=0)
    assert [(seq.request_id, n) for seq, n in step.work] == [("a", 1)]
