"""The KV server (SparKV's server side, `edgekv kv-server`): sessions authenticated both ways,
chunks sealed to their session, request and place, precompute and a chunk source over a
fragment store. It speaks the protocol of `stream.protocol` with the device's client
(`stream.client`), and runs on the HTTP pieces it shares with `serve` (`http`)."""
