"""Grammar compilation for structured output (xgrammar), cached, for `AsyncEngine.prepare`'s worker thread.

Chosen by measurement (`benchmark/bench_structured_output.py`, docs/benchmarks.md): xgrammar's per-token mask is
about 25x cheaper than llguidance's on a 50k-token vocabulary, and its compile cost (about 0.1 s cold for a JSON
schema) is paid once per distinct grammar: compiled grammars are kept by (kind, spec). The first compile happens in
`AsyncEngine.prepare`, which the server runs in a worker thread; the engine thread only ever sees cache hits.
xgrammar is imported on the first constrained request, so requests without a grammar pay nothing.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

from ..messages import StructuredOutput

_CACHE_SIZE = 256


def bounded_strings_as_patterns(schema):
    """Work around xgrammar 0.2.9: a string with `minLength` / `maxLength` lets raw control characters through,
    which is not JSON. Such a string (without its own pattern, format, enum or const) becomes the equivalent
    `pattern` of plain characters, which xgrammar enforces; escapes are then not generated inside it."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = 'minLength' in out or 'maxLength' in out
    if out.get('type') == 'string' and bounded and not {'pattern', 'format', 'enum', 'const'} & set(out):
        low, high = int(out.pop('minLength', 0)), out.pop('maxLength', None)
        out['pattern'] = r'^[^"\\\x00-\x1f]{' + f"{low},{'' if high is None else int(high)}" + '}$'
    return out


class GrammarCompiler:
    """Compiles `StructuredOutput`s against one tokenizer and model vocabulary; thread-safe."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str | None], object] = OrderedDict()

    def _xgrammar_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (an `xgrammar.CompiledGrammar`); `ValueError` for a spec that does not compile."""
        key = (spec.kind, spec.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiled = self._compile(spec)
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: StructuredOutput):
        compiler = self._xgrammar_compiler()
        try:
            if spec.kind == 'json_object':
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == 'json_schema':
                schema = bounded_strings_as_patterns(json.loads(spec.spec))
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if spec.kind == 'regex':
                return compiler.compile_regex(spec.spec)
            return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f'the {spec.kind.replace("_", " ")} for structured output does not compile: '
                             f'{str(exc).strip().splitlines()[0] if str(exc).strip() else exc}') from exc
