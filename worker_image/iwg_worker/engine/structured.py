"""Structured outputs: a request's JSON schema compiled by xgrammar, before the request reaches a batch.

Both engines constrain decoding with xgrammar: vLLM's engine with its own structured-output support (its
xgrammar backend, `vllm_engine._sampling`), transformers' engine through `RequestSampler`, which masks each
constrained row's logits with the request's `GrammarMatcher`. Either way the schema is compiled here first,
against this model's tokenizer, with the same settings vLLM's backend is given (compact JSON: no free
whitespace; xgrammar's strict mode: no properties the schema does not list): a schema xgrammar cannot turn into
a grammar, or cannot compile within `COMPILE_TIMEOUT_S`, is refused with a `RequestRejected` naming the request
field it came from, for that request alone. No grammar code of our own: xgrammar converts and compiles.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Final, Literal

from iwg_worker.engine.requests import RequestRejected

COMPILE_TIMEOUT_S = 10.0
BACKEND: Final[Literal["xgrammar"]] = "xgrammar"
# Compiles run on these threads; a compile that outlasts its timeout keeps its thread until xgrammar returns,
# and a request that finds every thread busy is refused rather than queued behind it.
COMPILE_THREADS = 2
SEPARATORS = (",", ":")


class SchemaCompiler:
    """xgrammar's compiler for one tokenizer (built on first use: it indexes the vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._busy = threading.Semaphore(COMPILE_THREADS)

    def _get(self) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def compile(self, schema: str, param: str, timeout_s: float = COMPILE_TIMEOUT_S) -> Any:
        """The compiled grammar of a JSON schema (xgrammar's `CompiledGrammar`), or `RequestRejected` naming
        ``param``: a schema xgrammar refuses, or one it did not compile within ``timeout_s``."""
        if not self._busy.acquire(blocking=False):
            raise RequestRejected(
                param, "the server is compiling other schemas at the moment; retry shortly", "busy"
            )
        try:
            future = self._pool.submit(self._compile, schema)
        except BaseException:
            self._busy.release()
            raise
        future.add_done_callback(lambda _: self._busy.release())
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise RequestRejected(
                param, f"the schema did not compile within {timeout_s:g} s; simplify it", "schema_too_complex"
            ) from None
        except (ValueError, RuntimeError, TypeError) as exc:
            raise RequestRejected(param, f"the schema cannot be compiled: {exc}", "invalid_schema") from None

    def _compile(self, schema: str) -> Any:
        return self._get().compile_json_schema(
            schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def matcher(compiled: Any, stop_token_ids: frozenset[int]) -> Any:
    """A fresh matcher of a compiled grammar: one per request, it follows that request's tokens."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None)
