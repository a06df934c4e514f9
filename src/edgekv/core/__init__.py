"""The request path, one noun a module: `pipeline` (the `EdgeKV` orchestrator: prepare, match,
inject, fill, prefill, generate, commit), `request` (one `Request` in, one `GenerationResult`
out, and the seams of the steps), `match` (the chain walk and the prefix match), `prefix_index`
(the radix tree over chained keys: match, insert, pins, eviction), `writeback` (storing a
request's new KV), `fill` (the step between injection and prefill), `passages` (passage reuse,
opt-in) and `prefetch` (n-gram prefetch into RAM)."""
