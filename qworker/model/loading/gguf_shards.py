"""A GGUF split in shards as llama.cpp's `gguf-split` writes them (`name-00001-of-00003.gguf`):
read as one file. The first shard holds the metadata; every shard holds some of the tensors and
says which shard it is (`split.no`) of how many (`split.count`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qworker.model.loading.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor

SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def shard_paths(path: Path) -> list[Path] | None:
    """Every shard of the split GGUF that `path` is one shard of, in order; None if it is no
    shard's name."""
    match = SHARD_NAME.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    if not 1 <= int(match["no"]) <= count:
        raise GGUFFormatError(f"shard {match['no']} of {match['count']}")
    return [path.with_name(f"{match['stem']}-{no:05d}-of-{count:05d}.gguf")
            for no in range(1, count + 1)]


class GGUFShards:
    """The shards of one split GGUF as a `GGUFFile`: the first one's metadata, all the tensors."""

    def __init__(self, paths: list[Path]) -> None:
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise GGUFFormatError(f"missing shard {missing[0]} ({len(paths)} shards in all)")
        files = [GGUFFile(p) for p in paths]
        for no, file in enumerate(files):
            if (file.get("split.no"), file.get("split.count")) != (no, len(files)):
                raise GGUFFormatError(f"{file.path.name} does not say it is shard {no + 1} "
                                      f"of {len(files)}")
        self.path = paths[0]
        self.metadata: dict[str, Any] = files[0].metadata
        self.tensors: list[GGUFTensor] = [t for file in files for t in file.tensors]
        expected = files[0].get("split.tensors.count", len(self.tensors))
        if len(self.tensors) != expected:
            raise GGUFFormatError(f"{len(self.tensors)} tensors in the shards, {expected} said")
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise GGUFFormatError("a tensor in two shards")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)
