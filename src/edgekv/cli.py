"""`edgekv`: one entry point; it parses arguments and calls the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import CacheConfig, KVServerConfig
from .errors import ConfigError, EdgeKVError, ModelNotFound

if TYPE_CHECKING:
    from .core.pipeline import EdgeKV
    from .engines.base import KVAdapter

__all__ = ["main"]


def _config(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig.from_env(
        chunk_size=getattr(args, "chunk_size", None),
        speculative=getattr(args, "speculative", None),
        cache_dir=Path(args.cache_dir) if getattr(args, "cache_dir", None) else None)


def _open(args: argparse.Namespace, *, staged_probe: bool = False) -> EdgeKV:
    from . import open_llamacpp
    from .engines.models import resolve_model

    resolve_model(args.model)  # a bad --model is reported as such, before anything else loads
    semantic = not args.no_semantic
    cfg = _config(args)
    if args.approximate or args.passage_reuse:
        import dataclasses

        cfg = dataclasses.replace(cfg, approximate=args.approximate,
                                  passage_reuse=args.passage_reuse)
    fill = _kv_loader(args)
    kwargs = _flash_attn(args)
    try:
        return open_llamacpp(args.model, cfg, n_ctx=args.n_ctx, semantic=semantic,
                             engine=args.engine, fill=fill, staged_probe=staged_probe, **kwargs)
    except (ImportError, ModelNotFound) as e:
        if not semantic:
            raise
        print(f"edgekv: semantic routing unavailable ({e}); exact prefix reuse only",
              file=sys.stderr)
        return open_llamacpp(args.model, cfg, n_ctx=args.n_ctx, semantic=False,
                             engine=args.engine, fill=_kv_loader(args),
                             staged_probe=staged_probe, **kwargs)


def _kv_loader(args: argparse.Namespace) -> Any:
    """SparKV's fill step for `--kv-server` (a `stream.hybrid.HybridLoader`), or None; the
    switches that need it, or that it cannot combine with, are refused here, before loading."""
    kv_only = [f"--{n.replace('_', '-')}" for n in ("kv_secret_file", "kv_tenant", "kv_link")
               if getattr(args, n) is not None]
    if args.kv_server is None:
        if kv_only:
            raise ConfigError(f"{', '.join(kv_only)} need --kv-server URL")
        return None
    if args.passage_reuse:
        raise ConfigError("--kv-server and --passage-reuse do not combine yet; use one")
    if args.no_cache:
        raise ConfigError("--no-cache answers every request cold; drop --kv-server")
    from .kvserver.server import load_secret
    from .stream.hybrid import HybridLoader

    link = None
    if args.kv_link is not None:
        try:
            mbps, rtt = (float(x) for x in args.kv_link.split(","))
        except ValueError:
            raise ConfigError(f"--kv-link {args.kv_link!r}: give MBPS,RTT_MS, e.g. 20,40"
                              ) from None
        if mbps <= 0 or rtt < 0:
            raise ConfigError(f"--kv-link {args.kv_link!r}: Mbit/s > 0 and RTT >= 0")
        link = (mbps, rtt)
    path = Path(args.kv_secret_file or _config(args).cache_dir / "kv-server.secret")
    if not path.is_file():
        raise ConfigError(f"no KV secret at {path}: copy the kv-server's --secret-file there "
                          "(a tenant's secret where it has tenants), or give "
                          "--kv-secret-file PATH")
    return HybridLoader.connect(args.kv_server, load_secret(path), tenant=args.kv_tenant or "",
                                link=link)


def _prompt_mode(args: argparse.Namespace) -> str:
    """"chat" (the model's template, the default where the GGUF has one) or "raw"; refuses
    the combinations that cannot hold, before anything loads."""
    if args.raw and args.chat:
        raise ConfigError("--raw and --chat contradict each other; give one")
    if args.passage_reuse:
        if args.chat:
            raise ConfigError("--passage-reuse does not combine with --chat yet")
        return "raw"
    if args.system is not None and args.raw:
        raise ConfigError("--system is a chat message: drop --raw, or put it in the prompt")
    return "raw" if args.raw else "chat"


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    mode = _prompt_mode(args)
    passages = None
    if args.passage_reuse:
        from .core.passages import split_passages

        passages, prompt = split_passages(prompt)
    t0 = time.perf_counter()
    kv = _open(args, staged_probe=_staged_probe())
    load_s = time.perf_counter() - t0
    try:
        template = kv.adapter.chat_template() if mode == "chat" else None
        if mode == "chat" and not template:
            if args.chat or args.system is not None:
                raise ConfigError("this model has no chat template; drop --chat / --system")
            mode = "raw"  # as llama-cli: a model without a template gets the text as it is
        why_raw = ("raw text (--passage-reuse implies --raw)" if args.passage_reuse else
                   "raw text (--raw)" if args.raw else "raw text (the model has no template)")
        shown_mode = "chat template" if mode == "chat" else why_raw
        asked: str | list[int] = prompt
        if mode == "chat":  # the messages' text stays text: chat.py
            from .chat import chat_tokens

            msgs = ([{"role": "system", "content": args.system}] if args.system else [])
            asked = chat_tokens(kv.adapter, msgs + [{"role": "user", "content": prompt}])
        warmup_s = _warm_up(kv.adapter)
        r = kv.generate(asked, max_tokens=args.max_tokens, temperature=args.temperature,
                        seed=args.seed, use_cache=not args.no_cache, passages=passages,
                        salt=args.kv_tenant or "")  # a KV-server tenant's own chain
        granularity, why = kv.granularity, kv.granularity_reason
        pending = kv.probe_pending
        spec_why = kv.speculation_reason
    finally:
        kv.close()
        kv.adapter.close()
    if pending:
        _finish_probe_detached(args)
    m = r.match
    route = {"tier": m.tier, "similarity": round(m.similarity, 4),
             "route_ms": round(m.route_s * 1000, 3), "exact_tokens": m.exact_tokens,
             "verified_extra_tokens": 0 if m.approximate else r.cached_tokens - m.exact_tokens,
             "approximate": m.approximate, "mismatched_tokens": m.mismatched_tokens}
    if args.json:
        print(json.dumps({
            "text": r.text, "tokens": list(r.tokens), "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "computed_tokens": r.computed_tokens,
            "ttft_ms": round(r.ttft_s * 1000, 3), "total_ms": round(r.total_s * 1000, 3),
            "load_s": round(load_s, 3), "warmup_s": round(warmup_s, 3),
            "prompt_mode": mode, "granularity": granularity, "granularity_reason": why,
            "speculative": spec_why,
            "stored_fragments": r.stored_fragments, "source_tiers": list(r.source_tiers),
            "rejections": list(r.rejections), "route": route,
            "passages": r.passages.as_dict() if r.passages else None,
            "edgekv": r.summary()}))
    else:
        print(r.text)
        tier = f" from {'/'.join(sorted(set(r.source_tiers)))}" if r.source_tiers else ""
        approx = (f", APPROXIMATE: {m.mismatched_tokens} positions hold another prompt's KV"
                  if m.approximate else "")
        if r.passages is not None:
            p = r.passages
            approx += (f", PASSAGE REUSE{' (approximate)' if p.approximate else ''} "
                       f"{p.policy}: {p.reused_tokens} of {p.passage_tokens} passage tokens "
                       f"placed from the cache, {p.recomputed_tokens} recomputed")
        drafts = (f" ({r.accepted_tokens} of {r.drafted_tokens} drafts accepted)"
                  if r.drafted_tokens else "")
        if spec_why.startswith("off:"):  # asked for, and the probe does not allow it
            drafts += f" (speculative decoding {spec_why})"
        print(f"\n[{shown_mode} | route {m.tier} (similarity {m.similarity:.3f}, "
              f"{m.route_s * 1000:.1f} ms) | "
              f"TTFT {r.ttft_s * 1000:.1f} ms | prompt {r.prompt_tokens} tokens: "
              f"{r.cached_tokens} reused{tier} ({m.exact_tokens} exact chain, "
              f"{route['verified_extra_tokens']} verified by tokens{approx}), "
              f"{r.computed_tokens} computed | "
              f"{len(r.tokens)} generated in {r.total_s * 1000:.0f} ms{drafts} | "
              f"{r.stored_fragments} fragments stored | load {load_s:.1f} s, warm-up "
              f"{warmup_s * 1000:.0f} ms | reuse granularity {granularity}: {why}"
              f"{'; the rest of the probe runs in the background' if pending else ''}]",
              file=sys.stderr)
    return 0


def _staged_probe() -> bool:
    """`EDGEKV_FIRST_PROBE`: "short" (default): a first start probes briefly and finishes the
    probe in the background; "full": the whole probe before the first answer."""
    how = os.environ.get("EDGEKV_FIRST_PROBE", "short")
    if how not in ("short", "full"):
        raise ConfigError(f"EDGEKV_FIRST_PROBE={how!r}: give short or full")
    return how == "short"


def _warm_up(adapter: KVAdapter) -> float:
    """One token through the model and back out (as llama-cli's warm-up does): the first
    forward pass pages the weights in, which is load time, not the prompt's TTFT."""
    t0 = time.perf_counter()
    adapter.prefill(adapter.tokenize("", add_bos=True)[:1] or [adapter.eos_token],
                    align=adapter.n_ctx)
    adapter.clear_kv_cache()
    return time.perf_counter() - t0


def _finish_probe_detached(args: argparse.Namespace) -> None:
    """The probe stages a staged start left pending, in a process of their own that outlives
    this one (`edgekv probe --finish`, at low priority): recorded for the next start."""
    import subprocess

    cmd = [sys.executable, "-m", "edgekv", "probe", "--finish", "--engine", args.engine,
           "--n-ctx", str(args.n_ctx), "--cache-dir", str(_config(args).cache_dir)]
    if args.model:
        cmd += ["--model", args.model]
    if args.flash_attn is not None:
        cmd.append("--flash-attn" if args.flash_attn else "--no-flash-attn")
    try:
        subprocess.Popen(["nice", "-n", "10", *cmd], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    except OSError as e:
        print(f"edgekv: could not start the probe's background stages ({e}); run "
              "`edgekv probe --finish`", file=sys.stderr)


def cmd_cache(args: argparse.Namespace) -> int:
    from .store import DiskStore

    cfg = _config(args)
    store = DiskStore(cfg.cache_dir / "store", cfg.disk_capacity_bytes)
    try:
        if args.action == "clear":
            n = store.clear()
            print(f"removed {n} fragments from {cfg.cache_dir / 'store'}")
        elif args.action == "sweep":
            print(f"removed {store.sweep()} expired fragments")
        else:
            from .engines.probe import recorded_probes

            s = store.stats()
            probes = recorded_probes(cfg.cache_dir / "probes")
            data = {"path": str(cfg.cache_dir / "store"), "entries": s.entries, "bytes": s.bytes,
                    "capacity_bytes": s.capacity_bytes,
                    # what opening and reading the store met here (a running server's own
                    # counts are on its /metrics: edgekv_faults)
                    "errors": s.errors, "corrupt": s.corrupt,
                    "probes": [{"engine": p.describe, "granularity": p.granularity,
                                "invariant": p.invariant, "failed": list(p.failed),
                                "probe_s": round(p.seconds, 2)} for p in probes]}
            if args.json:
                print(json.dumps(data))
            else:
                print(f"disk store {data['path']}: {s.entries} fragments, "
                      f"{s.bytes / 2**20:.1f} MiB of {s.capacity_bytes / 2**20:.0f} MiB"
                      + (f"; {s.errors} I/O errors, {s.corrupt} corrupt entries dropped"
                         if s.errors or s.corrupt else ""))
                for p in probes:
                    how = ("reuse ends at any token (batch-invariant)" if p.invariant else
                           "whole-chunk reuse: not batch-invariant under "
                           + ", ".join(p.failed))
                    print(f"engine {p.describe}: {how}")
    finally:
        store.close()
    return 0


# Commands of other distributions: the lab (`bench/`, package edgekv_bench) registers `bench`
# and `demo` as entry points of this group. Their names are listed without importing them, so
# `edgekv --help` loads no benchmark; a plugin's module is imported only when it is run.
PLUGIN_GROUP = "edgekv.commands"
DEFAULT_SLOTS = 4  # `edgekv serve --parallel`: llama-server's default slots
LAB_COMMANDS = {"bench": "benchmarks and harnesses (write JSON): `edgekv bench NAME --help`",
                "demo": "cold vs warm on real prompts (what `make run` shows)"}


def _plugins() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def cmd_plugin(args: argparse.Namespace) -> int:
    ep = _plugins().get(args.command)
    if ep is None:
        raise EdgeKVError(
            f"`edgekv {args.command}` is the lab's, and the lab is not installed: from a source "
            f"checkout, `pip install -e bench` (`make setup` does)")
    return int(ep.load()(list(args.rest)))


def cmd_kv_server(args: argparse.Namespace) -> int:
    from .core.match import ChunkReader
    from .core.pipeline import EdgeKV
    from .kvserver.server import KVServer, load_secret
    from .store import open_store_url

    cfg = _config(args)
    store = open_store_url(args.store or str(cfg.cache_dir / "kv-server"), cfg.disk_capacity_bytes)
    secret = load_secret(Path(args.secret_file or cfg.cache_dir / "kv-server.secret"), create=True)
    from .engines.llamacpp import LlamaCppAdapter

    kw = {"type_k": 0, "type_v": 0} if args.kv_type == "f32" else {}
    adapter = LlamaCppAdapter(args.model, n_ctx=args.n_ctx, memo_dir=cfg.cache_dir, **kw)
    # a first start runs the probe's short stage and finishes it beside serving, as `serve`
    engine = None if args.no_engine else EdgeKV(adapter, store, cfg,
                                                 staged_probe=_staged_probe())
    probing = engine.finish_probe() if engine is not None else None
    reader = ChunkReader.for_model(store, adapter.fingerprint, cfg.layers_per_fragment,
                                   local_layers=adapter.window.swa_layers,
                                   window=adapter.window.n_swa)
    server = KVServer(store, secret, fingerprint=adapter.fingerprint.digest,
                      model=adapter.model_path.name, chunk_size=cfg.chunk_size, engine=engine,
                      reader=reader, host=args.host, port=args.port,
                      session_ttl_s=KVServerConfig.from_env().session_ttl_s)
    host, port = server.address
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL needs it
    print(f"kv-server listening on http://{shown}:{port} (store {args.store or 'disk'}, "
          f"model {adapter.model_path.name})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if probing is not None:  # ends between two of its schedules
            probing.stop()
        server.shutdown()
        store.close()
        adapter.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible server: bind, then load the model in the background, then serve."""
    try:
        from .serve import ServeOptions, load_edgekv, run
        from .serve.guard import api_keys
    except ImportError as e:
        raise EdgeKVError(f"`edgekv serve` needs the serve extra ({e}); run "
                          "`pip install -e '.[serve]'`") from None
    from .engines.models import resolve_model

    if args.no_cache:
        on = [f"--{n.replace('_', '-')}" for n in ("semantic", "prefetch", "passage_reuse",
                                                   "approximate") if getattr(args, n)]
        if on:
            raise ConfigError(f"--no-cache answers every request cold; drop {', '.join(on)}")
    if args.approximate and not args.semantic:
        raise ConfigError("--approximate finds similar prompts through semantic routing: add "
                          "--semantic")
    if args.parallel is not None and args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: give 1 or more")
    one_seq = "--kv-server" if args.kv_server else "--passage-reuse" if args.passage_reuse else ""
    if args.parallel is not None and args.parallel > 1 and one_seq:
        raise ConfigError(f"--parallel {args.parallel} batches requests on one context; "
                          f"{one_seq} works on one sequence at a time: drop one of them")
    # as llama-server: 4 slots by default, where the probe shows batching exact; elsewhere
    # (a switch that fills one sequence per context too) open_slots says why it runs 1
    parallel = args.parallel or DEFAULT_SLOTS
    if args.step_budget_ms < 0:
        raise ConfigError(f"--step-budget-ms {args.step_budget_ms}: give 0 (off) or more")
    fill = _kv_loader(args)  # its switches are checked before the socket is up
    opts = ServeOptions(api_keys=api_keys(args.api_key or (), args.api_key_file or ()),
                        max_queue=args.max_queue, use_cache=not args.no_cache,
                        allow_approximate=args.approximate, parallel=parallel,
                        step_budget_s=args.step_budget_ms / 1000 or None,
                        kv_tenant=args.kv_tenant if fill is not None else None,
                        ui=not args.no_ui)  # keys first
    model = resolve_model(args.model)  # a bad --model fails now, not after the socket is up
    cfg = _config(args)
    import dataclasses

    if args.passage_reuse:
        cfg = dataclasses.replace(cfg, passage_reuse=True)
    if args.write_behind is not None:  # the flag, over EDGEKV_WRITE_BEHIND
        cfg = dataclasses.replace(cfg, write_behind=args.write_behind)
    elif cfg.write_behind is None:  # neither says: serve writes behind
        cfg = dataclasses.replace(cfg, write_behind=True)

    def announce(url: str) -> None:
        page = "" if args.no_ui else f"the page at {url}/, "
        print(f"edgekv serve: listening on {url} ({page}OpenAI API under {url}/v1; model "
              f"{model.stem} loading, GET /health answers 200 when ready)", flush=True)

    # a first start serves after the probe's short stage, whole chunks and one request at a
    # time until the rest passes in the background (its multi-sequence schedule decides the
    # slots, opened then)
    staged = _staged_probe()
    return run(lambda: load_edgekv(model, cfg, n_ctx=args.n_ctx, engine=args.engine,
                                   store_url=args.store, n_threads=args.threads,
                                   flash_attn=args.flash_attn, semantic=args.semantic,
                                   prefetch=args.prefetch, fill=fill, staged_probe=staged),
               model_id=model.stem, options=opts, host=args.host, port=args.port,
               announce=announce, log_level="info" if args.verbose else "warning")


def _flash_attn(args: argparse.Namespace) -> dict[str, Any]:
    """`--flash-attn` / `--no-flash-attn` for the engine; neither: the engine's default."""
    return {} if args.flash_attn is None else {"flash_attn": bool(args.flash_attn)}


def cmd_probe(args: argparse.Namespace) -> int:
    """Run the batch-invariance probe now (not the recorded answer) and time a cold prefill;
    `--finish`: finish (or run whole) the recorded answer of this cache dir and record it."""
    from .engines import open_adapter
    from .engines.base import KernelSettings
    from .engines.probe import measure_prefill, probe_batch_invariance

    if args.finish:
        return _probe_finish(args)
    adapter = open_adapter(args.engine, args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                           memo_dir=_config(args).cache_dir, **_flash_attn(args))
    flash_attn = isinstance(adapter, KernelSettings) and adapter.flash_attn
    try:
        res = probe_batch_invariance(adapter)
        speed = measure_prefill(adapter, args.prefill_tokens, runs=args.runs)
    finally:
        adapter.close()
    data = {**res.to_json(), "prefill_tokens": args.prefill_tokens,
            "prefill_tok_s": round(speed, 1), "flash_attn": flash_attn}
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")  # a reader never sees half a file
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, out)
    print(f"engine: {res.describe}")
    print(f"sensitivity (one early token changed): max |logit diff| = {res.sensitivity:.3g}")
    for name, diff, same_kv in res.results:
        kv = "identical" if same_kv else "DIFFERS"
        print(f"  {name:42s} max |logit diff| = {diff:<9.3g} KV {kv}")
    for name, diff, same_kv in res.notes:  # measured beside, deciding other things
        kv = "identical" if same_kv else "DIFFERS"
        print(f"  (noted) {name:34s} max |logit diff| = {diff:<9.3g} KV {kv}")
    ok = sum(d == 0.0 and s for _, d, s in res.results)
    print(f"{ok}/{len(res.results)} schedules bit-identical -> reuse granularity: "
          f"{res.granularity}; probe {res.seconds:.1f} s; cold prefill of "
          f"{args.prefill_tokens} tokens: {speed:.0f} tok/s")
    return 0


def _probe_finish(args: argparse.Namespace) -> int:
    """`edgekv probe --finish`: what `edgekv generate` starts after a staged first answer.
    One at a time per cache dir (a lock file beside the records; a dead holder's is taken)."""
    from .engines import open_adapter
    from .engines.probe import load_or_probe

    probe_dir = _config(args).cache_dir / "probes"
    probe_dir.mkdir(parents=True, exist_ok=True)
    lock = probe_dir / "finishing.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            holder = int(lock.read_text(encoding="utf-8") or 0)
            os.kill(holder, 0)
            print(f"edgekv probe --finish: another (pid {holder}) is running", file=sys.stderr)
            return 0
        except (ValueError, ProcessLookupError, PermissionError, OSError):
            lock.unlink(missing_ok=True)  # its holder is gone
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        adapter = open_adapter(args.engine, args.model, n_ctx=args.n_ctx,
                               n_threads=args.threads, memo_dir=_config(args).cache_dir,
                               **_flash_attn(args))
        try:
            res = load_or_probe(adapter, probe_dir)
        finally:
            adapter.close()
    finally:
        lock.unlink(missing_ok=True)
    print(f"engine: {res.describe}\nreuse granularity {res.granularity}: {res.reason}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgekv", description=__doc__)
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log cache decisions; -vv also EdgeKV's DEBUG lines (each batched "
                   "step of `serve --parallel`: its tokens, predicted and measured seconds)")
    sub = p.add_subparsers(dest="command", required=True)

    def engine_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model",
                        help="GGUF file, or a packaged model: smollm2 (SmolLM2-135M-Instruct, "
                             "the default) or gemma3 (Gemma 3 270M)")
        sp.add_argument("--n-ctx", type=int, default=2048, help="context window (tokens)")
        sp.add_argument("--cache-dir",
                        help="cache directory (default: $EDGEKV_CACHE_DIR or ~/.cache/edgekv)")
        sp.add_argument("--chunk-size", type=int, help="tokens per chunk (default 128)")

    def flash_attn_opt(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=None,
                        help="llama.cpp's flash attention (default: on where the engine runs "
                        "EdgeKV's batch-invariant kernels, the build `make setup` makes, with "
                        "GGML_CPU_BATCH_INVARIANT=1, its default; off elsewhere). Exact reuse "
                        "at any token only where the batch-invariance probe passes; "
                        "elsewhere whole chunks")

    def speculative_opt(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--speculative", choices=["none", "ngram"], default=None,
                        help="ngram: draft tokens from n-grams of the prompt and the answer "
                        "and verify them in one batch; the output stays bit-identical to plain "
                        "decoding, and it runs only where the batch-invariance probe's draft "
                        "schedule passes (default: none, or $EDGEKV_SPECULATIVE)")

    def kv_server_opts(sp: argparse.ArgumentParser) -> None:
        k = sp.add_argument_group("SparKV: load KV from an `edgekv kv-server`")
        k.add_argument("--kv-server", metavar="URL",
                       help="stream or compute each prompt chunk the device lacks, per the "
                       "cost model, re-planned as it runs, local compute when the network "
                       "fails; chunks computed here are published (the server precomputes "
                       "the prompt, in the background) for the next device")
        k.add_argument("--kv-secret-file", metavar="PATH",
                       help="the kv-server's --secret-file, or a tenant's secret where the "
                       "server has tenants (default: <cache dir>/kv-server.secret)")
        k.add_argument("--kv-tenant", metavar="NAME",
                       help="the kv-server tenant the secret belongs to: requests are keyed "
                       "in its chain, so it streams its own chunks")
        k.add_argument("--kv-link", metavar="MBPS,RTT_MS",
                       help="shape the link to the kv-server in this process (measurement "
                       "over loopback), e.g. 20,40")

    g = sub.add_parser("generate", help="answer a prompt, reusing cached KV")
    g.add_argument("prompt", help="prompt text, or - to read stdin")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-cache", action="store_true", help="cold run: no lookup, no store")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template (the default where the "
                   "GGUF has one)")
    g.add_argument("--raw", action="store_true",
                   help="send the prompt as it is, without the chat template (implied by "
                   "--passage-reuse)")
    g.add_argument("--system", help="system message (chat template)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--no-semantic", action="store_true", help="exact chain lookup only")
    g.add_argument("--engine", choices=["llamacpp", "torch", "onnx"], default="llamacpp",
                   help="inference engine (same GGUF weights; KV caches are kept per engine)")
    g.add_argument("--approximate", action="store_true",
                   help="inject similar prompts' KV even where tokens differ (changes output)")
    g.add_argument("--passage-reuse", action="store_true",
                   help="the prompt is 'passage<|passage|>passage<|passage|>question': cached "
                   "passages are reused wherever they sit (approximate, changes output)")
    engine_opts(g)
    flash_attn_opt(g)
    speculative_opt(g)
    kv_server_opts(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("cache", help="inspect or empty the fragment store")
    c.add_argument("action", choices=["stats", "clear", "sweep"])
    c.add_argument("--cache-dir")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_cache)

    k = sub.add_parser("kv-server", help="serve precomputed KV chunks (SparKV server)")
    k.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    k.add_argument("--port", type=int, default=8470, help="0 picks a free port")
    k.add_argument("--store", help="PATH, file://PATH or redis://HOST:PORT/DB (default: disk)")
    k.add_argument("--secret-file", help="pre-shared secret (created if missing)")
    k.add_argument("--no-engine", action="store_true", help="serve the store only, no precompute")
    k.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="engine KV dtype")
    engine_opts(k)
    k.set_defaults(func=cmd_kv_server)

    pr = sub.add_parser("probe", help="is the engine batch-invariant? (decides reuse granularity)")
    pr.add_argument("--engine", choices=["llamacpp", "torch", "onnx"], default="llamacpp")
    flash_attn_opt(pr)
    pr.add_argument("--threads", type=int, help="engine threads (default: all cores)")
    pr.add_argument("--prefill-tokens", type=int, default=512, help="cold prefill to time")
    pr.add_argument("--runs", type=int, default=3, help="cold prefill repeats (median)")
    pr.add_argument("--json", help="write the result here")
    pr.add_argument("--finish", action="store_true",
                    help="finish the probe a first start began (or run it whole) and record "
                    "the answer in the cache dir, as `generate` does in the background")
    engine_opts(pr)
    pr.set_defaults(func=cmd_probe)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, "
                        "/metrics) over the cache")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    sv.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    sv.add_argument("--api-key-file", action="append", metavar="PATH",
                    help="require `Authorization: Bearer KEY` with a key of this file (one "
                    "per line, `#` comments); each key is a tenant whose cached prefixes are "
                    "its own. Also: EDGEKV_API_KEYS=KEY1,KEY2 in the environment")
    sv.add_argument("--api-key", action="append", metavar="KEY",
                    help="a key on the command line (repeatable); other users of the machine "
                    "can read it in the process list, prefer --api-key-file")
    sv.add_argument("--store", help="fragment store behind RAM: PATH, file://PATH or "
                    "redis://HOST:PORT/DB (default: the disk store in the cache directory)")
    sv.add_argument("--engine", choices=["llamacpp", "torch", "onnx"], default="llamacpp")
    sv.add_argument("--threads", type=int, help="engine threads (default: all cores)")
    sv.add_argument("--no-cache", action="store_true",
                    help="answer every request cold, storing nothing (a reference run)")
    sv.add_argument("--no-ui", action="store_true", help="no page at / (the API is unchanged)")
    sv.add_argument("--max-queue", type=int, default=16,
                    help="waiting requests per tenant before 429 (default 16)")
    sv.add_argument("--parallel", type=int, metavar="N",
                    help="generate up to N requests at once, their prefill and decode tokens "
                    "batched in one llama.cpp context (a KV stream each), as llama-server's "
                    "slots do. Used only where the batch-invariance probe shows batching "
                    "keeps every answer exact; else one at a time, and /health's parallel "
                    "object, the startup log and /metrics (edgekv_batch_slots) say why. A "
                    "first start runs one at a time until the probe's multi-sequence "
                    f"schedule passes in the background (default {DEFAULT_SLOTS}, as "
                    "llama-server; 1 with --kv-server or --passage-reuse)")
    sv.add_argument("--step-budget-ms", type=float, default=100.0, metavar="MS",
                    help="with slots: the longest a step that holds running generations' "
                    "tokens may take; a prompt's prefill beside them is cut into pieces "
                    "that fit, sized from the measured step cost, so no stream stalls "
                    "(default 100; 0: pieces of 512 tokens, as llama-server's n_batch)")
    sv.add_argument("--write-behind", action=argparse.BooleanOptionalAction, default=None,
                    help="write the answers' KV to the disk (or --store) tier on a thread of "
                    "its own, at a lower priority, after it is in RAM: the slot goes on at "
                    "once, and reads find it in RAM or the queue meanwhile; a kill loses "
                    "what is queued (recomputed when asked again). Default: on, or "
                    "EDGEKV_WRITE_BEHIND where set")
    r = sv.add_argument_group("reuse beyond exact prefixes (each labelled in the response's "
                              "edgekv object)")
    r.add_argument("--semantic", action="store_true",
                   help="MiniLM + HNSW three-tier routing: each request's tier (exact, "
                   "partial, miss) in the X-EdgeKV-Tier header, the edgekv object and "
                   "/metrics (edgekv_route_tier_total)")
    r.add_argument("--prefetch", action="store_true",
                   help="n-gram prefetch: warm the predicted next context from disk into "
                   "RAM; hit rate in /metrics (edgekv_prefetch_hit_rate)")
    r.add_argument("--passage-reuse", action="store_true",
                   help="accept a `documents` field (strings, or {text, title}) on chat and "
                   "text completions: each is a passage placed before the conversation, its "
                   "cached KV reused wherever it sits (approximate, labelled)")
    r.add_argument("--approximate", action="store_true",
                   help="let a request ask `\"approximate\": true`: the seed's similarity "
                   "injection (another prompt's KV where tokens differ; changes output, "
                   "labelled; needs --semantic). Refused per request without this switch")
    engine_opts(sv)
    flash_attn_opt(sv)
    speculative_opt(sv)
    kv_server_opts(sv)
    sv.set_defaults(func=cmd_serve)

    for name, ep in {**dict.fromkeys(LAB_COMMANDS), **_plugins()}.items():
        if name in sub.choices:
            continue  # a plugin never shadows a product command
        where = f" (from {ep.dist.name})" if ep is not None and ep.dist is not None else ""
        # no option prefix: everything after the name (its options, --help) is the plugin's
        pl = sub.add_parser(name, help=LAB_COMMANDS.get(name, f"`edgekv {name} --help`") + where,
                            prefix_chars="+", add_help=False)
        pl.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
        pl.set_defaults(func=cmd_plugin)
    return p


def _resolve_model_arg(args: argparse.Namespace) -> None:
    """`--model` names a GGUF file or a packaged model's alias (`smollm2`, `gemma3`): resolved
    here, once, to a path (a model shipped in chunks is assembled into the cache directory)."""
    if getattr(args, "model", None) is not None:
        from .engines.models import resolve_model

        args.model = str(resolve_model(args.model, _config(args).cache_dir))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.verbose >= 2:  # EdgeKV's own DEBUG lines, not every library's
        logging.getLogger("edgekv").setLevel(logging.DEBUG)
    try:
        _resolve_model_arg(args)
        return int(args.func(args))
    except EdgeKVError as e:
        print(f"edgekv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
