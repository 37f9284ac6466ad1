"""Structured output: the sampler masks only constrained rows; the engine's matchers follow every
token (replayed ones too) and end a job when its grammar is complete; invalid constraints are
refused at add; the real default model writes schema-valid JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import (
    Request,
    RequestRejectedError,
    SamplingParams,
    StructuredOutputs,
)
from qworker.engine.sampler import Allowed, SampleRow, sample
from qworker.engine.simulated import SimulatedEngine, run_offline
from qworker.engine.structured import allowed_masks, mask_biases
from qworker.model.decoder import load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker_client.protocol import JobValidationError, parse_job_fields

VOCAB = 64


def _row(params: SamplingParams, seed: int = 1) -> SampleRow:
    return SampleRow(params, seed, 0, [1, 2, 3], 3, ())


# ------------------------------------------------------------------------------ sampler


def test_the_mask_applies_to_constrained_rows_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    rows = [_row(greedy), _row(greedy), _row(hot, seed=5), _row(hot, seed=5)]
    free = sample(logits, rows)
    allowed_ids = [7, 11, 40]
    assert logits[1].argmax().item() not in allowed_ids  # so the mask must change row 1
    bias = torch.full((2, VOCAB), float("-inf"))
    bias[:, allowed_ids] = 0.0
    before = logits.clone()
    chosen = sample(logits, rows, Allowed([1, 3], bias))
    assert torch.equal(logits, before), "the sampler edited the caller's logits"
    assert chosen[0] == free[0] and chosen[2] == free[2], "an unconstrained row changed"
    assert chosen[1] == max(allowed_ids, key=lambda t: logits[1, t].item())
    assert chosen[3] in allowed_ids
    assert sample(logits, rows, None) == free


def test_a_constrained_row_samples_only_allowed_tokens_at_any_seed() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    bias = torch.full((1, VOCAB), float("-inf"))
    bias[0, [3, 9]] = 0.0
    hot = SamplingParams(temperature=2.0, top_p=0.9)
    picked = {sample(logits, [_row(hot, seed)], Allowed([0], bias))[0] for seed in range(200)}
    assert picked == {3, 9}


def test_mask_biases_are_the_allowed_masks_as_0_and_minus_inf() -> None:
    engine = _sim()
    matchers = [engine.grammars.matcher(StructuredOutputs(regex=r"[a-c]x")),
                engine.grammars.matcher(StructuredOutputs(json_object=True))]
    assert matchers[0].advance(ord("b"))
    allowed, biases = allowed_masks(matchers), mask_biases(matchers)
    assert allowed.shape == biases.shape == (2, 256)
    assert (biases == 0).tolist() == allowed.tolist()
    assert bool(np.isneginf(biases[~allowed]).all())
    assert np.flatnonzero(allowed[0]).tolist() == [ord("x")]


# ------------------------------------------------------------------------------ protocol


@pytest.mark.parametrize("value", [
    "{}", '{"regex": "a", "choice": ["x"]}', '{"json_object": false}', '{"choice": []}',
    '{"json": true}', '{"grammar": ""}', '{"regex": "' + "a" * 70_000 + '"}',
    json.dumps({"json": {"enum": ["x" * 1000] * 70}}), '{"jsonschema": {}}',
])
def test_a_malformed_structured_outputs_field_is_refused_on_the_wire(value: str) -> None:
    with pytest.raises(JobValidationError, match="structured_outputs"):
        parse_job_fields({"prompt": "x", "structured_outputs": value}, "1-0")


def test_structured_outputs_round_trips_on_the_wire() -> None:
    value = {"json": {"type": "object", "properties": {"a": {"default": None}}}}
    job = parse_job_fields({"prompt": "x", "structured_outputs": json.dumps(value)}, "1-0")
    assert job.structured_outputs is not None
    assert json.loads(job.to_fields()["structured_outputs"]) == value


# ------------------------------------------------------------------------------ engine (sim)


def _sim() -> SimulatedEngine:
    return SimulatedEngine(EngineConfig(model="sim:step_ms=0", num_blocks=256, block_size=4))


def _constrained(max_tokens: int = 60, seed: int = 0, **kind: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputs(**kind))


def test_choice_and_regex_end_with_stop_when_complete() -> None:
    engine = _sim()
    done = engine.generate(["a", "b", "c", "d"], [
        _constrained(choice=("yes", "no", "maybe")), _constrained(seed=3, choice=("yes", "no")),
        _constrained(regex=r"[0-9]{3}-[a-z]{2}"), _constrained(seed=9, regex=r"[0-9]{3}-[a-z]{2}"),
    ])
    assert done[0].text in ("yes", "no", "maybe") and done[1].text in ("yes", "no")
    for c in done[2:]:
        assert len(c.text) == 6 and c.text[:3].isdigit() and c.text[3] == "-", c.text
    assert all(c.finish_reason == "stop" for c in done)


def test_a_resumed_constrained_request_continues_exactly() -> None:
    schema = json.dumps({"type": "object", "properties": {
        "k": {"enum": ["alpha", "beta"]}, "n": {"type": "integer", "maximum": 99999}},
        "required": ["k", "n"], "additionalProperties": False})
    params = _constrained(max_tokens=80, seed=4, json=schema)
    whole = _sim().generate([[104, 105]], params)[0]
    assert whole.finish_reason == "stop"
    json.loads(whole.text)
    for cut in (1, len(whole.token_ids) // 2, len(whole.token_ids) - 1):
        replayed = whole.token_ids[:cut]
        engine = _sim()
        got = run_offline(engine, [Request("r", [104, 105], params, output_token_ids=replayed)])
        assert got["r"].token_ids == whole.token_ids, cut
        assert got["r"].finish_reason == "stop"


def test_a_replayed_token_outside_the_grammar_fails_that_request() -> None:
    engine = _sim()
    params = _constrained(choice=("yes", "no"))
    got = engine.generate([[104]], params)  # warm: the same engine
    assert got[0].text in ("yes", "no")
    engine.add(Request("bad", [104], params, output_token_ids=[ord("x")]))
    outs = engine.step()
    assert [(o.request_id, o.finished) for o in outs] == [("bad", True)]
    assert outs[0].error and "does not fit structured_outputs" in outs[0].error


@pytest.mark.parametrize(("kind", "message"), [
    ({"regex": "(a"}, "regex"),
    ({"grammar": "start: foo"}, "foo"),
    ({"json": json.dumps({"type": "strin"})}, "strin"),
    ({"json": json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})},
     "nowhere"),
])
def test_an_invalid_constraint_is_refused_at_add(kind: dict[str, Any], message: str) -> None:
    engine = _sim()
    with pytest.raises(RequestRejectedError, match=message) as caught:
        engine.add(Request("r", [104], _constrained(**kind)))
    assert caught.value.code == "invalid_request"
    assert not engine.has_unfinished()


def test_a_gbnf_grammar_is_taken_too() -> None:
    grammar = 'root ::= "(" digit digit ")"\ndigit ::= [0-9]'
    done = _sim().generate([[104]], _constrained(grammar=grammar))[0]
    assert len(done.text) == 4 and done.text[0] == "(" and done.text[1:3].isdigit(), done.text


# ------------------------------------------------------------------------------ real model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"], "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 8},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["open", "shipped"]},
    },
    "required": ["id", "items", "status"], "additionalProperties": False,
}


def test_the_real_model_writes_schema_valid_json(smollm2_path: Path,
                                                 smollm2_tokenizer: Tokenizer) -> None:
    engine = Engine(load_model(smollm2_path, dtype=torch.float32), smollm2_tokenizer,
                    EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8))
    chat = [{"role": "user", "content": "Describe a person, then an order, as JSON."}]
    prompt = smollm2_tokenizer.encode_chat(chat)
    schemas = [PERSON, PERSON, ORDER]
    params = [SamplingParams(max_tokens=64, temperature=t, seed=7,
                             structured_outputs=StructuredOutputs(json=json.dumps(s)))
              for s, t in zip(schemas, (0.0, 0.8, 0.0), strict=True)]
    params += [
        SamplingParams(max_tokens=8, temperature=0.0,
                       structured_outputs=StructuredOutputs(choice=("positive", "negative"))),
        SamplingParams(max_tokens=12, temperature=0.7, seed=3,
                       structured_outputs=StructuredOutputs(regex=r"[0-9]{2}:[0-9]{2}")),
        SamplingParams(max_tokens=8, temperature=0.0),  # unconstrained beside them
    ]
    done = engine.generate([prompt] * len(params), params)
    for schema, c in zip(schemas, done, strict=False):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert done[3].text in ("positive", "negative") and done[3].finish_reason == "stop"
    assert len(done[4].text) == 5 and done[4].text[2] == ":", done[4].text
    assert done[5].finish_reason == "length" and not done[5].text.startswith("{")
