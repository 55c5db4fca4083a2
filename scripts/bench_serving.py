#!/usr/bin/env python3
"""End-to-end decode benchmark: stock SGLang 0.5.17 against ReplaySSM, served.

One invocation of `run` serves one model with one or more arms in turn (same
model, same flags except each arm's own), and for each arm: starts
`sglang.launch_server --load-format dummy`, waits for /health, checks that
/v1/chat/completions and /v1/completions answer, runs SGLang's own
`sglang.bench_one_batch_server` (random-ids prompts, 512 in / 256 out, batch
1, 64, 256), optionally dumps greedy tokens + logprobs for the parity check,
stops the server and writes benchmarks/results/partial/e2e_<model>_<arm>.json.
A device command may run 10 minutes and a server takes 1-5 minutes to become
healthy, hence one arm per call and a separate `merge`:

    python scripts/bench_serving.py run --model nemotron-h-8b --arms replayssm --parity
    python scripts/bench_serving.py merge      # -> benchmarks/results/e2e_decode.{json,md,png}

Arms. Mamba-2 models (NemotronH, FalconH1, GraniteMoeHybrid): stock-triton
(--mamba-backend triton), stock-flashinfer (--mamba-backend flashinfer),
replayssm. Gated DeltaNet (Qwen3-Next): stock-triton, sglang-replay (SGLang's
built-in --enable-linear-replayssm), replayssm.

Flags every arm of a model shares (so the comparison is fair):
--disable-radix-cache (one state slot per request, so 256 requests fit; it
also lets --enable-linear-replayssm run with the overlap scheduler: its
no_buffer requirement only applies with the radix cache on),
--max-running-requests 256 --cuda-graph-max-bs-decode 256 (CUDA graphs on;
the new name of --cuda-graph-max-bs),
--disable-flashinfer-autotune (saves 50-100 s of start-up; the same on every
arm), and per family the attention backend: NemotronH refuses triton
attention, so Mamba-2 models use flashinfer; Qwen3-Next triton attention and
the triton MoE runner. --server-args adds more to every arm.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

# the flag vocabulary of the replayssm arm, from the package it serves with
from sglang_replayssm.config import (CHECKPOINT_DTYPES, DECODE_ROUTES, DUMMY_INIT_ENV,
                                     NATIVE_FP32_OPS_ENV)
from sglang_replayssm.dummy_init import DUMMY_INITS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from provenance import provenance  # noqa: E402
DEFAULT_PARTIAL_DIR = os.path.join(REPO, "benchmarks", "results", "partial")
DEFAULT_RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")

COMMON_SERVER_FLAGS = [
    "--load-format", "dummy", "--disable-radix-cache",
    "--max-running-requests", "256", "--cuda-graph-max-bs-decode", "256",
    "--disable-flashinfer-autotune",
]
FAMILY_SERVER_FLAGS = {
    "mamba2": ["--attention-backend", "flashinfer"],
    "gdn": ["--attention-backend", "triton", "--moe-runner-backend", "triton"],
}
# per architecture, for every arm alike: SGLang 0.5.17's prefill CUDA graph
# (backend "breakable", on by default) crashes stock FalconH1 at its first
# request on the H200 (illegal memory access, --mamba-backend triton,
# 2026-12-04, benchmarks/NOTES.md); without it the stock server answers
ARCH_SERVER_FLAGS = {
    "FalconH1ForCausalLM": ["--disable-prefill-cuda-graph"],
}
# --fp32-activations, for every arm alike: FlashInfer's attention has no fp32,
# triton's rounds through tf32 dots (and SGLang refuses it for NemotronH);
# the exact fp32 MoE loop (sglang_hooks.NATIVE_FP32_OPS) syncs with the host,
# which a CUDA graph cannot capture
FP32_ACTIVATION_ARGS = ("--dtype", "float32", "--attention-backend", "torch_native",
                        "--disable-prefill-cuda-graph", "--disable-decode-cuda-graph")
# SGLang's environment variable for the dtype of the Mamba-2 / GDN conv state
MAMBA_CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"
STOCK_ARM_FLAGS = {
    "mamba2": {"stock-triton": ["--mamba-backend", "triton"],
               "stock-flashinfer": ["--mamba-backend", "flashinfer"]},
    # flashinfer's GDN decode is slower on SM90 (SGLang gathers and scatters the
    # state around it) but rounds differently from the triton one: run it with
    # --parity for the stock-vs-stock noise floor of greedy parity
    "gdn": {"stock-triton": ["--linear-attn-decode-backend", "triton"],
            "stock-flashinfer": ["--linear-attn-decode-backend", "flashinfer"]},
}
REPLAY_ARM = "replayssm"
SGLANG_REPLAY_ARM = "sglang-replay"  # GDN only: SGLang's built-in ReplaySSM
GDN_ARCHITECTURES = {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"}

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench_serving +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# --- what to launch ----------------------------------------------------------

def model_architectures(model_path: str) -> list[str]:
    with open(os.path.join(model_path, "config.json")) as f:
        return list(json.load(f).get("architectures", []))


def model_family(model_path: str) -> str:
    return "gdn" if set(model_architectures(model_path)) & GDN_ARCHITECTURES else "mamba2"


def arch_server_flags(model_path: str) -> list[str]:
    return [f for a in model_architectures(model_path) for f in ARCH_SERVER_FLAGS.get(a, [])]


# stock arms run only when named in --arms: too slow to be the stock to beat,
# kept as the parity noise floor (see merge_parity)
NOISE_FLOOR_ARMS = {"gdn": ("stock-flashinfer",)}


def arms_for(family: str) -> list[str]:
    """The arms run when --arms is not given."""
    arms = [a for a in STOCK_ARM_FLAGS[family] if a not in NOISE_FLOOR_ARMS.get(family, ())]
    if family == "gdn":
        arms.append(SGLANG_REPLAY_ARM)
    return arms + [REPLAY_ARM]



def split_arm(arm: str, decode_route: str = "auto") -> tuple[str, str]:
    """'replayssm:split' -> ('replayssm', 'split'): an arm may name its own
    decode route, so both routes run in one invocation; otherwise the arm
    takes --decode-route."""
    base, sep, route = arm.partition(":")
    if not sep:
        return arm, decode_route
    if base != REPLAY_ARM or route not in DECODE_ROUTES:
        raise ValueError(f"arm {arm!r}: only {REPLAY_ARM} takes a decode route suffix, one of "
                         f"{DECODE_ROUTES} (e.g. {REPLAY_ARM}:output_only)")
    return base, route


def arm_label(arm: str, checkpoint_dtype: str, decode_route: str = "auto") -> str:
    """replayssm with a non-default checkpoint dtype or decode route is its own arm."""
    if arm != REPLAY_ARM:
        return arm
    parts = [REPLAY_ARM] + [p for p in (checkpoint_dtype, decode_route) if p != "auto"]
    return "-".join(parts)


def arm_flags(family: str, arm: str, buffer_len: int, checkpoint_dtype: str,
              decode_route: str = "auto") -> list[str]:
    if arm in STOCK_ARM_FLAGS[family]:
        return list(STOCK_ARM_FLAGS[family][arm])
    if arm == SGLANG_REPLAY_ARM and family == "gdn":
        return ["--enable-linear-replayssm", "--linear-replayssm-cache-len", str(buffer_len)]
    if arm == REPLAY_ARM:
        return (["--enable-replayssm", "--replayssm-buffer-len", str(buffer_len),
                 "--replayssm-checkpoint-dtype", checkpoint_dtype]
                + ([] if decode_route == "auto" else ["--replayssm-decode-route", decode_route]))
    raise ValueError(f"arm {arm!r} does not exist for a {family} model (arms: "
                     f"{arms_for(family) + list(NOISE_FLOOR_ARMS.get(family, ()))})")


def server_command(model_path: str, family: str, arm: str, *, port: int, buffer_len: int = 16,
                   checkpoint_dtype: str = "auto", decode_route: str = "auto", extra_args=(),
                   radix_cache: bool = False, python: str = sys.executable):
    common = [f for f in COMMON_SERVER_FLAGS if not (radix_cache and f == "--disable-radix-cache")]
    return ([python, "-m", "sglang.launch_server", "--model-path", model_path,
             "--host", "127.0.0.1", "--port", str(port)]
            + common + FAMILY_SERVER_FLAGS[family] + arch_server_flags(model_path)
            + arm_flags(family, arm, buffer_len, checkpoint_dtype, decode_route)
            + list(extra_args))


def bench_command(model_path: str, base_url: str, *, batch_sizes, input_len: int,
                  output_len: int, result_file: str, python: str = sys.executable,
                  profile_dir: str | None = None, profile_steps: int = 0,
                  skip_warmup: bool = False):
    """bench_one_batch_server; skip_warmup for a repeat against a server that
    an earlier run already warmed at these batch sizes (saves its ~10 s
    warm-up batches); with profile_dir a torch-profiler run instead
    (GPU activity of the batch's first profile_steps forward steps, traces
    written by the server into profile_dir): the profiler slows the steps it
    records, so this runs after the timed batch and its numbers are not used."""
    cmd = [python, "-m", "sglang.bench_one_batch_server", "--model-path", model_path,
           "--base-url", base_url, "--batch-size", *map(str, batch_sizes),
           "--input-len", str(input_len), "--output-len", str(output_len),
           "--dataset-name", "random-ids", "--result-filename", result_file, "--show-report"]
    if skip_warmup:
        cmd.append("--skip-warmup")
    if profile_dir:
        cmd += ["--profile", "--profile-activities", "GPU", "--profile-output-dir", profile_dir,
                "--profile-steps", str(profile_steps)]
    return cmd


def summarize_profile(trace_dir: str, steps: int, top: int = 40) -> dict:
    """GPU kernel time per name from the torch-profiler traces (chrome trace
    JSON, optionally .gz) in trace_dir: [{name, count, total_us, us_per_step}],
    longest first. Kernels inside CUDA graphs are traced individually."""
    import gzip

    totals: dict[str, list] = {}
    # chrome traces only (the run also leaves server_args.json and bench.jsonl there)
    files = sorted(p for p in glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True)
                   if p.endswith((".trace.json", ".trace.json.gz")))
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for ev in events:
            if ev.get("cat") == "kernel" and "dur" in ev:
                t = totals.setdefault(ev["name"], [0, 0.0])
                t[0] += 1
                t[1] += float(ev["dur"])
    kernels = sorted(({"name": n[:200], "count": c, "total_us": round(us, 1),
                       "us_per_step": round(us / max(steps, 1), 2)}
                      for n, (c, us) in totals.items()), key=lambda k: -k["total_us"])
    return {"trace_files": [os.path.relpath(p, trace_dir) for p in files], "steps": steps,
            "gpu_us_per_step": round(sum(k["total_us"] for k in kernels) / max(steps, 1), 1),
            "kernels": kernels[:top]}


# --- parsing -----------------------------------------------------------------

def _case(bs, input_len, output_len, tps, latency, ttft) -> dict:
    """One bench_one_batch_server case; ITL as its report computes it:
    1000 * batch / output throughput."""
    bs, tps = int(bs), float(tps)
    return {"input_len": int(input_len), "output_len": int(output_len), "output_tok_s": tps,
            "itl_ms": 1000.0 * bs / tps if tps > 0 else None,
            "latency_s": float(latency), "ttft_s": float(ttft)}


def parse_bench_results(jsonl_text: str) -> dict[int, dict]:
    """bench_one_batch_server's --result-filename lines -> {batch: metrics}."""
    out = {}
    for line in jsonl_text.splitlines():
        line = line.strip()
        if not line:
            continue
        r = json.loads(line)
        out[int(r["batch_size"])] = _case(r["batch_size"], r["input_len"], r["output_len"],
                                          r["output_throughput"], r["latency"], r["last_ttft"])
    return out


