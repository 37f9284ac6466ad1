"""The two grammar libraries side by side on the default model's vocabulary (why llguidance).

    .venv/bin/python -m benchmarks.structured_libs
    PYTHONPATH=/path/to/xgrammar .venv/bin/python -m benchmarks.structured_libs  # both

For each library that imports: the time to build its tokenizer info, to compile a nested JSON
Schema, and to compute the token mask before each token of a valid answer (median and max).
xgrammar is not a dependency of the project; install it aside (`pip install --no-deps --target
DIR xgrammar apache-tvm-ffi`) to compare.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from benchmarks.machine import machine_info
from benchmarks.structured import SCHEMA
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

ANSWER = {"name": "Ada Byron", "age": 36, "role": "engineer",
          "contact": {"email": "ada@example.org", "city": "London"},
          "skills": ["math", "engines"], "active": True}


def llguidance_figures(tok: Tokenizer, vocab: int, answer: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.torch as lt

    started = time.perf_counter()
    info = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab,
                                  eos_token=list(tok.eos_token_ids))
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(info, grammar)
    compile_s = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    mask = lt.allocate_token_bitmask(1, vocab)
    times = []
    for token in answer:
        started = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    return _figures("llguidance", llguidance, tokenizer_s, compile_s, times)


def xgrammar_figures(tok: Tokenizer, vocab: int, answer: list[int]) -> dict[str, Any]:
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                              stop_token_ids=list(tok.eos_token_ids))
    tokenizer_s = time.perf_counter() - started
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                            separators=(",", ":"))
    compile_s = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in answer:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - started)
        assert matcher.accept_token(token)
    return _figures("xgrammar", xgr, tokenizer_s, compile_s, times)


def _figures(name: str, module: Any, tokenizer_s: float, compile_s: float,
             times: list[float]) -> dict[str, Any]:
    return {"library": name, "version": getattr(module, "__version__", "?"),
            "tokenizer_info_s": round(tokenizer_s, 3), "compile_ms": round(compile_s * 1e3, 2),
            "mask_us_median": round(statistics.median(times) * 1e6, 1),
            "mask_us_max": round(max(times) * 1e6, 1), "tokens": len(times)}


def main() -> None:
    tok = Tokenizer.load(resolve_model("smollm2"))
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)
    text = json.dumps(ANSWER, separators=(",", ":"))
    answer = tok.backend.encode(text, add_special_tokens=False).ids
    for figures in (llguidance_figures, xgrammar_figures):
        try:
            result = figures(tok, vocab, answer)
        except ImportError as exc:
            result = {"library": figures.__name__.removesuffix("_figures"),
                      "skipped": f"not importable: {exc}"}
        print(json.dumps({"benchmark": "structured_libs", "vocab": vocab, **result,
                          **machine_info()}), flush=True)


if __name__ == "__main__":
    main()
