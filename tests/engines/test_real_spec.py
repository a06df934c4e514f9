"""Speculative decoding on the real engine and model: the output with n-gram drafts verified in
one batch equals plain decoding token for token (greedy, seeded, under a grammar), and the
engine is left holding what plain decoding leaves."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv.engines.models import default_model_path

from ..conftest import real_stack

real_stack("real engine", "llama_cpp", check=default_model_path)

from edgekv.chat import chat_tokens  # noqa: E402
from edgekv.engines.base import DraftVerifier, FragmentSpec  # noqa: E402
from edgekv.engines.constraint import json_schema_grammar  # noqa: E402
from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402
from edgekv.engines.probe import probe_tokens  # noqa: E402
from edgekv.engines.probe_spec import SPEC_SCHEDULE, draft_verify_diff  # noqa: E402
from edgekv.engines.spec import Speculation, StepCosts  # noqa: E402
from edgekv_bench.texts import MANUAL  # noqa: E402

pytestmark = pytest.mark.real
PARAGRAPH = MANUAL.split("\n\n")[1]


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(default_model_path(), n_ctx=2048)
    yield a
    a.close()


class LongDrafts(StepCosts):
    """Costs that make every draft worth sending, so long runs of drafts are verified (and
    rejected mid-batch) whatever this machine's load measures; speed is not tested here."""

    def observe(self, n: int, seconds: float) -> None:
        pass

    def ratio(self, n: int) -> float:
        return 1.0 + 0.05 * (n - 1)


def _run(adapter, prompt, max_tokens, speculation, **kw):
    adapter.clear_kv_cache()
    logits = adapter.prefill(prompt, align=adapter.n_ctx)
    gen = adapter.generate(logits, max_tokens, speculation=speculation, **kw)
    held = adapter.token_ids
    frag = adapter.extract_fragments([FragmentSpec("spec-test", 0, len(held))])[0]
    adapter.clear_kv_cache()
    return gen, held, frag


def _assert_same(adapter, prompt, max_tokens, **kw):
    """Plain decoding vs speculation (measured costs, and long drafts): tokens, kept logits,
    and the engine's tokens and KV after the answer, bit for bit. The speculative runs."""
    plain, held, frag = _run(adapter, prompt, max_tokens, None, **kw)
    runs = []
    for spec in (Speculation(), Speculation(costs=LongDrafts(11))):
        gen, held_s, frag_s = _run(adapter, prompt, max_tokens, spec, **kw)
        assert gen.tokens == plain.tokens, adapter.detokenize(gen.tokens)
        assert gen.finish_reason == plain.finish_reason
        assert held_s == held  # prompt + answer less its last token: rejected drafts gone
        assert np.array_equal(frag_s.keys, frag.keys)
        assert np.array_equal(frag_s.values, frag.values)
        if kw.get("keep_logits"):
            assert all(np.array_equal(x, y)
                       for x, y in zip(plain.logits, gen.logits, strict=True))
        runs.append(gen)
    return plain, runs


def _copy_prompt(adapter):
    return chat_tokens(adapter, [{"role": "user",
                                  "content": "Repeat this text exactly:\n\n" + PARAGRAPH}])


def test_the_probe_schedule_passes_on_the_setup_build(adapter):
    assert isinstance(adapter, DraftVerifier)
    name, diff, same = draft_verify_diff(adapter, probe_tokens(adapter))
    assert name == SPEC_SCHEDULE and diff == 0.0 and same


def test_greedy_copy_equals_plain_decoding_with_drafts_accepted(adapter):
    plain, runs = _assert_same(adapter, _copy_prompt(adapter), 96, keep_logits=True)
    assert all(g.accepted > 0 for g in runs)
    assert runs[1].accepted >= 20 and runs[1].drafted > runs[1].accepted  # some rejected


@pytest.mark.parametrize("temperature,top_p,seed", [(0.7, 1.0, 7), (1.0, 0.9, 3)])
def test_seeded_copy_equals_plain_decoding(adapter, temperature, top_p, seed):
    _, runs = _assert_same(adapter, _copy_prompt(adapter), 80, temperature=temperature,
                           top_p=top_p, seed=seed)
    assert runs[1].drafted > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chat_equals_plain_decoding(adapter, temperature):
    prompt = chat_tokens(adapter, [{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": "Why is the sky blue? Explain "
                                    "it to a child, then to a physicist."}])
    _assert_same(adapter, prompt, 96, temperature=temperature, seed=11)


def test_grammar_constrained_answer_equals_plain_decoding(adapter):
    schema = {"type": "object", "properties": {"device": {"type": "string"},
                                               "action": {"type": "string"},
                                               "level": {"type": "integer"}},
              "required": ["device", "action", "level"]}
    prompt = chat_tokens(adapter, [{"role": "user", "content": (
        'Reply with JSON {"device": ..., "action": ..., "level": ...} for: set the hallway '
        'light to 40. Example: {"device": "hallway light", "action": "set", "level": 40}')}])
    grammar = json_schema_grammar(schema)
    gens = []
    for spec in (None, Speculation(costs=LongDrafts(11))):
        gen, held, frag = _run(adapter, prompt, 48, spec,
                               constraint=adapter.grammar_constraint(grammar))
        gens.append((gen, held, frag))
    (plain, held, frag), (spec_gen, held_s, frag_s) = gens
    assert spec_gen.tokens == plain.tokens and held_s == held
    assert np.array_equal(frag_s.keys, frag.keys)
