"""`qworker submit --json-schema FILE | --json-object | --regex | --choice | --grammar FILE`:
each becomes the job's `structured_outputs` field; two at once, or an unreadable file, is a usage
error with nothing sent."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from tests.test_producer_cli import cli

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}}


def test_each_flag_becomes_the_structured_outputs_field(redis_url: str, tmp_path: Path) -> None:
    schema, grammar = tmp_path / "schema.json", tmp_path / "g.lark"
    schema.write_text(json.dumps(SCHEMA))
    grammar.write_text('start: "a"+')
    flags = [["--json-schema", str(schema)], ["--json-object"], ["--regex", "[0-9]+"],
             ["--choice", "yes", "--choice", "no"], ["--grammar", str(grammar)]]
    for args in flags:
        run = cli("submit", "p", *args, "--no-wait", "--prefix", "so", redis_url=redis_url)
        assert run.returncode == 0, run.stderr
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    sent = [json.loads(f["structured_outputs"]) for _, f in client.xrange("so:jobs")]
    assert sent == [{"json": SCHEMA}, {"json_object": True}, {"regex": "[0-9]+"},
                    {"choice": ["yes", "no"]}, {"grammar": 'start: "a"+'}]
    for args in (["--regex", "a", "--choice", "b"], ["--json-schema", str(tmp_path / "none")]):
        refused = cli("submit", "p", *args, "--no-wait", "--prefix", "so", redis_url=redis_url)
        assert refused.returncode == 2 and refused.stderr, args
    assert client.xlen("so:jobs") == len(flags)
