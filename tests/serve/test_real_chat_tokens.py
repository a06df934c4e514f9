"""Chat prompts on the real tokenizers (SmolLM2, Gemma 3 via llama.cpp): a message that spells
every control token of the vocabulary stays text, and ordinary conversations get exactly the
token ids of the whole rendered string (so cached chains keep their keys).

The control tokens are read from the vocabulary itself (llama.cpp's token attributes), not
listed here, so a model with more of them is tested on all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from edgekv.chat import ChatTokenizer
from edgekv.engines.models import default_model_path, gemma3_model_path
from edgekv_bench.texts import MANUAL, QUESTIONS, SYSTEM_PROMPT

from ..conftest import real_stack, skip_or_fail

real_stack("llama.cpp and SmolLM2", "llama_cpp", "jinja2", check=default_model_path)

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

pytestmark = pytest.mark.real
MODELS: dict[str, tuple[Callable[[], Path], tuple[str, ...]]] = {
    "smollm2": (default_model_path, ("<|im_start|>", "<|im_end|>")),
    "gemma3": (gemma3_model_path, ("<start_of_turn>", "<end_of_turn>")),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    find, markers = MODELS[request.param]
    try:
        path = find()
    except Exception as e:  # noqa: BLE001 - a missing model package
        skip_or_fail(f"{request.param} unavailable: {e}")
    a = LlamaCppAdapter(path, n_ctx=256, n_threads=1, memo_dir=tmp_path_factory.mktemp("fp"))
    yield a, ChatTokenizer(a), markers
    a.close()


def conversations() -> list[list[dict[str, str]]]:
    system = SYSTEM_PROMPT + "\n\n" + MANUAL
    odd = ["  two leading spaces", "trailing spaces   ", "\n\nleading newlines",
           "ends in newlines\n\n", "\ttab first", "ünïcödé, emoji ✓🙂 and 12345 digits",
           "code:\n```python\nprint('hi')\n```", "<b>html</b> & <not a token>", "?", ""]
    out = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
           for q in QUESTIONS]
    out += [[{"role": "user", "content": q}] for q in odd]
    out += [[{"role": "system", "content": s}, {"role": "user", "content": q}]
            for s in ("Be brief.", " Be brief. ", "Be brief.\n") for q in odd[:5]]
    out.append([{"role": "system", "content": system},
                {"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": " It means the hub is pairing.\n"},
                {"role": "user", "content": QUESTIONS[1]}])
    return out


def test_control_tokens_are_read_from_the_vocabulary(model):
    a, chat, markers = model
    controls = a.control_tokens()
    for m in markers:  # the template's markers are among them, one token each
        assert m in controls and a.tokenize(m, add_bos=False) == [controls[m]]
    ids = set(controls.values())
    for text in controls:  # with special=False, no control token's text is that token
        assert not ids & set(a.tokenize(text, add_bos=False, special=False)), text


def test_ordinary_conversations_get_the_whole_strings_tokens(model):
    a, chat, _ = model
    for msgs in conversations():
        assert chat.tokens(msgs) == a.tokenize(chat.render(msgs)), msgs[-1]["content"][:40]


def test_a_message_with_every_control_token_stays_text(model):
    a, chat, _ = model
    ids = set(a.control_tokens().values())
    every = "".join(a.control_tokens())  # adjacent, and apart
    spoof = f"Hi.{every} and {' '.join(a.control_tokens())} bye"

    def control_ids(msgs: list[dict[str, str]]) -> list[int]:
        return [t for t in chat.tokens(msgs) if t in ids]

    for roles in (("user",), ("system", "user"), ("user", "assistant", "user")):
        msgs = [{"role": r, "content": spoof} for r in roles]
        benign = [{"role": r, "content": "Hi."} for r in roles]
        # only the template's own markers, in the same places as for a harmless message
        got = control_ids(msgs)
        assert got == control_ids(benign)
        if roles == ("user",):  # what a whole-string tokenizer makes of it (seconds on
            # Gemma's 6,250 control tokens): the message's text as control tokens
            whole = [t for t in a.tokenize(chat.render(msgs)) if t in ids]
            assert len(whole) > len(got) + len(a.control_tokens())
