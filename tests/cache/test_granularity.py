"""Reuse granularity: the batch-invariance probe decides between reuse that ends at any token
(one-batch prefill, tails and answers stored) and whole-chunk reuse (the fallback)."""

import json

import numpy as np
import pytest

from edgekv import CacheConfig, ConfigError, EdgeKV, open_store
from edgekv.engines import probe as probe_mod
from edgekv.engines.fake import FakeAdapter
from edgekv.engines.probe import load_or_probe, probe_batch_invariance, recorded_probes

CONTEXT = "The hub connects lights, thermostats and sensors. " * 6  # ~300 fake tokens


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(probe_mod, "_memo", {})


def make(tmp_path, adapter=None, **cfg):
    config = CacheConfig(chunk_size=64, cache_dir=tmp_path, **cfg)
    return EdgeKV(adapter or FakeAdapter(), open_store(config), config)


def plain_cold(prompt, max_tokens, **kw):
    """A fresh engine, the whole prompt in one batch: what a user gets with no cache at all."""
    a = FakeAdapter(**kw)
    logits = a.prefill(a.tokenize(prompt), align=a.n_ctx)
    return logits, a.generate(logits, max_tokens).tokens


def test_probe_passes_on_an_invariant_engine_and_fails_on_a_variant_one():
    ok = probe_batch_invariance(FakeAdapter())
    assert ok.invariant and ok.granularity == "token" and not ok.failed
    assert ok.long_tokens == probe_mod.LONG_PROBE_TOKENS  # the fake's context holds it
    assert ok.sensitivity > 0 and len(ok.results) == (
        len(probe_mod.schedules(ok.tokens)) + len(probe_mod.long_schedules(ok.long_tokens)))
    assert ok.sequences == 0  # the fake has no sequence ids: no multi-sequence schedule
    bad = probe_batch_invariance(FakeAdapter(batch_variant=True))
    assert not bad.invariant and bad.granularity == "chunk"
    assert "lone last token" in bad.failed and "4 decode steps" in bad.failed
    assert {"long 2040: lone last token", "long 2040: 4 decode steps"} <= set(bad.failed)


def test_long_schedules_run_only_where_the_context_holds_them():
    short = probe_batch_invariance(FakeAdapter(n_ctx=1024))
    assert short.long_tokens == 0 and short.invariant
    assert len(short.results) == len(probe_mod.schedules(short.tokens))
    assert not any(name.startswith("long") for name, _, _ in short.results)


def test_probe_key_follows_the_kernel_switches(monkeypatch):
    a = FakeAdapter()
    for var in probe_mod.KERNEL_ENV:
        monkeypatch.delenv(var, raising=False)
    plain, _ = probe_mod.probe_key(a)
    monkeypatch.setenv("GGML_CPU_BATCH_INVARIANT", "1")
    switched, readable = probe_mod.probe_key(a)
    assert switched != plain and "GGML_CPU_BATCH_INVARIANT=1" in readable
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "/elsewhere")
    assert probe_mod.probe_key(a)[0] not in (plain, switched)


def test_an_older_probe_record_is_measured_again(tmp_path):
    a = FakeAdapter()
    first = load_or_probe(a, tmp_path)
    path = probe_mod.probe_path(tmp_path, first.key)
    old = json.loads(path.read_text())
    for k in ("long_tokens", "sequences"):
        del old[k]
    old["version"] = 1
    path.write_text(json.dumps(old))
    assert probe_mod.ProbeResult.from_json(old).long_tokens == 0  # still readable
    probe_mod._memo.clear()
    again = load_or_probe(a, tmp_path)
    assert again.version == probe_mod.PROBE_VERSION and again.long_tokens > 0