_STDOUT_CASE = re.compile(
    r"batch size: (?P<bs>\d+)\s+input_len: (?P<il>\d+)\s+output_len: (?P<ol>\d+)\s+"
    r"latency: (?P<lat>[\d.]+) s\s+input throughput: [\d.]+ tok/s\s+"
    r"output throughput: (?P<tps>[\d.]+) tok/s\s+last_ttft: (?P<ttft>[\d.]+) s")


def parse_bench_stdout(text: str) -> dict[int, dict]:
    """The same metrics from bench_one_batch_server's printed cases (used when
    the result file is missing). Warm-up cases print too; the last one of each
    batch size wins, and the measured cases come after the warm-up."""
    out = {}
    for m in _STDOUT_CASE.finditer(text):
        out[int(m["bs"])] = _case(m["bs"], m["il"], m["ol"], m["tps"], m["lat"], m["ttft"])
    return out


_DECODE_LINE = re.compile(
    r"Decode batch(?: \[\d+\])?, #running-req: (?P<running>\d+),.*?"
    r"cuda graph: (?P<graph>True|False), gen throughput \(token/s\): (?P<tps>[\d.]+), "
    r"#queue-req: (?P<queue>\d+)")


# with speculative decoding the line also says (metrics_reporter.py:798)
_ACCEPT_LEN = re.compile(r"accept len: (?P<accept>[\d.]+), ")


