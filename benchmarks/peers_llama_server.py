"""llama.cpp's `llama-server` on standard workload v1, the batched peer figure beside
benchmarks.engine_throughput (as ../shared/bench/peers/README.md runs it).

    .venv/bin/python -m benchmarks.peers_llama_server --binary .../llama-build/bin/llama-server \\
        --gguf FILE [--slots 16] [--no-repack]

Starts the server with `--slots` parallel slots (continuous batching, 1,024 KV cells each, 2
threads), posts all 64 requests at once to /completion with their token-id prompts, each
generating exactly its output_len (EOS ignored, greedy, no prompt cache), and times the wall from
the first post to the last reply. Prints one JSON line: useful output tokens/s, wall time.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from benchmarks.llama_server import llama_server
from benchmarks.machine import machine_info
from benchmarks.workload import WorkItem, fingerprint, standard_workload

THREADS = 2
CELLS_PER_SLOT = 1024


def complete(url: str, item: WorkItem) -> int:
    """The request's generated token count (its output_len, EOS ignored)."""
    body = {"prompt": list(item.prompt_ids), "n_predict": item.output_len, "temperature": 0.0,
            "cache_prompt": False, "ignore_eos": True}
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as reply:
        return int(json.loads(reply.read())["timings"]["predicted_n"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", required=True, help="the llama-server executable")
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--no-repack", action="store_true",
                        help="llama.cpp's weight repacking off (it crashes on AMX Xeons)")
    args = parser.parse_args()
    items = standard_workload(seed=0)
    extra = ["-cb", *(["--no-repack"] if args.no_repack else [])]
    with llama_server(args.binary, args.gguf, THREADS, extra, slots=args.slots,
                      context=args.slots * CELLS_PER_SLOT) as url:
        complete(url, items[0])  # warm
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(items)) as pool:
            generated = list(pool.map(lambda item: complete(url, item), items))
        wall = time.perf_counter() - start
    useful = sum(item.output_len for item in items)
    assert generated == [item.output_len for item in items], "a request stopped short"
    print(json.dumps({
        "engine": "llama-server", "slots": args.slots, "workload": "v1",
        "fingerprint": fingerprint(items), "threads": THREADS, **machine_info(),
        "gguf": args.gguf, "useful_out_tok_s": round(useful / wall, 1),
        "wall_s": round(wall, 2)}))


if __name__ == "__main__":
    main()
