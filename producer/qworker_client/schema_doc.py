"""Generated parts of `docs/protocol.md`: field tables and embedded JSON Schemas.

A block `<!-- generated:KIND:NAME -->` ... `<!-- /generated:KIND:NAME -->` holds, for KIND
`table`, a Markdown table of schema NAME's fields, and for KIND `schema`, the schema itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

Schema = dict[str, Any]

_BLOCK_RE = re.compile(
    r"(<!-- generated:(?P<kind>\w+):(?P<name>\w+) -->\n)"
    r".*?"
    r"(<!-- /generated:(?P=kind):(?P=name) -->)",
    re.DOTALL,
)


def schema_text(schema: Schema) -> str:
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_blocks(text: str, schemas: dict[str, Schema]) -> str:
    """`text` with every generated block rewritten from `schemas`; unknown names raise KeyError."""

    def fill(match: re.Match[str]) -> str:
        schema = schemas[match["name"]]
        body = field_table(schema) if match["kind"] == "table" else _fenced(schema)
        return f"{match.group(1)}{body}{match.group(4)}"

    return _BLOCK_RE.sub(fill, text)


def block_names(text: str) -> list[str]:
    return [f"{m['kind']}:{m['name']}" for m in _BLOCK_RE.finditer(text)]


def _fenced(schema: Schema) -> str:
    return f"```json\n{schema_text(schema)}```\n"


def field_table(schema: Schema) -> str:
    required = set(schema.get("required", ()))
    rows = ["| field | wire value | default | allowed | notes |", "|---|---|---|---|---|"]
    for name, prop in schema["properties"].items():
        if "const" in prop:
            continue  # the event's `type`, shown in the heading
        body = _non_null(prop)
        default = "required" if name in required else _default(prop.get("default"))
        cells = [f"`{name}`", _wire(body, schema), default, _allowed(body, schema),
                 prop.get("description", "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _non_null(prop: Schema) -> Schema:
    options = [p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"]
    return options[0] if len(options) == 1 else prop


def _default(value: Any) -> str:
    if value is None:
        return "none"
    return f"`{json.dumps(value)}`"


def _wire(prop: Schema, root: Schema) -> str:
    kind = prop.get("type", "")
    if kind == "array":
        return f"JSON list of {_plural(prop['items'], root)}"
    return {
        "string": "string", "integer": "decimal integer", "number": "decimal number",
        "boolean": "`true` / `false`",
    }.get(kind, "JSON")


def _plural(items: Schema, root: Schema) -> str:
    if "$ref" in items:
        target = _resolve(items["$ref"], root)
        return "`{" + ", ".join(target["properties"]) + "}` objects"
    return {"integer": "integers", "string": "strings"}.get(items.get("type", ""), "values")


def _resolve(ref: str, root: Schema) -> Schema:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _allowed(prop: Schema, root: Schema) -> str:
    parts = []
    if "enum" in prop:
        parts.append(" | ".join(f"`{v}`" for v in prop["enum"]))
    parts += _bounds(prop, "")
    if "pattern" in prop:
        parts.append(f"`{prop['pattern']}`")
    if prop.get("type") == "array":
        parts += _bounds(prop["items"], "each ")
        if "$ref" in prop["items"]:
            role = _resolve(prop["items"]["$ref"], root)["properties"].get("role", {})
            if "enum" in role:
                parts.append("role: " + " | ".join(f"`{v}`" for v in role["enum"]))
    return "; ".join(parts)


def _bounds(prop: Schema, label: str) -> list[str]:
    low = _bound(prop, "minimum", "≥") or _bound(prop, "exclusiveMinimum", ">")
    high = _bound(prop, "maximum", "≤") or _bound(prop, "exclusiveMaximum", "<")
    parts = [f"{label}{b}" for b in (low, high) if b]
    for key, what in (("minLength", "≥ {} chars"), ("maxLength", "≤ {} chars"),
                      ("minItems", "≥ {} items"), ("maxItems", "≤ {} items")):
        if key in prop:
            parts.append(label + what.format(prop[key]))
    return parts


def _bound(prop: Schema, key: str, sign: str) -> str | None:
    return f"{sign} {prop[key]}" if key in prop else None
