"""The orchestrator's logic on the fake engine (milliseconds); the real engine has its own file."""

import dataclasses
import logging

import numpy as np
import pytest

from edgekv import (
    CacheConfig,
    EdgeKV,
    EdgeKVError,
    FragmentSpec,
    IncompatibleFragment,
    open_store,
)
from edgekv.core.request import Filled
from edgekv.engines.fake import FakeAdapter
from edgekv.engines.shared import aligned_batches, check_injectable

CONTEXT = "The hub connects lights, thermostats and sensors. " * 6  # ~300 fake tokens


def test_warm_equals_cold_and_skips_prefill(fake_cache):
    prompt = CONTEXT + "Question one?"
    cold = fake_cache.generate(prompt, max_tokens=8, use_cache=False)
    first = fake_cache.generate(prompt, max_tokens=8)  # fills the cache
    a = fake_cache.adapter
    before = a.computed_tokens
    warm = fake_cache.generate(prompt, max_tokens=8)
    assert warm.cached_tokens == (cold.prompt_tokens - 1) // 64 * 64 > 0
    assert a.computed_tokens - before == warm.computed_tokens + len(warm.tokens) - 1
    assert np.array_equal(warm.first_logits, cold.first_logits)
    assert warm.tokens == cold.tokens == first.tokens


def test_shared_prefix_reused_for_a_different_question(fake_cache):
    fake_cache.generate(CONTEXT + "Question one?", max_tokens=4)
    cold = fake_cache.generate(CONTEXT + "Another, longer question?", max_tokens=4, use_cache=False)
    warm = fake_cache.generate(CONTEXT + "Another, longer question?", max_tokens=4)
    assert warm.cached_tokens >= 256
    assert np.array_equal(warm.first_logits, cold.first_logits)


def test_different_prefix_same_suffix_is_not_reused(fake_cache):
    fake_cache.generate("X" + CONTEXT, max_tokens=1)
    r = fake_cache.generate("Y" + CONTEXT, max_tokens=1)
    assert r.cached_tokens == 0


def test_at_least_one_token_is_computed(fake_cache):
    tokens = list(range(1, 129))  # exactly two chunks
    fake_cache.generate(tokens, max_tokens=1)
    r = fake_cache.generate(tokens, max_tokens=1)
    assert r.cached_tokens == 64 and r.computed_tokens == 64  # whole chunks only (batch-exact)


def test_partial_reuse_cuts_a_stored_chunk(tmp_path):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, partial_reuse=True,
                      reuse_granularity="chunk")
    kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    tokens = list(range(1, 129))
    kv.generate(tokens, max_tokens=1)
    r = kv.generate(tokens, max_tokens=1)
    assert r.cached_tokens == 127 and r.computed_tokens == 1  # the stored 2nd chunk, cut
    assert not r.match.batch_exact(64) and r.stored_fragments == 0


def test_foreign_fragment_under_the_right_key_is_rejected(fake_cache, caplog):
    prompt = CONTEXT + "Question?"
    cold = fake_cache.generate(prompt, max_tokens=4, use_cache=False)
    fake_cache.generate(prompt, max_tokens=4)
    key = fake_cache.chunk_keys(fake_cache.adapter.tokenize(prompt))[0]
    good = fake_cache.store.get(key)
    fake_cache.store.put(key, dataclasses.replace(good, model_fingerprint="f" * 64,
                                                  content_hash=""))
    with caplog.at_level(logging.WARNING):
        r = fake_cache.generate(prompt, max_tokens=4)
    assert r.cached_tokens == 0 and r.rejections and "another model" in caplog.text
    assert np.array_equal(r.first_logits, cold.first_logits)


def test_tampered_token_ids_are_rejected(fake_cache):
    prompt = CONTEXT + "Question?"
    fake_cache.generate(prompt, max_tokens=1)
    key = fake_cache.chunk_keys(fake_cache.adapter.tokenize(prompt))[1]
    good = fake_cache.store.get(key)
    bad_ids = good.token_ids.copy()
    bad_ids[3] += 1
    fake_cache.store.put(key, dataclasses.replace(good, token_ids=bad_ids, content_hash=""))
    r = fake_cache.generate(prompt, max_tokens=1)
    assert r.cached_tokens == 64  # chunk 0 still good, chunk 1 refused
    assert any("token ids" in x for x in r.rejections)


def test_layer_split_fragments_reassemble(tmp_path):
    cfg = CacheConfig(chunk_size=64, layers_per_fragment=3, cache_dir=tmp_path,
                      reuse_granularity="chunk")  # counts whole-chunk fragments
    kv = EdgeKV(FakeAdapter(n_layer=7), open_store(cfg), cfg)
    prompt = CONTEXT + "Q?"
    cold = kv.generate(prompt, max_tokens=4, use_cache=False)
    first = kv.generate(prompt, max_tokens=4)
    assert first.stored_fragments == 3 * (first.prompt_tokens // 64)  # layer groups 0-3,3-6,6-7
    warm = kv.generate(prompt, max_tokens=4)
    assert warm.cached_tokens > 0 and np.array_equal(warm.first_logits, cold.first_logits)


def test_missing_layer_group_stops_reuse_there(tmp_path):
    cfg = CacheConfig(chunk_size=64, layers_per_fragment=2, cache_dir=tmp_path)
    kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    prompt = CONTEXT + "Q?"
    kv.generate(prompt, max_tokens=1)
    keys = kv.chunk_keys(kv.adapter.tokenize(prompt))
    kv.store.delete(f"{keys[2]}.L2-4")
    assert kv.generate(prompt, max_tokens=1).cached_tokens == 128


def test_hits_promote_after_five(fake_cache):
    prompt = CONTEXT + "Q?"
    fake_cache.generate(prompt, max_tokens=1)
    key = fake_cache.chunk_keys(fake_cache.adapter.tokenize(prompt))[0]
    for _ in range(5):
        fake_cache.generate(prompt, max_tokens=1)
    f = fake_cache.store.tiers[1].get(key)
    assert f.hit_count == 5
    assert f.expires_at - f.created_at > 24 * 3600


def test_prompt_too_long_is_a_clear_error(tmp_path):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path)
    kv = EdgeKV(FakeAdapter(n_ctx=100), open_store(cfg), cfg)
    with pytest.raises(EdgeKVError, match="context window"):
        kv.generate("x" * 95, max_tokens=10)
    with pytest.raises(EdgeKVError, match="empty"):
        kv.generate([], max_tokens=1)


