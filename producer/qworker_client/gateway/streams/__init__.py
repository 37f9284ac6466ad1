"""Following jobs' output streams: one reader for the process (`hub`), SSE framing, resumable
job streams, disconnects and vanished state."""