def test_probe_is_recorded_once_and_read_back(tmp_path, monkeypatch):
    calls = []

    def counting(adapter):
        calls.append(1)
        return probe_batch_invariance(adapter)

    a = FakeAdapter()
    first = load_or_probe(a, tmp_path, counting)
    monkeypatch.setattr(probe_mod, "_memo", {})  # a new process: reads the record
    again = load_or_probe(a, tmp_path, counting)
    assert calls == [1] and again == first
    [rec] = recorded_probes(tmp_path)
    assert rec.invariant and rec.key == first.key
    other = load_or_probe(FakeAdapter(batch_variant=True), tmp_path, counting)
    assert calls == [1, 1] and not other.invariant  # another build: its own record


def test_damaged_probe_record_is_measured_again(tmp_path):
    a = FakeAdapter()
    first = load_or_probe(a, tmp_path)
    path = probe_mod.probe_path(tmp_path, first.key)
    path.write_text("{not json")
    probe_mod._memo.clear()
    assert load_or_probe(a, tmp_path).invariant
    assert json.loads(path.read_text())["invariant"] is True


def test_reuse_ends_mid_chunk_and_equals_plain_cold(tmp_path):
    kv = make(tmp_path)
    assert kv.granularity == "token" and kv.prefill_align == kv.adapter.n_ctx
    kv.generate(CONTEXT + "Question one?", max_tokens=4)
    prompt = CONTEXT + "Question two, longer?"
    warm = kv.generate(prompt, max_tokens=8)
    common = len(CONTEXT) + len("Question ") + 1  # +1 BOS
    assert warm.cached_tokens == common and common % 64 != 0
    assert warm.match.batch_exact(64) and warm.stored_fragments > 0
    logits, tokens = plain_cold(prompt, 8)
    assert np.array_equal(warm.first_logits, logits) and warm.tokens == tokens


def test_next_turn_reuses_the_previous_answer(tmp_path):
    kv = make(tmp_path)
    turn1 = CONTEXT + "User: first question?"
    r1 = kv.generate(turn1, max_tokens=12)
    held = kv.adapter.token_ids  # prompt + answer (the last sampled token is not evaluated)
    assert len(held) == r1.prompt_tokens + len(r1.tokens) - 1
    turn2 = held + kv.adapter.tokenize("User: second?", add_bos=False)
    r2 = kv.generate(turn2, max_tokens=4)
    assert r2.cached_tokens == len(held)  # the answer's KV was stored, not recomputed
    a = FakeAdapter()
    cold = a.prefill(turn2, align=a.n_ctx)
    assert np.array_equal(r2.first_logits, cold)


def test_fallback_when_the_probe_fails_is_whole_chunks_and_reported(tmp_path):
    kv = make(tmp_path, FakeAdapter(batch_variant=True))
    assert kv.granularity == "chunk" and kv.prefill_align == 64
    assert "probe failed" in kv.granularity_reason and "lone last token" in kv.granularity_reason
    kv.generate(CONTEXT + "Question one?", max_tokens=4)
    prompt = CONTEXT + "Question two, longer?"
    warm = kv.generate(prompt, max_tokens=8)
    assert warm.cached_tokens % 64 == 0 and warm.cached_tokens > 0
    cold = kv.generate(prompt, max_tokens=8, use_cache=False)  # its own aligned cold run
    assert np.array_equal(warm.first_logits, cold.first_logits) and warm.tokens == cold.tokens


def test_configured_chunk_granularity_skips_the_probe(tmp_path):
    kv = make(tmp_path, reuse_granularity="chunk")
    assert kv.probe is None and kv.granularity == "chunk"
    assert not (tmp_path / "probes").exists()


def test_bad_granularity_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="reuse_granularity"):
        CacheConfig(cache_dir=tmp_path, reuse_granularity="tokens")


def test_cache_stats_reports_the_granularity(tmp_path, capsys):
    from edgekv.cli import main

    make(tmp_path).close()
    assert main(["cache", "stats", "--cache-dir", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [p] = data["probes"]
    assert p["granularity"] == "token" and p["invariant"] is True


# -- a staged first start: the short stage, whole chunks, the rest in the background ----------

def test_the_short_stage_leaves_the_long_ones_pending_and_reuse_whole_chunks():
    first = probe_batch_invariance(FakeAdapter(), stage="short")
    assert first.pending == probe_mod.LATER_STAGES and not first.failed
    assert not first.invariant and first.granularity == "chunk"
    assert "not run yet" in first.reason and first.long_tokens == 0
    assert len(first.results) == len(probe_mod.schedules(first.tokens))
    whole = probe_mod.finish_probe(FakeAdapter(), first)
    assert whole.invariant and not whole.pending and whole.long_tokens > 0
    assert whole.results[: len(first.results)] == first.results
    assert whole.results == probe_batch_invariance(FakeAdapter()).results
    bad = probe_batch_invariance(FakeAdapter(batch_variant=True), stage="short")
    assert bad.failed and not bad.pending  # a failure is final: nothing left to run
    assert bad.reason.startswith("batch-invariance probe failed")


def test_a_staged_record_is_kept_and_finished_by_the_next_whole_probe(tmp_path, monkeypatch):
    a = FakeAdapter()
    first = load_or_probe(a, tmp_path, staged=True)
    assert first.pending
    monkeypatch.setattr(probe_mod, "_memo", {})  # a new process: the short answer is read back
    assert load_or_probe(a, tmp_path, staged=True) == first
    whole = load_or_probe(a, tmp_path)  # not staged: finishes what is pending, records it
    assert whole.invariant and not whole.pending
    monkeypatch.setattr(probe_mod, "_memo", {})
    assert load_or_probe(a, tmp_path, staged=True) == whole  # a whole answer is final


def test_a_staged_cache_starts_with_chunks_and_adopts_the_finished_probe(tmp_path):
    config = CacheConfig(chunk_size=64, cache_dir=tmp_path)
    kv = EdgeKV(FakeAdapter(), open_store(config), config, staged_probe=True)
    assert kv.granularity == "chunk" and kv.probe_pending == probe_mod.LATER_STAGES
    prompt = CONTEXT + "Question: which devices?"
    kv.generate(prompt, max_tokens=4)
    chunked = kv.generate(prompt + " And which hub?", max_tokens=4)
    assert chunked.cached_tokens % 64 == 0  # whole chunks only, so far
    finisher = kv.finish_probe()
    assert finisher is not None  # the fake opens a twin: it ran on a thread
    finisher.thread.join(60)
    assert finisher.result is not None and kv.granularity == "token" and not kv.probe_pending
    assert kv.granularity_reason == "batch-invariance probe passed"
    [rec] = recorded_probes(tmp_path / "probes")
    assert rec.invariant and not rec.pending  # the next start reads the whole answer
    kv.generate(prompt + " And which hub? Name it.", max_tokens=6)  # its tail is stored now
    longer = prompt + " And which hub? Name it. Now."
    warm = kv.generate(longer, max_tokens=6)
    assert warm.cached_tokens > chunked.cached_tokens and warm.cached_tokens % 64 != 0
    logits, tokens = plain_cold(longer, 6)
    assert list(warm.tokens) == list(tokens)  # token-granular reuse equals a plain cold run


def test_adopt_probe_takes_only_this_engines_finished_answer(tmp_path):
    config = CacheConfig(chunk_size=64, cache_dir=tmp_path)
    kv = EdgeKV(FakeAdapter(), open_store(config), config, staged_probe=True)
    with pytest.raises(ValueError, match="finished probe"):
        kv.adopt_probe(kv.probe)  # still pending
    with pytest.raises(ValueError, match="finished probe"):
        kv.adopt_probe(probe_batch_invariance(FakeAdapter(tag="another model")))
    assert kv.granularity == "chunk"
    assert kv.finish_probe(background=False) is None  # in line: done when it returns
    assert kv.granularity == "token"


def test_a_stopped_finisher_ends_between_schedules():
    import threading

    first = probe_batch_invariance(FakeAdapter(), stage="short")
    stop = threading.Event()
    stop.set()
    with pytest.raises(probe_mod.ProbeStopped):
        probe_mod.finish_probe(FakeAdapter(), first, stop=stop)
