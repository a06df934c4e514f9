"""The adapter's capabilities are explicit protocols (engines/base.py), checked by isinstance,
and the engines and passage reuse reach no other module's privates and probe no capability
with getattr (issue 21)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edgekv import CacheConfig, open_store
from edgekv.core.passages import PassageReuse
from edgekv.engines.base import KVAdapter, ModelFile, ShiftableKV, WindowedKV
from edgekv.engines.fake import FakeAdapter
from edgekv.errors import UnsupportedLayout

from ..passages.test_passages import ShiftingFake

SRC = Path(__file__).parents[2] / "src/edgekv"


def test_fake_adapter_has_the_protocol_and_no_optional_capability() -> None:
    a = FakeAdapter(vocab=300)
    assert isinstance(a, KVAdapter)
    assert a.n_vocab == 300
    ids = a.tokenize("héllo", add_bos=False)
    assert a.token_bytes(ids[0]) == a.detokenize([ids[0]]).encode("utf-8")
    assert not isinstance(a, ShiftableKV | WindowedKV | ModelFile)


def test_passage_reuse_takes_a_shiftable_adapter_and_refuses_others(tmp_path: Path) -> None:
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, passage_reuse=True)
    store = open_store(cfg)
    try:
        assert isinstance(ShiftingFake(), ShiftableKV)  # structural: it has passage_engine
        assert PassageReuse(ShiftingFake(), store, cfg).engine.restores == 0
        with pytest.raises(UnsupportedLayout, match="cannot move cached KV"):
            PassageReuse(FakeAdapter(), store, cfg)
    finally:
        store.close()


def _files() -> list[Path]:
    return sorted((SRC / "engines").glob("*.py")) + [SRC / "core" / "passages.py"]


def test_no_private_of_another_object_is_reached() -> None:
    """`x._name` only on self/cls (and numpy/ctypes' own), `getattr(x, "_name")` only on self."""
    found = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                base = node.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "getattr" and len(node.args) >= 2:
                obj, name = node.args[0], node.args[1]
                text = str(name.value) if isinstance(name, ast.Constant) else ""
                on_self = isinstance(obj, ast.Name) and obj.id == "self"
                if text.startswith("_") and not text.startswith("__") and not on_self:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_no_capability_is_probed_with_getattr() -> None:
    """No getattr on an adapter or a passage engine: capabilities are protocols."""
    found = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr") and node.args:
                obj = ast.unparse(node.args[0])
                if obj.split(".")[-1] in ("adapter", "a", "engine"):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []
