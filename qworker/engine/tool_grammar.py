"""The grammar of a tool call, for the structured-output engine (structured.py): a well-formed
call, in the model's format, of an allowed function whose arguments validate against its schema.

`whole_grammar` constrains a whole output to calls (tool_choice `required` or a named function);
`call_grammar` constrains one call from its opening marker on (tool_choice `auto`: armed when the
model opens a call, released when the call is closed). Keys come in schema order, so `name` is
written before the arguments and the parser streams them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qworker.engine.tool_calls import ToolFormat

# a marker's Lark term: its token (`<[id]>`) where it is one special token, else its text
MarkerTerm = Callable[[str], str]


def call_schema(functions: Sequence[Mapping[str, Any]], args_key: str) -> dict[str, Any]:
    """One call object of any of `functions` (OpenAI `function` objects)."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       args_key: f.get("parameters") or {"type": "object"}},
        "required": ["name", args_key],
        "additionalProperties": False,
    } for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def whole_grammar(fmt: ToolFormat, functions: Sequence[Mapping[str, Any]], parallel: bool,
                  term: MarkerTerm) -> str:
    """An output that is one call, or several with `parallel`, and nothing else."""
    obj = _json_rule(functions, fmt)
    if fmt.close is not None:
        call = f'{term(fmt.open)} "\\n" obj "\\n" {term(fmt.close)}'
        calls = 'call ("\\n" call)*' if parallel else "call"
        return f"start: {calls}\ncall: {call}\n{obj}"
    more = ' ("," obj)*' if parallel else ""
    if fmt.json_at_start:  # Llama 3.x: the output is the calls, `;` between them
        separated = ' ("; " obj)*' if parallel else ""
        return f"start: obj{separated}\n{obj}"
    return f'start: {term(fmt.open)} "[" obj{more} "]"\n{obj}'


def call_grammar(fmt: ToolFormat, functions: Sequence[Mapping[str, Any]], opener: str,
                 term: MarkerTerm) -> str:
    """From the text that opened a call (`opener`: the marker, or Llama's first `{`) to the end
    of that call (its close marker, or for formats without one, the end of the calls)."""
    obj = _json_rule(functions, fmt)
    start = term(fmt.open) if opener == fmt.open else ""
    if fmt.close is not None:
        return f'start: {start} "\\n"? obj "\\n"? {term(fmt.close)}\n{obj}'
    if fmt.json_at_start and not start:
        return f'start: obj ("; " obj)*\n{obj}'
    return f'start: {start} "[" obj ("," obj)* "]"\n{obj}'


def _json_rule(functions: Sequence[Mapping[str, Any]], fmt: ToolFormat) -> str:
    schema = call_schema(functions, fmt.args_key)
    schema["x-guidance"] = {"whitespace_flexible": False}
    return f"obj: %json {json.dumps(schema, ensure_ascii=False)}"
