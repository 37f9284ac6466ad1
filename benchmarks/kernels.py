"""Every matmul kernel this CPU runs, on the default model's linear shapes, at the token counts the
warm-up measures: the figures behind the measured kernel choice.

    .venv/bin/python -m benchmarks.kernels [--dtype float32 bfloat16] [--max-rows 512]

Prints one JSON line per (dtype, shape, rows): the milliseconds the warm-up measures for each
kernel, the one the choice takes, and the winner's speed-up over the torch path ("onednn" where
oneDNN packs this dtype here, else F.linear).
"""

from __future__ import annotations

import argparse
import json

from benchmarks.machine import machine_info
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.kernels.kernel_choice import BUCKETS, measure, shape_key
from qworker.model.kernels.linear import Linear
from qworker.model.loading.hub import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-rows", type=int, default=512, help="largest bucket measured")
    args = parser.parse_args()
    info = machine_info()
    for name in args.dtype:
        model = load_model(resolve_model(args.model), dtype=resolve_dtype(name, "cpu"))
        shapes: dict[str, Linear] = {}
        for module in model.modules():
            if isinstance(module, Linear):
                shapes.setdefault(shape_key(module), module)
        for key, layer in shapes.items():
            timings = measure(layer, args.max_rows)
            for b, rows in enumerate(BUCKETS):
                ms = {kind: round(1e3 * t[b], 4) for kind, t in timings.items() if t[b]}
                if not ms:
                    continue
                best = min(ms, key=ms.__getitem__)
                torch_kind = next((k for k in ("onednn", "plain") if k in ms), best)
                print(json.dumps({"dtype": name, "shape": key, "rows": rows, "ms": ms,
                                  "fastest": best,
                                  "speedup_vs_torch": round(ms[torch_kind] / ms[best], 2),
                                  **info}), flush=True)

if __name__ == "__main__":
    main()
