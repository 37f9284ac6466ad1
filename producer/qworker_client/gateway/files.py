"""OpenAI's Files API for batches, on a directory given by flag (`--files-dir`): each file's
content in `<id>.data`, its OpenAI file object in `<id>.json`. Bounded in size; one gateway per
directory."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qworker_client.gateway.errors import APIError, bad_request

DEFAULT_MAX_BYTES = 200 * 1024 * 1024


@dataclass(frozen=True)
class FileStore:
    root: Path
    max_bytes: int = DEFAULT_MAX_BYTES

    def create(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        if len(content) > self.max_bytes:
            raise bad_request(f"the file is larger than {self.max_bytes} bytes", param="file")
        return self.write(f"file-{uuid.uuid4().hex}", content, filename, purpose)

    def write(self, file_id: str, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_path(file_id).write_bytes(content)
        info = {"id": file_id, "object": "file", "bytes": len(content),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed"}
        self._info_path(file_id).write_text(json.dumps(info))
        return info

    def get(self, file_id: str) -> dict[str, Any]:
        path = self._info_path(file_id)
        if "/" in file_id or not path.is_file():
            raise APIError(404, f"no file {file_id}", param="file_id", code="file_not_found")
        return json.loads(path.read_text())

    def content(self, file_id: str) -> bytes:
        self.get(file_id)
        return self.data_path(file_id).read_bytes()

    def data_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.data"

    def _info_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"
