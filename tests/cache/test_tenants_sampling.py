"""Tenant salts keep chains apart; sampling options and the token callback (fake engine)."""

import numpy as np
import pytest

from edgekv import CacheConfig, ConfigError, EdgeKV, open_store
from edgekv.engines.fake import FakeAdapter
from edgekv.engines.shared import sample_token
from edgekv.keys import KV_SERVER_TENANTS, chunk_keys, tenant_root

CONTEXT = "The hub connects lights, thermostats and sensors. " * 6


@pytest.fixture
def kv(tmp_path):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path)
    k = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    yield k
    k.close()


def test_a_tenants_prefix_is_never_reused_for_another(kv):
    prompt = CONTEXT + "Question?"
    kv.generate(prompt, max_tokens=4, salt="tenant-a")
    assert kv.generate(prompt, max_tokens=4, salt="tenant-b").cached_tokens == 0
    assert kv.generate(prompt, max_tokens=4).cached_tokens == 0  # no salt is a tenant too
    warm = kv.generate(prompt, max_tokens=4, salt="tenant-a")
    cold = kv.generate(prompt, max_tokens=4, use_cache=False)
    assert warm.cached_tokens == warm.prompt_tokens - 1
    assert np.array_equal(warm.first_logits, cold.first_logits)


def test_salted_keys_differ_from_the_first_chunk_and_verify(kv):
    toks = kv.adapter.tokenize(CONTEXT)
    plain = chunk_keys(kv.fingerprint, toks, 64)
    salted = kv.chunk_keys(toks, "s")
    assert not set(plain) & set(salted)
    ns = KV_SERVER_TENANTS  # the library's default namespace
    assert tenant_root(kv.fingerprint, "", ns) == ""
    assert len(tenant_root(kv.fingerprint, "s", ns)) == 64
    kv.generate(toks, max_tokens=1, salt="s")
    chunk = kv.reader.read(salted[0], 0.0, [])
    assert chunk is not None and chunk.head.parent_key == tenant_root(kv.fingerprint, "s", ns)


def test_on_token_sees_each_token_and_can_stop(kv):
    seen = []
    r = kv.generate(CONTEXT, max_tokens=10, on_token=lambda t: seen.append(t) or len(seen) < 3)
    assert list(r.tokens) == seen and len(seen) == 3 and r.finish_reason == "stop"
    full = kv.generate(CONTEXT, max_tokens=10, use_cache=False)
    assert full.tokens[:3] == r.tokens and full.finish_reason == "length"


def test_top_p_keeps_the_nucleus_only():
    logits = np.array([5.0, 4.0, 0.0, -3.0], np.float32)
    rng = np.random.default_rng(0)
    draws = {sample_token(logits, 1.0, 0.5, rng) for _ in range(200)}
    assert draws == {0}  # token 0 alone holds >= 50% of the mass
    draws = {sample_token(logits, 1.0, 0.99, rng) for _ in range(500)}
    assert draws <= {0, 1, 2} and {0, 1} <= draws
    assert sample_token(logits, 0.0, 0.1, rng) == 0


def test_bad_top_p_is_a_clear_error(kv):
    with pytest.raises(ConfigError, match="top_p"):
        kv.generate(CONTEXT, max_tokens=2, temperature=0.7, top_p=0.0)