def parse_decode_lines(log_text: str) -> list[dict]:
    """The scheduler's periodic 'Decode batch' lines (every
    --decode-log-interval = 40 steps): gen throughput is the tokens of those
    40 steps over their wall time, so one step = running requests / throughput,
    times the accept length with speculative decoding (a verify step gives
    each request its accepted drafts plus the bonus token; accept_len is None
    without)."""
    rows = []
    for m in _DECODE_LINE.finditer(log_text):
        running, tps = int(m["running"]), float(m["tps"])
        a = _ACCEPT_LEN.search(m.group(0))
        accept_len = float(a["accept"]) if a else None
        rows.append({"running": running, "cuda_graph": m["graph"] == "True",
                     "queue": int(m["queue"]), "gen_tok_s": tps, "accept_len": accept_len,
                     "step_ms": (1000.0 * running * (accept_len or 1.0) / tps
                                 if tps > 0 else None)})
    return rows


def steady_step_ms(decode_lines: list[dict], batch: int, key: str = "step_ms"):
    """Median decode step (or another ``key`` of the lines, e.g. accept_len)
    at `batch` running requests. The first line of each run of lines with
    the same batch is dropped: its interval started before the batch did
    (prefill, idle time between cases)."""
    steps, previous = [], None
    for row in decode_lines:
        if (row["running"] == batch and previous == batch and row["queue"] == 0
                and row[key] is not None):
            steps.append(row[key])
        previous = row["running"]
    return statistics.median(steps) if steps else None


# --- greedy parity -----------------------------------------------------------

def parity_prompts(n: int, length: int, seed: int = 1234, low: int = 10, high: int = 30000):
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def prompts_digest(prompts) -> str:
    """sha256 of the prompt token ids (compact JSON), what a greedy dump keeps
    of its prompts: they are parity_prompts(n, input_len) again, and the ids
    themselves were half of each partial's bytes (the repo travels to the GPU
    host within 64 MiB)."""
    return hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()


def greedy_dump(prompts, outputs, **extra) -> dict:
    return {"prompts_sha256": prompts_digest(prompts), "num_prompts": len(prompts),
            "prompt_len": len(prompts[0]) if prompts else 0, **extra, "outputs": outputs}


def _dump_prompts_id(dump: dict) -> str:
    # partials written before 2026-12-04 night carry the ids themselves
    return dump["prompts_sha256"] if "prompts_sha256" in dump else prompts_digest(dump["prompts"])


def parse_generate_outputs(response) -> list[dict]:
    """/generate (batch, return_logprob) -> [{ids, logprobs}] per prompt;
    meta_info.output_token_logprobs holds (logprob, token_id, text) triples."""
    outs = []
    for item in response:
        triples = item["meta_info"]["output_token_logprobs"]
        outs.append({"ids": [int(t[1]) for t in triples], "logprobs": [float(t[0]) for t in triples]})
    return outs


# Below this spread of the stock greedy logprobs the logits are flat (SGLang's
# dummy init gives -ln(vocab) everywhere) and a parity comparison is vacuous.
FLAT_LOGPROB_SPREAD = 1e-3


def compare_parity(stock: dict, replay: dict, *, model: str, checkpoint_dtype: str) -> dict:
    """greedy_parity entry of e2e_decode.json (docs/RESULTS.md). The first
    divergence is the earliest position (then lowest prompt index) where the
    greedy tokens differ; logprob_gap = |logprob of the stock token - logprob
    of the replay token| there (both conditioned on the same prefix; a small
    gap means a near-tie). Also: the largest logprob difference over the
    positions before each prompt's divergence."""
    s_out, r_out = stock["outputs"], replay["outputs"]
    assert _dump_prompts_id(stock) == _dump_prompts_id(replay), \
        "the two dumps used different prompts"
    identical, first, max_diff, agree = 0, None, 0.0, []
    for p, (a, b) in enumerate(zip(s_out, r_out)):
        n = min(len(a["ids"]), len(b["ids"]))
        j = next((k for k in range(n) if a["ids"][k] != b["ids"][k]), None)
        same_upto = n if j is None else j
        agree.append(same_upto)
        for k in range(same_upto):
            max_diff = max(max_diff, abs(a["logprobs"][k] - b["logprobs"][k]))
        if j is None and len(a["ids"]) == len(b["ids"]):
            identical += 1
            continue
        if j is None:  # one is a prefix of the other
            j, gap = n, None
        else:
            gap = abs(a["logprobs"][j] - b["logprobs"][j])
        if first is None or (j, p) < (first["position"], first["prompt"]):
            first = {"prompt": p, "position": j, "logprob_gap": gap}
    stock_lp = [x for o in s_out for x in o["logprobs"]]
    spread = (max(stock_lp) - min(stock_lp)) if stock_lp else 0.0
    entry = {"model": model, "checkpoint_dtype": checkpoint_dtype, "prompts": len(s_out),
             "tokens": max((len(o["ids"]) for o in s_out), default=0),
             "identical_prompts": identical, "first_divergence": first,
             # tokens greedy agrees for before a prompt diverges (all of them if it never does)
             "median_agreeing_tokens": statistics.median(agree) if agree else None,
             "max_logprob_diff_before_divergence": max_diff,
             "stock_logprob_spread": spread, "informative": spread >= FLAT_LOGPROB_SPREAD}
    if not entry["informative"]:
        entry["note"] = ("flat logits: every greedy logprob is ~ -ln(vocab), so the greedy "
                         "tokens are decided below the logits' resolution and the comparison "
                         "cannot tell the SSM paths apart (SGLang's uniform +-1e-3 dummy "
                         "init); rerun with --dummy-init scaled")
    return entry


# --- the server --------------------------------------------------------------

def http_json(url: str, payload=None, timeout: float = 60.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def http_text(url: str, timeout: float = 60.0) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"),
                                timeout=timeout) as resp:
        return resp.read().decode()


