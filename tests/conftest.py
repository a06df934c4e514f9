from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, KVFragment, open_store
from edgekv.engines.fake import FakeAdapter

# `edgekv generate` / `serve` processes the tests start probe whole before their first answer
# (the staged first start, which leaves a probe running in the background, has tests of its
# own that ask for it: EDGEKV_FIRST_PROBE=short)
os.environ.setdefault("EDGEKV_FIRST_PROBE", "full")

_PROBE_RECORDS: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _probe_records(tmp_path_factory: pytest.TempPathFactory):
    _PROBE_RECORDS.append(tmp_path_factory.mktemp("probe-records"))
    yield
    _PROBE_RECORDS.clear()


def share_probes(cache_dir: Path) -> Path:
    """`cache_dir`, its `probes` a link to one directory for the whole session: an engine
    process a test starts (a kv-server, `edgekv generate`) whose subject is not the probe finds
    the record an earlier one made under the same key (model, build, CPU, settings) and does
    not probe again (30-70 s of each such start on 2 cores); so does one whose key this test
    process probed already (its answers are recorded there too). The probe's own tests leave
    their cache directories alone."""
    from edgekv.engines import probe

    shared = _PROBE_RECORDS[0]
    for result in list(probe._memo.values()):
        if not probe.probe_path(shared, result.key).exists():
            probe.record(shared, result)
    cache_dir.mkdir(parents=True, exist_ok=True)
    link = cache_dir / "probes"
    if not link.exists():
        link.symlink_to(shared, target_is_directory=True)
    return cache_dir


def make_fragment(span: int = 64, n_layer: int = 4, width: int = 8, start: int = 0,
                  fingerprint: str = "fp", chain_key: str = "ck", seed: int = 0,
                  **kw: object) -> KVFragment:
    rng = np.random.default_rng(seed)
    layers = kw.pop("layers", n_layer)
    return KVFragment(
        model_fingerprint=fingerprint, chain_key=chain_key, token_start=start,
        token_end=start + span, layer_start=0, layer_end=layers, layer_stride=1,
        n_layer_model=n_layer, token_ids=rng.integers(0, 1000, span, dtype=np.int32),
        keys=rng.standard_normal((layers, span, width)).astype(np.float16),
        values=rng.standard_normal((layers, span, width)).astype(np.float16), **kw)  # type: ignore[arg-type]


@pytest.fixture
def fragment_factory():
    return make_fragment


@pytest.fixture
def fake_cache(tmp_path: Path) -> EdgeKV:
    """Whole-chunk reuse (what an engine that fails the batch-invariance probe gets); the
    token-granular path has its own tests in test_granularity.py."""
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk")
    kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    yield kv
    kv.store.close()


def require_real() -> bool:
    """Under `make test` (EDGEKV_REQUIRE_REAL=1) a missing engine fails instead of skipping."""
    return os.environ.get("EDGEKV_REQUIRE_REAL") == "1"


def skip_or_fail(why: str) -> None:
    """Skip a test whose real piece is missing; under `make test` (EDGEKV_REQUIRE_REAL=1) fail
    instead, so a claim the README makes is never passed by skipping its proof."""
    if require_real():
        pytest.fail(f"{why} (EDGEKV_REQUIRE_REAL=1: required under make test)")
    pytest.skip(why)


def real_stack(what: str, *modules: str, check: Callable[[], object] | None = None) -> None:
    """Import `modules` and run `check` (e.g. find the model): if anything is missing the
    calling test module is skipped, except under `make test`, where it fails."""
    try:
        for name in modules:
            importlib.import_module(name)
        if check is not None:
            check()
    except Exception as e:  # noqa: BLE001 - any import or model problem
        if require_real():
            raise
        pytest.skip(f"{what} unavailable: {e}", allow_module_level=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What ran for real: the model files found, and the batch-invariance verdict of every
    engine probed in this run (the evidence behind the README's exactness claim)."""
    from edgekv.engines import probe as probe_mod

    tr = terminalreporter
    tr.section("what ran for real")
    found: list[tuple[str, Callable[[], object]]] = []
    try:
        from edgekv.engines.models import default_model_path, gemma3_model_path
        from edgekv.semantic.embedder import minilm_dir

        found = [("SmolLM2", default_model_path), ("Gemma 3", gemma3_model_path),
                 ("MiniLM", minilm_dir)]
    except Exception as e:  # noqa: BLE001 - an extra not installed: say so, don't crash
        tr.write_line(f"model lookup unavailable: {e}")
    for name, find in found:
        try:
            tr.write_line(f"{name}: {find()}")
        except Exception as e:  # noqa: BLE001
            tr.write_line(f"{name}: not found ({type(e).__name__}: {e})")
    if not probe_mod._memo:
        tr.write_line("batch-invariance probe: not run in this session")
    for result in probe_mod._memo.values():
        verdict = ("invariant: token-granular exact reuse" if result.invariant else
                   "NOT invariant (" + ", ".join(result.failed) + "): whole-chunk reuse")
        same = sum(d == 0.0 and kv for _, d, kv in result.results)
        tr.write_line(f"probe {same}/{len(result.results)} schedules identical, {verdict}; "
                      f"{result.describe[:160]}")
