"""The context rule is written once (`limits.fit`): the library's `prepare`, passage placement
and the server's checks read the same, and errors reach HTTP by their type and code, never by
what their message happens to say."""

from __future__ import annotations

import pytest

from edgekv.errors import ConfigError, EngineError, PromptError
from edgekv.limits import fit


def test_the_rule():
    assert fit(100, 10, 20) == 20
    assert fit(100, 10, None) == 90  # None: up to the end of the window
    assert fit(100, 10, None, held=30) == 60
    assert fit(100, None, 99) == 99 and fit(100, None, None) is None
    cases = [((100, 10, -1), "invalid_value", "max_tokens"),
             ((100, None, 100), "invalid_value", "max_tokens"),
             ((100, 0, 5), "invalid_value", "prompt"),
             ((100, 95, 10), "context_length_exceeded", "prompt"),
             ((100, 100, None), "context_length_exceeded", "prompt")]
    for args, code, param in cases:
        with pytest.raises(PromptError) as e:
            fit(*args)
        assert (e.value.code, e.value.param) == (code, param), args
    with pytest.raises(PromptError) as e:
        fit(1024, 12, 300, held=800, param="messages")
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "documents")
    assert "documents (800 tokens)" in str(e.value) and "1024" in str(e.value)


def test_library_and_server_refuse_with_one_message(tmp_path):
    from edgekv import CacheConfig, EdgeKV
    from edgekv.engines.fake import FakeAdapter
    from edgekv.store import open_store

    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path)
    kv = EdgeKV(FakeAdapter(n_ctx=64), open_store(cfg), cfg)
    with pytest.raises(PromptError) as lib:
        kv.prepare(list(range(1, 61)), max_tokens=8)
    with pytest.raises(PromptError) as rule:
        fit(64, 60, 8)
    assert str(lib.value) == str(rule.value) and lib.value.code == "context_length_exceeded"


def test_errors_map_by_type_not_by_message():
    from edgekv.serve.errors import from_library_error

    a = from_library_error(PromptError("anything at all", "context_length_exceeded", "prompt"))
    assert (a.status, a.code, a.param) == (400, "context_length_exceeded", "prompt")
    assert from_library_error(ConfigError("x")).status == 400
    # a server fault stays one, whatever words it uses
    for e in (EngineError("12 tokens exceed the context window"), EngineError("empty")):
        assert from_library_error(e).status == 500