class Server:
    """launch_server in its own process group, log to a file, always killed."""

    def __init__(self, cmd: list[str], log_path: str, env: dict | None = None):
        self.cmd, self.log_path, self.env, self.proc = cmd, log_path, env, None

    def __enter__(self):
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env)
        log(f"server pid {self.proc.pid}, log {self.log_path}")
        return self

    def wait_healthy(self, url: str, timeout_s: float) -> float:
        start = time.monotonic()
        last_note = start
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} after "
                                   f"{time.monotonic() - start:.0f}s; see {self.log_path}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - last_note > 30:
                log(f"waiting for /health ({time.monotonic() - start:.0f}s)")
                last_note = time.monotonic()
            time.sleep(2)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f}s; see {self.log_path}")

    def log_text(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        log(f"server stopped (rc {self.proc.returncode if self.proc else None})")


def _raise_on_sigterm(signum, frame):
    raise SystemExit(f"signal {signum}")  # unwinds through Server.__exit__


# --- environment / header ----------------------------------------------------

def environment() -> dict:
    from importlib import metadata
    versions = {}
    for dist in ("torch", "triton", "sglang", "flashinfer-python", "sglang-kernel", "sglang-replayssm"):
        try:
            versions[dist.replace("-python", "")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    gpu = "unknown"
    try:
        import torch
        versions["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {**provenance(REPO), "gpu": gpu, "versions": versions,
            "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def partial_path(partial_dir: str, model: str, label: str) -> str:
    return os.path.join(partial_dir, f"e2e_{model}_{label}.json")


# --- run one arm ---------------------------------------------------------------

def check_openai(url: str) -> dict:
    chat = http_json(url + "/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "Hello! Who are you?"}],
        "max_tokens": 16, "temperature": 0}, timeout=120)
    comp = http_json(url + "/v1/completions", {
        "model": "default", "prompt": "The capital of France is", "max_tokens": 16,
        "temperature": 0}, timeout=120)
    result = {"chat": chat["choices"][0]["message"]["content"],
              "completions": comp["choices"][0]["text"],
              "chat_tokens": chat["usage"]["completion_tokens"],
              "completions_tokens": comp["usage"]["completion_tokens"]}
    if result["chat_tokens"] < 1 or result["completions_tokens"] < 1:
        raise RuntimeError(f"OpenAI endpoints returned no tokens: {result}")
    return result


def generate_greedy(url: str, prompts, tokens: int, timeout: float) -> list[dict]:
    return parse_generate_outputs(http_json(url + "/generate", {
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}},
        timeout=timeout))


def parity_floor_dump(args, url: str, tag: str, prompts) -> dict:
    """The same greedy dump again, sent in consecutive groups of
    --parity-floor-group prompts: same server, same kernels, but every GEMM
    and attention kernel runs at another batch size (other tiles, other
    fp32 summation order). Against the batch dump this is the noise floor of
    the arm itself: how far greedy tokens move when nothing but the rounding
    of the non-SSM layers changes."""
    n = args.parity_floor_group
    log(f"{tag}: greedy dump again in groups of {n} (batch-composition noise floor)")
    outputs = []
    for i in range(0, len(prompts), n):
        outputs += generate_greedy(url, prompts[i:i + n], args.parity_tokens, args.bench_timeout)
    return greedy_dump(prompts, outputs, group=n)


_PREFILL_CACHED = re.compile(r"Prefill batch(?: \[\d+\])?, #new-seq: \d+, #new-token: \d+, "
                             r"#cached-token: (?P<cached>\d+)")


def cached_tokens(log_text: str) -> int:
    """Prompt tokens the radix cache supplied, over the 'Prefill batch' lines."""
    return sum(int(m["cached"]) for m in _PREFILL_CACHED.finditer(log_text))


def radix_check(args, url: str, tag: str, server, prompts, outputs) -> dict:
    """The radix cache continuing a cached request exactly (server run with
    --radix-cache). The parity dump's requests are cached when they finish:
    each one's key is its prompt and every output token but the last (the
    one never fed), its SSM state whatever the slot held then (for
    ReplaySSM with --parity-tokens below the buffer length, a checkpoint plus
    a partly filled input buffer). Second turns, prompt + outputs + a fixed
    random suffix, are dumped twice: against that cache (``hit``), then after
    /flush_cache from scratch (``miss``). Greedy tokens of the two should
    agree as the arm agrees with itself; the cached prompt tokens of each
    dump come from the server log."""
    rng = random.Random(4321)
    turns = [p + o["ids"] + [rng.randrange(10, 30000) for _ in range(args.radix_suffix_len)]
             for p, o in zip(prompts, outputs)]
    dumps = {}
    for which in ("hit", "miss"):
        if which == "miss":
            http_text(url + "/flush_cache")
        start = len(server.log_text())
        log(f"{tag}: radix check, second turns {which}")
        out = generate_greedy(url, turns, args.parity_tokens, args.bench_timeout)
        dumps[which] = greedy_dump(turns, out, cached_tokens=cached_tokens(
            server.log_text()[start:]))
        log(f"{tag}: radix check {which}: {dumps[which]['cached_tokens']} prompt tokens cached")
    return dumps


def profile_arm(args, url: str, tag: str) -> dict:
    """One more batch (the largest) under the torch profiler, after the timed
    runs; the traces are summarised into the partial and then deleted (tens of
    MB each)."""
    trace_dir = os.path.join(args.log_dir, f"profile_{tag}")
    shutil.rmtree(trace_dir, ignore_errors=True)
    os.makedirs(trace_dir)
    bs = max(args.batch_sizes)
    cmd = bench_command(args.model_path, url, batch_sizes=[bs], input_len=args.input_len,
                        output_len=args.output_len,
                        result_file=os.path.join(trace_dir, "bench.jsonl"),
                        profile_dir=trace_dir, profile_steps=args.profile_steps)
    log(f"{tag}: profile: {shlex.join(cmd)}")
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=min(args.bench_timeout, 180.0))
        rc, tail = proc.returncode, proc.stdout[-1500:]
    except subprocess.TimeoutExpired as e:  # keep the timed results of this arm
        rc, tail = None, f"profile run timed out after {e.timeout}s"
    summary = summarize_profile(trace_dir, args.profile_steps)
    summary.update(batch=bs, command=shlex.join(cmd), rc=rc)
    if rc != 0 or not summary["kernels"]:
        summary["output_tail"] = tail
    log(f"{tag}: profile: {summary['gpu_us_per_step']} us of GPU kernels per step over "
        f"{len(summary['trace_files'])} trace file(s)")
    if not args.keep_traces:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return summary


