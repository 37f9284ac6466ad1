"""An OpenAI request body as jobs (`gateway.chat.translate`): fields mapped to the wire,
choices and seeds laid out, and each unsupported or malformed part refused with a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest

from qworker_client.gateway.chat.translate import translate
from qworker_client.gateway.errors import APIError


def chat(**body: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}


def test_fields_go_to_the_wire_names() -> None:
    req = translate("chat", chat(max_completion_tokens=7, max_tokens=99, stop="\n", top_k=3,
                                 temperature=0.5, user="u", ignore_eos=True, speculate=False),
                    max_n=4)
    spec = req.choices[0].spec
    assert (spec["max_tokens"], spec["stop"], spec["top_k"], spec["temperature"]) == (
        7, ["\n"], 3, 0.5)
    assert spec["ignore_eos"] is True and "user" not in spec
    assert spec["speculate"] is False
    assert spec["id"] == req.response_id and req.response_id.startswith("chatcmpl-")


def test_roles_and_text_parts() -> None:
    req = translate("chat", {"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                     "text": "b"}]}]}, 1)
    assert req.choices[0].spec["messages"] == [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "ab"}]


def test_prompts_and_choices_are_laid_out_prompt_major() -> None:
    req = translate("completion", {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "seed": 10},
                    max_n=4)
    assert [(c.index, c.prompt_index, c.spec["prompt_token_ids"], c.spec["seed"])
            for c in req.choices] == [(0, 0, [1, 2], 10), (1, 0, [1, 2], 11),
                                      (2, 1, [3], 10), (3, 1, [3], 11)]
    assert [c.job_id for c in req.choices] == [f"{req.response_id}.{k}" for k in range(4)]
    assert translate("completion", {"model": "m", "prompt": [5, 6]}, 1).choices[0].spec[
        "prompt_token_ids"] == [5, 6]


def test_logprobs_ask_for_each_tokens_text() -> None:
    chat_req = translate("chat", chat(logprobs=True, top_logprobs=3), 1)
    completion_req = translate("completion", {"model": "m", "prompt": "x", "logprobs": 0}, 1)
    for req, k in ((chat_req, 3), (completion_req, 0)):
        assert req.logprobs and req.choices[0].spec["logprobs"] == k
        assert req.choices[0].spec["logprobs_text"] is True
    plain = translate("chat", chat(logprobs=False), 1)
    assert not plain.logprobs and "logprobs" not in plain.choices[0].spec


def test_stream_options_and_detach() -> None:
    req = translate("chat", chat(stream=True, stream_options={"include_usage": True},
                                 detach=True), 1)
    assert (req.stream, req.include_usage, req.detach) == (True, True, True)


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("chat", {"messages": [{"role": "user", "content": "x"}]}, "model"),
    ("chat", chat(logprobs=1), "logprobs"),
    ("chat", chat(top_logprobs=2), "top_logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("completion", {"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
    ("chat", chat(tools=[{"type": "code_interpreter"}]), "tools"),
    ("chat", chat(n=0), "n"),
    ("chat", chat(n=5), "n"),
    ("chat", chat(seed=-1), "seed"),
    ("chat", chat(response_format={"type": "xml"}), "response_format"),
    ("chat", chat(stream_options="yes"), "stream_options"),
    ("chat", {"model": "m", "messages": []}, "messages"),
    ("chat", {"model": "m", "messages": [{"content": "x"}]}, "messages[0]"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": None}]},
     "messages[0].content"),
    ("completion", {"model": "m", "prompt": "x", "echo": True}, "echo"),
    ("completion", {"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
    ("completion", {"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ("completion", {"model": "m", "prompt": ["x", 1]}, "prompt"),
    ("completion", {"model": "m", "prompt": []}, "prompt"),
])
def test_what_is_refused_names_its_parameter(kind: Any, body: dict[str, Any],
                                             param: str) -> None:
    with pytest.raises(APIError) as caught:
        translate(kind, body, max_n=4)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_a_body_that_is_not_an_object() -> None:
    with pytest.raises(APIError, match="JSON object"):
        translate("chat", [1, 2], max_n=1)


def test_the_session_comes_from_prompt_cache_key_then_user_then_the_conversations_opening(
) -> None:
    def session(kind: str, body: dict[str, Any]) -> Any:
        return translate(kind, body, 1).choices[0].spec["session"]  # type: ignore[arg-type]

    keyed = session("chat", chat(prompt_cache_key="rag-template-7", user="u"))
    assert keyed.startswith("key:") and keyed == session("completion", {
        "model": "m", "prompt": "x", "prompt_cache_key": "rag-template-7"})
    assert session("chat", chat(user="u")).startswith("user:")
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and?"}]
    first = session("chat", {"model": "m", "messages": turn1})
    assert first.startswith("chat:") and first == session("chat", {"model": "m",
                                                                   "messages": turn2})
    assert session("completion", {"model": "m", "prompt": "x"}) is None
    with pytest.raises(APIError):
        session("chat", chat(prompt_cache_key=7))
