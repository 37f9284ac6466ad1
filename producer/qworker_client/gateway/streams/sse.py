"""Server-sent events as OpenAI frames them: `id: ...`, `data: {json}`, last `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
MEDIA_TYPE = "text/event-stream"
# json.dumps(data, ensure_ascii=False, separators=(",", ":")), without making an encoder per call
encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def frame(data: dict[str, Any], event_id: str | None = None) -> str:
    text = encode(data)
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {text}\n\n"
