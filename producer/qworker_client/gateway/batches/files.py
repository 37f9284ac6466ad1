"""OpenAI's Files API for batches, on a directory given by flag (`--files-dir`): each file's
content in `<id>.data`, its OpenAI file object in `<id>.json` (with its owner, `owners`, which
is never shown). Bounded in size; one gateway per directory."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qworker_client.gateway.errors import APIError, bad_request
from qworker_client.gateway.owners import Owner, may_see

DEFAULT_MAX_BYTES = 200 * 1024 * 1024
# what this store names files: `file-<hex>` uploads, `file-<batch id>_output` and `_errors`;
# anything else (a path, a batch record's name, 300 characters) is no file of ours
FILE_ID_RE = re.compile(r"file-[A-Za-z0-9_]{1,100}")
OWNER = "owner"  # the stored object's private field


@dataclass(frozen=True)
class FileStore:
    root: Path
    max_bytes: int = DEFAULT_MAX_BYTES

    def create(self, content: bytes, filename: str, purpose: str, owner: Owner
               ) -> dict[str, Any]:
        if len(content) > self.max_bytes:
            raise bad_request(f"the file is larger than {self.max_bytes} bytes", param="file")
        return self.write(f"file-{uuid.uuid4().hex}", content, filename, purpose, owner)

    def write(self, file_id: str, content: bytes, filename: str, purpose: str, owner: Owner
              ) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_path(file_id).write_bytes(content)
        info = {"id": file_id, "object": "file", "bytes": len(content),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed"}
        self._info_path(file_id).write_text(json.dumps({**info, OWNER: owner}))
        return info

    def get(self, file_id: str, viewer: Owner) -> dict[str, Any]:
        """The file's OpenAI object; 404 when there is none of that id that `viewer` may see."""
        path = self._info_path(file_id)
        info = json.loads(path.read_text()) if _is_file_id(file_id) and path.is_file() else None
        if info is None or not may_see(info.pop(OWNER, None), viewer):
            raise APIError(404, f"no file {file_id[:100]}", param="file_id",
                           code="file_not_found")
        return info

    def content(self, file_id: str, viewer: Owner) -> bytes:
        self.get(file_id, viewer)
        return self.data_path(file_id).read_bytes()

    def data_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.data"

    def _info_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"


def _is_file_id(file_id: str) -> bool:
    return FILE_ID_RE.fullmatch(file_id) is not None