# what a partial keeps of each run when --repeats > 1
REPEAT_KEYS = ("batch", "output_tok_s", "itl_ms", "ttft_s", "step_ms", "accept_len")


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per batch size (in the order of the first run), the row of the run
    with the median output throughput, the lower middle one for an even
    count: a whole row of one measurement, so its ITL, TTFT and step agree."""
    order, by_batch = [], {}
    for rows in runs:
        for r in rows:
            if r["batch"] not in by_batch:
                order.append(r["batch"])
            by_batch.setdefault(r["batch"], []).append(r)
    out = []
    for bs in order:
        ranked = sorted(by_batch[bs], key=lambda r: r["output_tok_s"])
        out.append(ranked[(len(ranked) - 1) // 2])
    return out


def run_arm(args, arm: str, family: str, env: dict) -> dict:
    arm, decode_route = split_arm(arm, args.decode_route)
    label = arm_label(arm, args.checkpoint_dtype, decode_route)
    url = f"http://127.0.0.1:{args.port}"
    tag = f"{args.model}_{label}"
    os.makedirs(args.log_dir, exist_ok=True)
    result_file = os.path.join(args.log_dir, f"bench_{tag}.jsonl")
    # fp32 activations: SGLang's own --dtype, before --server-args (which may
    # still override any of these)
    extra = (list(FP32_ACTIVATION_ARGS) if args.fp32_activations else []) + shlex.split(args.server_args)
    launch = server_command(args.model_path, family, arm, port=args.port,
                            buffer_len=args.buffer_len, checkpoint_dtype=args.checkpoint_dtype,
                            decode_route=decode_route, extra_args=extra,
                            radix_cache=args.radix_cache)
    bench, bench_again = (bench_command(args.model_path, url, batch_sizes=args.batch_sizes,
                                        input_len=args.input_len, output_len=args.output_len,
                                        result_file=result_file, skip_warmup=again)
                          for again in (False, True))  # repeats after the first: warm already
    record = {"kind": "e2e_partial", "model": args.model, "family": family, "arm": label,
              "checkpoint_dtype": args.checkpoint_dtype if arm == REPLAY_ARM else None,
              "buffer_len": args.buffer_len if arm in (REPLAY_ARM, SGLANG_REPLAY_ARM) else None,
              "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]),
              "launch_command": shlex.join(launch), "bench_command": shlex.join(bench),
              "dummy_init": args.dummy_init,
              "activations": "float32" if args.fp32_activations else "model",
              **env, "rows": [], "parity": None, "error": None}
    log(f"{tag}: launch: {shlex.join(launch)}")
    runs = []  # each measured bench run's rows, kept if a later step fails
    warmups = []  # the unmeasured full-length runs before them (figures kept apart)
    try:
        server_env = dict(os.environ)
        server_env.pop(DUMMY_INIT_ENV, None)
        if args.dummy_init != "sglang":
            server_env[DUMMY_INIT_ENV] = args.dummy_init
        server_env.pop(NATIVE_FP32_OPS_ENV, None)
        if args.fp32_activations:
            server_env[NATIVE_FP32_OPS_ENV] = "1"
            # SGLang's conv-state dtype (srt/configs/mamba_utils.py:68, default
            # bf16): the Triton causal_conv1d does not compile for fp32
            # activations against a bf16 conv state
            server_env[MAMBA_CONV_DTYPE_ENV] = "float32"
        with Server(launch, os.path.join(args.log_dir, f"server_{tag}.log"),
                    env=server_env) as server:
            record["healthy_after_s"] = round(server.wait_healthy(url, args.health_timeout), 1)
            log(f"{tag}: healthy after {record['healthy_after_s']}s")
            record["openai_check"] = check_openai(url)
            log(f"{tag}: chat + completions answered")
            for i in range(args.warmup_runs + args.repeats):
                if os.path.exists(result_file):
                    os.remove(result_file)  # bench_one_batch_server appends
                warming = i < args.warmup_runs
                n = i - args.warmup_runs
                run_tag = (f"{tag} (warm-up {i + 1}/{args.warmup_runs})" if warming else
                           tag if args.repeats == 1 else f"{tag} ({n + 1}/{args.repeats})")
                log_start = len(server.log_text())
                cmd = bench_again if i else bench
                log(f"{run_tag}: bench: {shlex.join(cmd)}")
                with open(os.path.join(args.log_dir, f"bench_{tag}.log"), "a" if i else "w") as bl:
                    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, timeout=args.bench_timeout)
                    bl.write(proc.stdout)
                log(f"{run_tag}: bench rc {proc.returncode}")
                decode_lines = parse_decode_lines(server.log_text()[log_start:])
                if os.path.exists(result_file):
                    with open(result_file) as f:
                        cases = parse_bench_results(f.read())
                else:
                    cases = parse_bench_stdout(proc.stdout)
                rows = []
                for bs in args.batch_sizes:
                    if bs not in cases:
                        continue
                    step = steady_step_ms(decode_lines, bs)
                    graphs = {d["cuda_graph"] for d in decode_lines if d["running"] == bs}
                    accept = steady_step_ms(decode_lines, bs, key="accept_len")
                    rows.append({"batch": bs, **cases[bs],
                                 "step_ms": None if step is None else round(step, 3),
                                 # False if any decode step at this batch ran eagerly
                                 "cuda_graph": graphs == {True} if graphs else None,
                                 **({} if accept is None else {"accept_len": accept})})
                    log(f"{run_tag}: batch {bs}: {cases[bs]['output_tok_s']:.1f} tok/s, "
                        f"ITL {cases[bs]['itl_ms']:.2f} ms, step {step} ms"
                        + ("" if accept is None else f", accept len {accept:.2f}"))
                (warmups if warming else runs).append(rows)
                if proc.returncode != 0 or len(rows) != len(args.batch_sizes):
                    record["error"] = (f"bench rc {proc.returncode}, batches measured "
                                       f"{[r['batch'] for r in rows]}: {proc.stdout[-1500:]}")
                    break
            keep_runs(record, runs, args.repeats, warmups)
            if args.parity:
                prompts = parity_prompts(args.parity_prompts, args.input_len)
                log(f"{tag}: greedy dump, {len(prompts)} prompts x {args.parity_tokens} tokens")
                record["parity"] = greedy_dump(prompts, generate_greedy(
                    url, prompts, args.parity_tokens, args.bench_timeout))
                if args.parity_floor_group:
                    record["parity_floor"] = parity_floor_dump(args, url, tag, prompts)
                if args.radix_check:
                    record["radix_check"] = radix_check(args, url, tag, server, prompts,
                                                        record["parity"]["outputs"])
            if args.profile_steps:
                record["profile"] = profile_arm(args, url, tag)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the partial records what failed
        record["error"] = f"{type(e).__name__}: {e}"
        log(f"{tag}: FAILED: {record['error']}")
        if (runs or warmups) and not record["rows"]:  # e.g. a call's time limit cut a run
            keep_runs(record, runs, args.repeats, warmups)
    return record


def keep_runs(record: dict, runs: list, repeats: int, warmups: list = ()):
    """The record's rows from the median of the measured runs made (all of
    them, or those completed before a failure), every run's figures, and
    apart from them the warm-up runs' (never in the rows)."""
    def figures(some_runs):
        return [[{k: r.get(k) for k in REPEAT_KEYS if k in r} for r in rows] for rows in some_runs]

    record["rows"] = median_rows(runs)
    if repeats > 1:
        record["repeats"] = figures(runs)
    if warmups:
        record["warmup_runs"] = figures(warmups)


