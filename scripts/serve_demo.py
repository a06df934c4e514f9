"""`edgekv serve` end to end: start the server, ask two questions that share a long system
prompt through the `openai` client, show what the second one reused, stop the server.

    .venv/bin/python scripts/serve_demo.py [--cache-dir DIR] [--model GGUF]

The cache directory (default: $EDGEKV_CACHE_DIR or ~/.cache/edgekv, under `serve-demo/`) keeps
the engine's batch-invariance probe result between runs (the first run measures it, ~30 s);
its fragment store is emptied first, so the first question always starts cold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing

from edgekv.config import default_cache_dir  # noqa: E402
from edgekv.serve.runner import stop_process  # noqa: E402
from edgekv_bench.texts import MANUAL, QUESTIONS, SYSTEM_PROMPT  # noqa: E402


def start(cache_dir: Path, model: str | None) -> tuple[subprocess.Popen[str], str]:
    return launch(["serve", "--port", "0", "--cache-dir", str(cache_dir),
                   *(["--model", model] if model else [])])


def launch(args: list[str], env: dict[str, str] | None = None, log: Path | None = None
           ) -> tuple[subprocess.Popen[str], str]:
    """`edgekv ARGS` (a server that prints "listening on URL" first) from this checkout; its
    process and URL. `log`: its stderr goes there."""
    extra = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    path = [str(ROOT / "src"), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(path),
           **(env or {})}
    err = open(log, "w") if log is not None else None  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "edgekv", *args], stdout=subprocess.PIPE,
                            stderr=err, text=True, env=env)
    if err is not None:
        err.close()  # the child has its own copy
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if "listening on" not in line:
        proc.kill()
        tail = log.read_text()[-2000:] if log is not None else "see above"
        raise SystemExit(f"edgekv {args[0]} did not start (exit code {proc.wait()}): {tail}")
    return proc, line.split("listening on ")[1].split()[0]


def stop(proc: subprocess.Popen[str]) -> None:
    """Stop a server `launch` started (SIGTERM, then SIGKILL) and close its pipe."""
    stop_process(proc)
    if proc.stdout is not None:
        proc.stdout.close()


def wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited while loading (code {proc.returncode})")
        if time.monotonic() > deadline:
            raise SystemExit(f"the model did not load within {timeout:.0f} s")
        time.sleep(0.25)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir() / "serve-demo")
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    try:
        import openai
    except ImportError:
        raise SystemExit(
            "the demo needs the openai client: pip install -e '.[test,serve]'") from None
    shutil.rmtree(args.cache_dir / "store", ignore_errors=True)  # cold start, probe kept
    proc, url = start(args.cache_dir, args.model)
    try:
        print(f"server: {url}; loading the model (a first run also probes the engine)...",
              flush=True)
        t0 = time.perf_counter()
        wait_healthy(proc, url)
        print(f"ready in {time.perf_counter() - t0:.1f} s\n", flush=True)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        system = SYSTEM_PROMPT + "\n\n" + MANUAL
        for q in QUESTIONS[:2]:
            t = time.perf_counter()
            r = client.chat.completions.create(
                model="default", temperature=0, max_tokens=32,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
            u = r.usage
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            print(f"Q: {q}\nA: {(r.choices[0].message.content or '').strip()}\n"
                  f"   prompt {u.prompt_tokens} tokens, cached_tokens {cached}, "
                  f"{time.perf_counter() - t:.2f} s\n", flush=True)
        print("The second question reused the system prompt's KV from the first (cached_tokens)"
              "; see GET /metrics for the server's counters.")
        return 0
    finally:
        stop_process(proc)


if __name__ == "__main__":
    sys.exit(main())