def test_check_injectable_refusals(fragment_factory):
    a = FakeAdapter()
    fp = a.fingerprint
    f0 = fragment_factory(n_layer=4, width=8, fingerprint=fp.digest, start=0)
    f2 = fragment_factory(n_layer=4, width=8, fingerprint=fp.digest, start=128)
    with pytest.raises(IncompatibleFragment, match="gap"):
        check_injectable([f0, f2], fp)
    with pytest.raises(IncompatibleFragment, match="lack layers"):
        check_injectable([f0.layer_slice(0, 2)], fp)
    with pytest.raises(IncompatibleFragment, match="another model"):
        check_injectable([fragment_factory(n_layer=4, width=8)], fp)
    with pytest.raises(IncompatibleFragment, match="twice"):
        check_injectable([f0, f0], fp)
    assert check_injectable([f0], fp) == 64


def test_aligned_batches():
    assert aligned_batches(0, 300, 128) == [(0, 128), (128, 256), (256, 300)]
    assert aligned_batches(256, 20, 128) == [(256, 276)]
    assert aligned_batches(100, 60, 64) == [(100, 128), (128, 160)]


class FromElsewhere:
    """A fill step (`request.FillStep`) that appends chunks another engine computed: what the
    SparKV executor does over the network, without one."""

    whole_chunks = True

    def __init__(self, fragments, exact=True):
        self.fragments, self.exact, self.requests = fragments, exact, []

    def attach(self, adapter, config):
        pass

    def close(self):
        pass

    def fill(self, req):
        self.requests.append(req)
        c = req.chunk_size
        todo = [f for f in self.fragments if req.held <= f.token_start < req.n_chunks * c]
        for f in todo:
            req.check(f, f.token_start // c)
        req.adapter.append_fragments(todo)
        return Filled(req.n_chunks * c, len(todo) * c, self.exact)


def with_fill(kv, step):
    """The same engine, store and config with `step` as the fill step (chosen when built)."""
    return EdgeKV(kv.adapter, kv.store, kv.config, fill=step)


def test_a_fill_step_extends_the_match_before_the_prefill(fake_cache):
    tokens = fake_cache.adapter.tokenize(CONTEXT + "Question one?")
    keys = fake_cache.chunk_keys(tokens)
    other = FakeAdapter()
    cold = other.prefill(tokens, align=64)
    specs = [FragmentSpec(k, i * 64, (i + 1) * 64, parent_key=keys[i - 1] if i else "")
             for i, k in enumerate(keys)]
    frags = other.extract_fragments(specs)
    step = FromElsewhere(frags)
    kv = with_fill(fake_cache, step)
    r = kv.generate(tokens, max_tokens=2)
    n = (len(tokens) - 1) // 64
    assert (r.cached_tokens, r.streamed_tokens) == (0, n * 64)
    assert r.computed_tokens == len(tokens) - n * 64 and r.stored_fragments > 0
    assert np.array_equal(r.first_logits, cold)
    again = kv.generate(tokens, max_tokens=2)  # whole chunks from the cache
    assert (again.cached_tokens, again.streamed_tokens) == (n * 64, 0)
    assert step.requests[-1].held == n * 64
    with pytest.raises(IncompatibleFragment, match="chain key"):
        step.requests[-1].check(frags[1], 0)  # chunk 1 offered as chunk 0


def test_nothing_is_stored_on_top_of_inexact_fill(fake_cache):
    tokens = list(range(2, 2 + 64 * 3 + 5))
    keys = fake_cache.chunk_keys(tokens)
    other = FakeAdapter()
    other.prefill(tokens, align=64)
    frags = other.extract_fragments([FragmentSpec(k, i * 64, (i + 1) * 64,
                                                  parent_key=keys[i - 1] if i else "")
                                     for i, k in enumerate(keys)])
    r = with_fill(fake_cache, FromElsewhere(frags, exact=False)).generate(tokens, max_tokens=1)
    assert r.streamed_tokens == 192 and r.stored_fragments == 0


def test_ttft_stops_at_the_first_sampled_token(fake_cache) -> None:
    """TTFT covers lookup, inject, prefill and sampling the first token (where a streaming
    client's clock stops), and not the tokens after it."""
    import time

    seen: list[float] = []

    def on_token(tok: int) -> bool:
        seen.append(time.perf_counter())
        return True

    t0 = time.perf_counter()
    r = fake_cache.generate("a prompt long enough for a few tokens " * 8, max_tokens=6,
                            on_token=on_token)
    assert len(seen) >= 2
    assert r.lookup_s + r.inject_s + r.prefill_s <= r.ttft_s <= r.total_s
    assert r.ttft_s <= seen[0] - t0  # the clock stopped before the first token was handed on
    assert r.ttft_s < seen[-1] - t0
