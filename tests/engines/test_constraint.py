"""Sampling constraints in the one sampling loop (fake engine: milliseconds), and llama.cpp's
grammar sampler on SmolLM2 (real): what a constraint masks is never drawn, what is drawn is
accepted, the logits kept are the raw ones, and the KV is the KV of the tokens drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgekv.engines.constraint import Chain, Grammar, grammar_constraint, json_schema_grammar
from edgekv.engines.fake import FakeAdapter
from edgekv.errors import ConfigError, EngineError

from ..conftest import real_stack


class Forbid:
    """Forbids the token the unconstrained loop would draw first, and logs what it sees."""

    def __init__(self, banned: set[int]) -> None:
        self.banned, self.seen, self.accepted = banned, [], []

    def mask(self, logits):
        self.seen.append(logits.copy())
        out = logits.copy()
        out[list(self.banned)] = -np.inf
        return out

    def accept(self, token):
        self.accepted.append(token)


def _run(constraint=None, keep=False):
    a = FakeAdapter(n_ctx=256)
    logits = a.prefill(a.tokenize("hello there"), align=64)
    kw = {} if constraint is None else {"constraint": constraint}
    return a, a.generate(logits, 12, temperature=0.0, keep_logits=keep, **kw)


def test_a_masked_token_is_never_drawn_and_the_kept_logits_are_raw():
    _, free = _run()
    banned = {free.tokens[0]}
    c = Forbid(banned)
    a, gen = _run(c, keep=True)
    assert banned.isdisjoint(gen.tokens) and gen.tokens[0] != free.tokens[0]
    non_eos = [t for t in gen.tokens if t != a.eos_token]
    assert c.accepted == non_eos  # every token drawn, end-of-sequence excepted
    assert all(np.array_equal(k, s) for k, s in zip(gen.logits, c.seen))  # raw, unmasked
    # the engine holds the prompt and the tokens drawn (less the last): KV follows the draw
    assert a.token_ids[-len(gen.tokens) + 1:] == list(gen.tokens[:-1])


def test_chain_masks_in_order_and_every_part_accepts():
    first, second = Forbid(set()), Forbid({3})
    chain = Chain(first, second)
    _, gen = _run(chain)
    assert first.accepted == second.accepted and 3 not in gen.tokens


def test_an_engine_without_grammars_refuses_and_bad_schemas_say_why():
    with pytest.raises(EngineError, match="cannot sample under a grammar"):
        grammar_constraint(FakeAdapter(), Grammar("root ::= \"a\""))
    for bad in ({"type": "nonsense"}, {"$ref": "#/nowhere"}, [1]):
        with pytest.raises(ConfigError, match="JSON schema"):
            json_schema_grammar(bad)  # type: ignore[arg-type]


def test_llama_grammar_on_smollm2_gives_schema_json_and_refuses_bad_gbnf(tmp_path):
    from edgekv.engines.models import default_model_path

    real_stack("llama.cpp and SmolLM2", "llama_cpp", check=default_model_path)
    from edgekv.engines.llamacpp import LlamaCppAdapter

    a = LlamaCppAdapter(default_model_path(), n_ctx=256, n_threads=2, memo_dir=tmp_path)
    try:
        with pytest.raises(ConfigError, match="refused the grammar"):
            a.grammar_constraint(Grammar("root ::= undefined-rule"))
        schema = {"type": "object", "properties": {"n": {"type": "integer"}},
                  "required": ["n"], "additionalProperties": False}
        prompt = a.tokenize("<|im_start|>user\nA number as JSON.<|im_end|>\n"
                            "<|im_start|>assistant\n")
        logits = a.prefill(prompt, align=256)
        gen = a.generate(logits, 24, constraint=a.grammar_constraint(json_schema_grammar(schema)))
        assert gen.stopped_by_eos
        obj = json.loads(a.detokenize(gen.tokens[:-1]))
        assert set(obj) == {"n"} and isinstance(obj["n"], int)
    finally:
        a.close()