def cmd_run(args) -> int:
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    args.model_path = os.path.abspath(os.path.join(args.model_root, f"{args.model}-dummy"))
    if not os.path.exists(os.path.join(args.model_path, "config.json")):
        sys.exit(f"{args.model_path}/config.json missing: run scripts/make_model.py first")
    if args.parity_floor_group and not args.parity:
        sys.exit("--parity-floor-group needs --parity")
    if args.radix_check and not (args.parity and args.radix_cache):
        sys.exit("--radix-check needs --parity and --radix-cache")
    if args.repeats < 1:
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_runs < 0:
        sys.exit(f"--warmup-runs must be >= 0, got {args.warmup_runs}")
    if args.parity_floor_group < 0:
        sys.exit(f"--parity-floor-group must be >= 0, got {args.parity_floor_group}")
    family = model_family(args.model_path)
    arms = args.arms or arms_for(family)
    for arm in arms:  # fail fast on a bad arm (ValueError)
        base, route = split_arm(arm, args.decode_route)
        arm_flags(family, base, args.buffer_len, args.checkpoint_dtype, route)
    env = environment()
    os.makedirs(args.partial_dir, exist_ok=True)
    failed = 0
    for arm in arms:
        record = run_arm(args, arm, family, env)
        path = partial_path(args.partial_dir, args.model, record["arm"])
        with open(path, "w") as f:
            # compact: the greedy dumps are 64 x 128 ids and logprobs
            json.dump(record, f, separators=(",", ":"))
        log(f"wrote {path}" + (f" (error: {record['error'][:200]})" if record["error"] else ""))
        failed += record["error"] is not None
        if record["error"] and record["error"].startswith("SystemExit"):
            break  # SIGTERM (the device time limit): no further arms
    return 1 if failed else 0


# --- merge ---------------------------------------------------------------------

def load_partials(partial_dirs: list[str]) -> list[dict]:
    """Every e2e_partial record in the folders (``e2e_*.json``, or
    ``e2e_*.json.gz`` as archived runs with greedy dumps are kept). Folders
    can hold runs of different calls (a parity's stock arm kept from an
    earlier call): one (model, arm) found twice is refused, not silently
    overwritten."""
    import gzip

    records, seen = [], {}
    for partial_dir in partial_dirs:
        for name in sorted(os.listdir(partial_dir)):
            if name.startswith("e2e_") and name.endswith((".json", ".json.gz")):
                path = os.path.join(partial_dir, name)
                with (gzip.open if name.endswith(".gz") else open)(path, "rt") as f:
                    rec = json.load(f)
                if rec.get("kind") != "e2e_partial":
                    continue
                key = (rec["model"], rec["arm"])
                if key in seen:
                    sys.exit(f"--partial-dir: {key[0]} arm {key[1]} is in both {seen[key]} "
                             f"and {path}; keep one")
                seen[key] = path
                records.append(rec)
    return records


def merge_rows(records: list[dict]) -> list[dict]:
    """One row per (model, batch): the fastest stock arm measured is `stock`;
    every stock arm and SGLang's built-in replay also get their own columns;
    replayssm variants (non-default checkpoint dtype or decode route) get
    replay_<variant>_* keys."""
    by_key: dict[tuple, dict[str, dict]] = {}
    family = {}
    for rec in records:
        family[rec["model"]] = rec["family"]
        for r in rec["rows"]:
            key = (rec["model"], r["batch"], r["input_len"], r["output_len"])
            by_key.setdefault(key, {})[rec["arm"]] = r
    rows = []
    for (model, batch, il, ol), arms in sorted(by_key.items()):
        stock = {a[len("stock-"):]: r for a, r in arms.items() if a.startswith("stock-")}
        replay = arms.get(REPLAY_ARM)
        row = {"model": model, "batch": batch, "input_len": il, "output_len": ol}
        best = max(stock, key=lambda b: stock[b]["output_tok_s"]) if stock else None
        row["stock_backend"] = best
        row["stock_tok_s"] = stock[best]["output_tok_s"] if best else None
        row["replay_tok_s"] = replay["output_tok_s"] if replay else None
        row["speedup"] = _ratio(row["replay_tok_s"], row["stock_tok_s"])
        row["itl_ms"] = replay["itl_ms"] if replay else None
        row["stock_itl_ms"] = stock[best]["itl_ms"] if best else None
        row["step_ms"] = replay["step_ms"] if replay else None
        row["stock_step_ms"] = stock[best]["step_ms"] if best else None
        if any("accept_len" in r for r in arms.values()):  # speculative decoding
            row["accept_len"] = replay.get("accept_len") if replay else None
            row["stock_accept_len"] = stock[best].get("accept_len") if best else None
        for b, r in sorted(stock.items()):
            row[f"stock_{b}_tok_s"] = r["output_tok_s"]
            row[f"speedup_vs_{b}"] = _ratio(row["replay_tok_s"], r["output_tok_s"])
        if family[model] == "gdn":
            sr = arms.get(SGLANG_REPLAY_ARM)
            row["sglang_replay_tok_s"] = sr["output_tok_s"] if sr else None
            row["speedup_vs_sglang_replay"] = _ratio(row["replay_tok_s"], row["sglang_replay_tok_s"])
        for a, r in sorted(arms.items()):
            if a.startswith(REPLAY_ARM + "-"):  # e.g. replayssm-bfloat16, replayssm-split
                variant = a[len(REPLAY_ARM) + 1:].replace("-", "_")
                row[f"replay_{variant}_tok_s"] = r["output_tok_s"]
                row[f"speedup_{variant}"] = _ratio(r["output_tok_s"], row["stock_tok_s"])
        rows.append(row)
    return rows


def _ratio(a, b):
    return round(a / b, 4) if a and b else None


def merge_parity(records: list[dict]) -> list[dict]:
    """Every other dump of a model against its reference stock dump
    (stock-triton preferred: SGLang's default backend), same prompts and
    server flags. ReplaySSM arms are the claim; another stock arm (or
    SGLang's built-in replay) against the reference is the noise floor: two
    stock kernels that round fp32 differently, whose bf16 activations then
    differ by an ulp here and there, diverge on a random-weight model too."""
    entries = []
    for model in sorted({r["model"] for r in records}):
        dumps = {r["arm"]: r for r in records if r["model"] == model and r.get("parity")}
        stock_arms = sorted((a for a in dumps if a.startswith("stock-")),
                            key=lambda a: (a != "stock-triton", a))
        ref = stock_arms[0] if stock_arms else None
        for arm in sorted(a for a in dumps if ref and a != ref):
            entry = compare_parity(dumps[ref]["parity"], dumps[arm]["parity"], model=model,
                                   checkpoint_dtype=dumps[arm].get("checkpoint_dtype"))
            entry["arm"] = arm
            entry["stock_arm"] = ref
            entry["noise_floor"] = not (arm == REPLAY_ARM or arm.startswith(REPLAY_ARM + "-"))
            entry["dummy_init"] = dumps[arm].get("dummy_init", "sglang")
            entry["activations"] = dumps[arm].get("activations", "model")
            entries.append(entry)
        for arm in sorted(dumps):
            floor = dumps[arm].get("parity_floor")
            if not floor:
                continue
            # the arm against itself at another batch composition
            entry = compare_parity(dumps[arm]["parity"], floor, model=model,
                                   checkpoint_dtype=dumps[arm].get("checkpoint_dtype"))
            entry.update(arm=f"{arm} in groups of {floor['group']}", stock_arm=f"{arm} batched",
                         noise_floor=True, dummy_init=dumps[arm].get("dummy_init", "sglang"),
                         activations=dumps[arm].get("activations", "model"))
            entries.append(entry)
        for arm in sorted(dumps):
            radix = dumps[arm].get("radix_check")
            if not radix:
                continue
            # the arm continuing cached requests against itself from scratch
            entry = compare_parity(radix["miss"], radix["hit"], model=model,
                                   checkpoint_dtype=dumps[arm].get("checkpoint_dtype"))
            entry.update(arm=f"{arm} radix hit ({radix['hit']['cached_tokens']} tokens cached)",
                         stock_arm=f"{arm} from scratch ({radix['miss']['cached_tokens']})",
                         noise_floor=not (arm == REPLAY_ARM or arm.startswith(REPLAY_ARM + "-")),
                         dummy_init=dumps[arm].get("dummy_init", "sglang"),
                         activations=dumps[arm].get("activations", "model"))
            entries.append(entry)
    return entries


