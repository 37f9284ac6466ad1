"""llama.cpp's `llama-server` as a single-stream peer (`benchmarks.single_stream --llama-server`):
started on a free port with one slot, asked for each prompt's greedy completion of the same token
ids, timed by the server's own figures (`timings`). Build it as ../shared/bench/peers/README.md
says (`ninja -C llama-build llama-server`); `--spec-type ngram-simple` (or another n-gram type)
turns on its speculative decoding from the context's own n-grams.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from qworker_client.local_redis import free_port, stop_child

START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LlamaRun:
    """One pass over the prompts: milliseconds per generated token after the first (the
    server's generation time over its decode forwards), and its drafts."""

    ms_per_token: float
    drafted: int
    accepted: int


@contextmanager
def llama_server(binary: str, gguf: str, threads: int, extra: Sequence[str] = (),
                 slots: int = 1, context: int = 4096) -> Iterator[str]:
    """The server's base URL while it runs (`slots` slots sharing `context` KV cells, no web
    UI)."""
    port = free_port()
    command = [binary, "-m", gguf, "-t", str(threads), "--host", "127.0.0.1", "--port",
               str(port), "-np", str(slots), "-c", str(context), "--no-webui", *extra]
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        stop_child(proc, 10)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become healthy")


def timed_pass(url: str, prompts: Sequence[Sequence[int]], new_tokens: int,
               fixed_length: bool) -> LlamaRun:
    """Each prompt's greedy completion in turn (no prompt cache), up to `new_tokens`."""
    gen_ms, forwards, drafted, accepted = 0.0, 0, 0, 0
    for prompt in prompts:
        body = {"prompt": list(prompt), "n_predict": new_tokens, "temperature": 0.0,
                "cache_prompt": False, "ignore_eos": fixed_length}
        request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            timings = json.loads(reply.read())["timings"]
        gen_ms += float(timings["predicted_ms"])
        forwards += max(int(timings["predicted_n"]) - 1, 1)  # the first came with the prompt
        drafted += int(timings.get("draft_n", 0))
        accepted += int(timings.get("draft_n_accepted", 0))
    return LlamaRun(gen_ms / forwards, drafted, accepted)
