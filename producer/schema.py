"""The protocol's JSON Schemas as checked-in files: `python -m producer.schema [DIR]` writes them
(default `docs/schema/`), `python -m producer.schema --check [DIR]` exits 1 when they drifted.

The schemas come from the pydantic models (`qworker.protocol.json_schemas`), one file per name.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qworker.protocol import json_schemas

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "docs" / "schema"


def rendered() -> dict[str, str]:
    """File name -> file text, for every schema."""
    return {
        f"{name}.json": json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        for name, schema in json_schemas().items()
    }


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def drifted(directory: Path) -> list[str]:
    """Names of schema files that are missing, differ from the models, or are left over."""
    expected = rendered()
    stale = [
        name for name, text in expected.items()
        if not (directory / name).is_file()
        or (directory / name).read_text(encoding="utf-8") != text
    ]
    extra = sorted(p.name for p in directory.glob("*.json") if p.name not in expected)
    return stale + extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producer.schema", description=__doc__)
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--check", action="store_true", help="exit 1 when the files drifted")
    args = parser.parse_args(argv)
    if args.check:
        names = drifted(args.directory)
        for name in names:
            print(f"{args.directory / name}: out of date (run python -m producer.schema)")
        return 1 if names else 0
    for path in write(args.directory):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
