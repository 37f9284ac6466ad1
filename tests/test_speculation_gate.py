"""Where speculation pays, measured (qworker/engine/speculation_gate.py), on injected timings: it
learns both kinds of step, drafts where drafted steps make tokens faster and not where they are
slower, probes the other way now and then, and follows a change."""

from __future__ import annotations

from qworker.engine.speculation_gate import LEARN_STEPS, PROBE_EVERY, SpeculationGate


def run(gate: SpeculationGate, steps: int, drafted_s: float, plain_s: float,
        decodes: int = 1, tokens_drafted: int = 3) -> list[bool]:
    """`steps` steps at one batch size: a drafted one takes `drafted_s` for `tokens_drafted`
    tokens a sequence, a plain one `plain_s` for one; what the gate allowed each time."""
    allowed = []
    for _ in range(steps):
        draft = gate.allows(decodes)
        allowed.append(draft)
        if draft:
            gate.observe(decodes, True, drafted_s, decodes * tokens_drafted)
        else:
            gate.observe(decodes, False, plain_s, decodes)
    return allowed


def test_it_learns_both_kinds_then_drafts_where_it_pays() -> None:
    gate = SpeculationGate()
    allowed = run(gate, 2 * LEARN_STEPS + 4 * PROBE_EVERY, drafted_s=0.012, plain_s=0.010)
    assert allowed[: 2 * LEARN_STEPS].count(True) == LEARN_STEPS  # alternating while learning
    judged = allowed[2 * LEARN_STEPS:]  # 4 ms a token drafted against 10 plain: draft
    assert judged.count(False) == 4  # one probe in PROBE_EVERY
    assert gate.report() == {1: True}


def test_it_stops_where_drafted_steps_are_slower_per_token() -> None:
    gate = SpeculationGate()
    allowed = run(gate, 2 * LEARN_STEPS + 4 * PROBE_EVERY, drafted_s=0.040, plain_s=0.010,
                  decodes=4)  # 13.3 ms a token against 10
    assert allowed[2 * LEARN_STEPS:].count(True) == 4  # the probes only
    assert gate.report() == {4: False}
    assert gate.allows(2) is True  # another batch size learns on its own


def test_a_change_is_followed_through_the_probes() -> None:
    gate = SpeculationGate()
    run(gate, 2 * LEARN_STEPS + PROBE_EVERY, drafted_s=0.040, plain_s=0.010)
    assert gate.report() == {1: False}
    run(gate, 40 * PROBE_EVERY, drafted_s=0.012, plain_s=0.010)  # drafts start paying
    assert gate.report() == {1: True}
