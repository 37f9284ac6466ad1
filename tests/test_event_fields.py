"""The loop's hand-encoded token events against the protocol's own encoding, field for field."""

from __future__ import annotations

import math
import random

from qworker.service.event_fields import event_fields
from qworker_client.protocol import DoneEvent, TokenEvent, TopLogprob, event_to_fields

TEXTS = ["", "a", " the", '"quoted"\\', "é中\U0001f600", "\n\t\x00", "\ufffd"]
FLOATS = [0.0, -0.0, -1e-05, -3.2e-12, -0.6931471805599453, -17.25, -math.inf, -1.5e300]


def random_token_event(rng: random.Random) -> TokenEvent:
    with_text = rng.random() < 0.5
    tops = None
    if rng.random() < 0.7:
        tops = [TopLogprob(token_id=rng.randrange(50_000), logprob=rng.choice(FLOATS),
                           token=rng.choice(TEXTS) if with_text else None)
                for _ in range(rng.randint(0, 5))]
    return TokenEvent(i=rng.randrange(10_000), token_id=rng.randrange(50_000),
                      text=rng.choice(TEXTS),
                      logprob=rng.choice([None, *FLOATS, rng.uniform(-30, 0)]),
                      top_logprobs=tops, token=rng.choice(TEXTS) if with_text else None)


def test_token_events_encode_exactly_as_the_protocol_does() -> None:
    rng = random.Random(0)
    for _ in range(300):
        event = random_token_event(rng)
        got = event_fields(event)
        assert list(got.items()) == list(event_to_fields(event).items()), event
        if "Infinity" not in got.get("top_logprobs", ""):  # the wire's JSON has no infinities
            assert TokenEvent.model_validate(got) == event  # they read back as the event


def test_other_events_take_the_protocol_path() -> None:
    done = DoneEvent(finish_reason="length", text="x", prompt_tokens=3, completion_tokens=2,
                     queue_ms=1, ttft_ms=2, total_ms=3)
    assert event_fields(done) == event_to_fields(done)
