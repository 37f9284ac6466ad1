"""The protocol's JSON Schemas as checked-in files, generated from the pydantic models
(`qworker_client.protocol.json_schemas`): one `docs/schema/<name>.json` per schema, and the
generated blocks (field tables, embedded schemas) of `docs/protocol.md`.

`python -m qworker_client.schema` rewrites them; `python -m qworker_client.schema --check` exits 1
when any of them differs from the models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qworker_client.protocol import json_schemas
from qworker_client.schema_doc import block_names, render_blocks, schema_text

DOCS = Path(__file__).resolve().parents[2] / "docs"  # the checkout's docs/ (producer/../docs)
DEFAULT_DIR = DOCS / "schema"
DEFAULT_DOC = DOCS / "protocol.md"


def rendered() -> dict[str, str]:
    """File name -> file text, for every schema."""
    return {f"{name}.json": schema_text(schema) for name, schema in json_schemas().items()}


def rendered_doc(doc: Path) -> str:
    return render_blocks(doc.read_text(encoding="utf-8"), json_schemas())


def write(directory: Path = DEFAULT_DIR, doc: Path = DEFAULT_DOC) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    if doc.exists():
        doc.write_text(rendered_doc(doc), encoding="utf-8")
        paths.append(doc)
    return paths


def drifted(directory: Path = DEFAULT_DIR, doc: Path = DEFAULT_DOC) -> list[Path]:
    """Files that are missing, differ from the models, or are left over from a removed schema."""
    expected = rendered()
    stale = [
        directory / name for name, text in expected.items()
        if not (directory / name).is_file()
        or (directory / name).read_text(encoding="utf-8") != text
    ]
    stale += sorted(p for p in directory.glob("*.json") if p.name not in expected)
    if not _doc_current(doc):
        stale.append(doc)
    return stale


def _doc_current(doc: Path) -> bool:
    if not doc.is_file():
        return False
    text = doc.read_text(encoding="utf-8")
    return bool(block_names(text)) and rendered_doc(doc) == text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qworker_client.schema", description=__doc__)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="schema files' folder")
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="protocol document")
    parser.add_argument("--check", action="store_true", help="exit 1 when a file drifted")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted(args.dir, args.doc)
        for path in stale:
            print(f"{path}: out of date (run python -m qworker_client.schema)")
        return 1 if stale else 0
    for path in write(args.dir, args.doc):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