def merged_document(records: list[dict], command: str) -> dict:
    commits = sorted({r["git_commit"] for r in records})
    gpus = sorted({r["gpu"] for r in records})
    return {
        "command": command,
        "git_commit": commits[0] if len(commits) == 1 else ",".join(commits),
        "gpu": gpus[0] if len(gpus) == 1 else ",".join(gpus),
        "versions": records[0]["versions"] if records else {},
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "runs": [{k: r.get(k) for k in ("model", "arm", "command", "launch_command",
                                        "bench_command", "git_commit", "created",
                                        "healthy_after_s", "activations", "dummy_init",
                                        "error")} for r in records],
        "rows": merge_rows(records),
        "greedy_parity": merge_parity(records),
    }


def _fmt(v, nd=1):
    if v is None:
        return "–"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _fmt_small(v):
    """A logprob difference: 4 decimals, or 2 significant digits below 1e-3
    (an fp32-activation parity's 3e-5 is not 0.0000)."""
    if isinstance(v, float) and 0 < abs(v) < 1e-3:
        return f"{v:.2g}"
    return _fmt(v, 4)


def _short_commits(commits: str) -> str:
    """'sha1,sha2' (one per run, see merge) -> 'sha1[:12], sha2[:12]'."""
    return ", ".join(c[:12] for c in commits.split(","))


