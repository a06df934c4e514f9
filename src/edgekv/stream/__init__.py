"""Hybrid KV loading (SparKV): stream KV chunks from a server or compute them locally."""