def markdown(doc: dict) -> str:
    lines = ["# End-to-end decode: ReplaySSM vs stock SGLang (served, dummy weights)", "",
             f"`{doc['command']}` of runs at {_short_commits(doc['git_commit'])}, {doc['gpu']}, "
             f"{', '.join(f'{k} {v}' for k, v in doc['versions'].items())}, {doc['created']}.",
             "Output tok/s from `sglang.bench_one_batch_server` (random-ids, one batch); "
             "step = median steady decode step from the server log. "
             "Speedup = ReplaySSM tok/s / fastest stock tok/s.", ""]
    fp32 = sorted({r["model"] for r in doc["runs"] if r.get("activations") == "float32"})
    if fp32:
        lines += [f"Runs with float32 activations ({', '.join(fp32)}) serve eagerly, with "
                  "PyTorch paths for several ops (--fp32-activations): their tok/s show that "
                  "the server answered, they are not speed figures.", ""]
    for model in sorted({r["model"] for r in doc["rows"]}):
        rows = [r for r in doc["rows"] if r["model"] == model]
        extra = sorted({k for r in rows for k in r
                        if (k.startswith("stock_") and k.endswith("_tok_s") and k != "stock_tok_s")
                        or k == "sglang_replay_tok_s"
                        or (k.startswith("replay_") and k.endswith("_tok_s") and k != "replay_tok_s")})
        spec = any("accept_len" in r for r in rows)
        head = (["batch", "in/out", "stock", "stock tok/s", "ReplaySSM tok/s", "speedup",
                 "ITL ms (stock)", "step ms (stock)"]
                + (["accept len (stock)"] if spec else []) + [k[:-len("_tok_s")] for k in extra])
        lines += [f"## {model}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        for r in rows:
            cells = [str(r["batch"]), f"{r['input_len']}/{r['output_len']}",
                     r["stock_backend"] or "–", _fmt(r["stock_tok_s"]), _fmt(r["replay_tok_s"]),
                     _fmt(r["speedup"], 3) + ("x" if r["speedup"] else ""),
                     f"{_fmt(r['itl_ms'], 2)} ({_fmt(r['stock_itl_ms'], 2)})",
                     f"{_fmt(r['step_ms'], 2)} ({_fmt(r['stock_step_ms'], 2)})"]
            if spec:
                cells.append(f"{_fmt(r.get('accept_len'), 2)} ({_fmt(r.get('stock_accept_len'), 2)})")
            cells += [_fmt(r.get(k)) for k in extra]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if doc["greedy_parity"]:
        lines += ["## Greedy parity (against the reference stock arm, temperature 0)", "",
                  "Rows marked *noise floor* compare two stock configurations, or an arm with "
                  "itself at another batch composition: the divergence a different fp32 "
                  "rounding order alone causes on this model.", "",
                  "| model | arm | checkpoint dtype | vs | dummy init | activations | "
                  "prompts x tokens | identical | median tokens before divergence | "
                  "first divergence | max logprob diff before it | informative |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in doc["greedy_parity"]:
            fd = p["first_divergence"]
            fd_text = "none" if fd is None else (
                f"prompt {fd['prompt']} at token {fd['position']}, logprob gap "
                f"{_fmt_small(fd['logprob_gap'])}")
            arm = p.get("arm", REPLAY_ARM) + (" (noise floor)" if p.get("noise_floor") else "")
            lines.append(f"| {p['model']} | {arm} | {p['checkpoint_dtype'] or '–'} | "
                         f"{p['stock_arm']} | "
                         f"{p.get('dummy_init', 'sglang')} | {p.get('activations', 'model')} | "
                         f"{p['prompts']} x {p['tokens']} | "
                         f"{p['identical_prompts']} | {_fmt(p.get('median_agreeing_tokens'))} | "
                         f"{fd_text} | "
                         f"{_fmt_small(p.get('max_logprob_diff_before_divergence'))} | "
                         f"{'yes' if p.get('informative', True) else 'no'} |")
        lines.append("")
        lines += [f"- {p['model']}: {p['note']}" for p in doc["greedy_parity"] if p.get("note")]
        lines.append("")
    failed = [r for r in doc["runs"] if r["error"]]
    if failed:
        lines += ["Errors:", ""] + [f"- {r['model']} {r['arm']}: {r['error'][:300]}" for r in failed]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r["model"] for r in doc["rows"]})
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in doc["rows"] if r["model"] == model]
        series = sorted({k for r in rows for k in r if k.endswith("_tok_s") and k != "stock_tok_s"})
        width = 0.8 / max(1, len(series))
        for i, key in enumerate(series):
            xs = [j + i * width for j in range(len(rows))]
            ax.bar(xs, [r.get(key) or 0 for r in rows], width, label=key[:-len("_tok_s")])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
        ax.set_xticklabels([f"bs {r['batch']}" for r in rows])
        ax.set_title(model)
        ax.set_ylabel("output tok/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def cmd_merge(args) -> int:
    records = load_partials(args.partial_dir)
    if not records:
        sys.exit(f"no e2e_*.json partials in {' '.join(args.partial_dir)}")
    doc = merged_document(records, " ".join(["python"] + [shlex.quote(a) for a in sys.argv]))
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, args.name)
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(doc))
    plotted = plot(doc, base + ".png")
    print(f"wrote {base}.json, {base}.md" + (", .png" if plotted else " (no matplotlib: no .png)"))
    print(markdown(doc))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="serve one model, arm by arm, benchmark, write partial JSONs")
    run.add_argument("--model", required=True,
                     help="model name as in scripts/make_model.py, e.g. nemotron-h-8b (dir MODEL_ROOT/<name>-dummy)")
    run.add_argument("--model-root", default=os.path.join(REPO, ".model"))
    run.add_argument("--arms", nargs="+", metavar="ARM",
                     help="arms to run in turn (default: all for the model's family: "
                          "mamba2 stock-triton stock-flashinfer replayssm; "
                          "gdn stock-triton sglang-replay replayssm); replayssm:ROUTE "
                          "(ROUTE = auto, output_only, split) runs that decode route, so "
                          "both routes fit one invocation")
    run.add_argument("--buffer-len", type=int, default=16,
                     help="ReplaySSM buffer length (also SGLang's --linear-replayssm-cache-len)")
    run.add_argument("--checkpoint-dtype", choices=CHECKPOINT_DTYPES, default="auto",
                     help="--replayssm-checkpoint-dtype of the replayssm arm")
    run.add_argument("--decode-route", choices=DECODE_ROUTES, default="auto",
                     help="--replayssm-decode-route of the replayssm arm (non-auto: its own "
                          "arm label, e.g. replayssm-split)")
    run.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    run.add_argument("--repeats", type=int, default=1,
                     help="run bench_one_batch_server this many times against each server; "
                          "rows keep the run with the median output throughput per batch, "
                          "the partial's `repeats` every run's figures (a one-batch measure "
                          "of a model with 2-3 ms steps moves by 10-20%% between runs); "
                          "runs after the first pass --skip-warmup")
    run.add_argument("--warmup-runs", type=int, default=1,
                     help="full-length bench_one_batch_server runs before the measured "
                          "--repeats, left out of the rows (their figures are kept as "
                          "`warmup_runs`): bench_one_batch_server's own warm-up decodes 16 "
                          "tokens, and the first full run at batch 256 came out 1.6-15%% "
                          "below the mean of the later ones in 12 of 16 arms measured at 2-3 "
                          "runs (H100, 2026-12-06/07) while the server's decode steps were the "
                          "same")
    run.add_argument("--input-len", type=int, default=512)
    run.add_argument("--output-len", type=int, default=256)
    run.add_argument("--parity", action="store_true",
                     help="also dump greedy tokens + logprobs (for greedy_parity in merge)")
    run.add_argument("--dummy-init", choices=("sglang", *DUMMY_INITS), default="sglang",
                     help="scaled: dummy weights at trained-model scale in every arm "
                          "(sglang_replayssm.dummy_init; needed for a greedy parity that "
                          "depends on the SSM layers); echo: the same with the LM head = "
                          "the scaled embedding, so greedy output repeats the last prompt "
                          "token (speculative decoding with drafts accepted; no parity value)")
    run.add_argument("--fp32-activations", action="store_true",
                     help="serve every arm with %s, fp32 conv states "
                          "(%s), SGLang's norm, activation, rotary and "
                          "MoE ops on their PyTorch path for fp32 input (sgl-kernel's have no "
                          "fp32; the triton MoE and attention round through fp16/tf32), the "
                          "GDN chunk prefill on bf16 copies of q/k/v (test knob %s=1): a "
                          "greedy parity without low-precision rounding amplifying the SSM's "
                          "fp32 rounding order. Eager, so no speed figure"
                          % (" ".join(FP32_ACTIVATION_ARGS), MAMBA_CONV_DTYPE_ENV,
                             NATIVE_FP32_OPS_ENV))
    run.add_argument("--parity-prompts", type=int, default=64)
    run.add_argument("--parity-tokens", type=int, default=128)
    run.add_argument("--parity-floor-group", type=int, default=0, metavar="N",
                     help="also dump the parity prompts in consecutive groups of N (0: off): "
                          "each arm against itself at another batch size, the noise floor "
                          "of greedy parity on this model")
    run.add_argument("--radix-cache", action="store_true",
                     help="serve every arm with the radix cache (drops --disable-radix-cache; "
                          "ReplaySSM then runs --mamba-radix-cache-strategy no_buffer)")
    run.add_argument("--radix-check", action="store_true",
                     help="with --parity and --radix-cache: second turns (prompt + greedy "
                          "output + a random suffix) dumped against the cached first turns "
                          "and again after /flush_cache; merge compares the two per arm")
    run.add_argument("--radix-suffix-len", type=int, default=32)
    run.add_argument("--profile-steps", type=int, default=0,
                     help="after the timed runs, profile the first N forward steps of one "
                          "more batch (the largest) with the torch profiler and store the "
                          "per-kernel GPU time in the partial (0: off). The first "
                          "batch*input_len/8192 steps are prefill chunks; add more than "
                          "the buffer length to include a flush step")
    run.add_argument("--keep-traces", action="store_true",
                     help="keep the raw profiler traces in the log dir")
    run.add_argument("--server-args", default="",
                     help="extra launch_server flags for every arm, one quoted string")
    run.add_argument("--port", type=int, default=30000)
    run.add_argument("--health-timeout", type=float, default=420.0, help="seconds")
    run.add_argument("--bench-timeout", type=float, default=300.0, help="seconds")
    run.add_argument("--partial-dir", default=DEFAULT_PARTIAL_DIR)
    run.add_argument("--log-dir", default=os.environ.get("OUT") or os.path.join(REPO, "gpu-results"),
                     help="server/bench logs (default $OUT, else gpu-results/)")
    merge = sub.add_parser("merge", help="partials -> benchmarks/results/e2e_decode.{json,md,png} "
                                         "(--name)")
    merge.add_argument("--partial-dir", nargs="+", default=[DEFAULT_PARTIAL_DIR], metavar="DIR",
                       help="one or more folders of partials (runs of several calls)")
    merge.add_argument("--out-dir", default=DEFAULT_RESULTS_DIR)
    merge.add_argument("--name", default="e2e_decode",
                       help="output base name, e.g. e2e_decode_h100 for a run on another GPU "
                            "(keep one GPU per merged file: its ratios are same-GPU ones)")
    args = ap.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_merge(args)


if __name__ == "__main__":
    sys.exit(main())
