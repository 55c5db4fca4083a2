"""scripts/bench_serving.py, the parts that need no GPU: command lines per arm,
parsing of bench_one_batch_server results and of the server log's decode
lines, merging partials (fastest stock arm), greedy-parity comparison, and
the JSON/Markdown written."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_serving as bs  # noqa: E402
import make_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    names = ["nemotron-h-8b", "qwen3-next-80b", "falcon-h1-4layer", "qwen3.5-4b"]
    make_model.write_model_configs(str(root), names)
    return {n: make_model.model_dir(str(root), n) for n in names}


def _flag_value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_families_and_arms(models):
    assert bs.model_family(models["nemotron-h-8b"]) == "mamba2"
    assert bs.model_family(models["qwen3-next-80b"]) == "gdn"
    assert bs.model_family(models["qwen3.5-4b"]) == "gdn"
    assert bs.arms_for("mamba2") == ["stock-triton", "stock-flashinfer", "replayssm"]
    assert bs.arms_for("gdn") == ["stock-triton", "sglang-replay", "replayssm"]
    # the noise-floor arm runs only when named
    assert bs.arm_flags("gdn", "stock-flashinfer", 16, "auto") == [
        "--linear-attn-decode-backend", "flashinfer"]
    with pytest.raises(ValueError):
        bs.arm_flags("mamba2", "sglang-replay", 16, "auto")


def test_server_commands_differ_only_in_the_arm_flags(models):
    path = models["nemotron-h-8b"]
    cmds = {arm: bs.server_command(path, "mamba2", arm, port=30000, python="python3")
            for arm in bs.arms_for("mamba2")}
    common = cmds["stock-triton"][:-2]
    assert cmds["stock-triton"][-2:] == ["--mamba-backend", "triton"]
    assert cmds["stock-flashinfer"] == common + ["--mamba-backend", "flashinfer"]
    assert cmds["replayssm"] == common + ["--enable-replayssm", "--replayssm-buffer-len", "16",
                                          "--replayssm-checkpoint-dtype", "auto"]
    for flag, value in [("--attention-backend", "flashinfer"), ("--load-format", "dummy"),
                        ("--max-running-requests", "256"), ("--cuda-graph-max-bs-decode", "256"),
                        ("--model-path", path)]:
        assert _flag_value(common, flag) == value
    assert "--disable-radix-cache" in common and "--disable-flashinfer-autotune" in common
    assert common[:3] == ["python3", "-m", "sglang.launch_server"]


def test_architecture_flags_go_to_every_arm(models):
    """FalconH1 serves without SGLang's prefill CUDA graph (it crashes stock
    FalconH1 on the H200), in every arm alike; other models keep it."""
    path = models["falcon-h1-4layer"]
    for arm in bs.arms_for("mamba2"):
        assert "--disable-prefill-cuda-graph" in bs.server_command(path, "mamba2", arm, port=1)
    assert "--disable-prefill-cuda-graph" not in bs.server_command(
        models["nemotron-h-8b"], "mamba2", "stock-triton", port=1)


def test_gdn_commands_and_extra_args(models):
    path = models["qwen3-next-80b"]
    extra = ["--disable-overlap-schedule"]
    sg = bs.server_command(path, "gdn", "sglang-replay", port=1, buffer_len=8, extra_args=extra)
    rp = bs.server_command(path, "gdn", "replayssm", port=1, buffer_len=8,
                           checkpoint_dtype="bfloat16", extra_args=extra)
    st = bs.server_command(path, "gdn", "stock-triton", port=1, extra_args=extra)
    assert _flag_value(st, "--attention-backend") == "triton"
    assert _flag_value(st, "--moe-runner-backend") == "triton"
    assert _flag_value(st, "--linear-attn-decode-backend") == "triton"
    assert sg[-4:] == ["--enable-linear-replayssm", "--linear-replayssm-cache-len", "8",
                       "--disable-overlap-schedule"]
    assert _flag_value(rp, "--replayssm-checkpoint-dtype") == "bfloat16"
    assert rp[-1] == st[-1] == "--disable-overlap-schedule"
    assert bs.arm_label("replayssm", "bfloat16") == "replayssm-bfloat16"
    assert bs.arm_label("replayssm", "auto") == "replayssm"
    assert bs.arm_label("stock-triton", "bfloat16") == "stock-triton"


def test_bench_command():
    cmd = bs.bench_command("/m", "http://127.0.0.1:30000", batch_sizes=[1, 64, 256],
                           input_len=512, output_len=256, result_file="/o/r.jsonl", python="py")
    assert cmd[:3] == ["py", "-m", "sglang.bench_one_batch_server"]
    i = cmd.index("--batch-size")
    assert cmd[i + 1:i + 4] == ["1", "64", "256"]
    assert _flag_value(cmd, "--dataset-name") == "random-ids"
    assert _flag_value(cmd, "--base-url") == "http://127.0.0.1:30000"
    assert _flag_value(cmd, "--result-filename") == "/o/r.jsonl"
    assert "--skip-warmup" not in cmd
    again = bs.bench_command("/m", "http://127.0.0.1:30000", batch_sizes=[1, 64, 256],
                             input_len=512, output_len=256, result_file="/o/r.jsonl",
                             python="py", skip_warmup=True)
    assert again == cmd + ["--skip-warmup"]


# BenchOneCaseResult.dump_to_jsonl lines (sglang/benchmark/one_batch_server.py)
BENCH_JSONL = """\
{"run_name": "default", "batch_size": 1, "input_len": 512, "output_len": 256, "latency": 1.2354, "input_throughput": 27710.11, "output_throughput": 216.3, "overall_throughput": 621.69, "last_ttft": 0.0185, "last_gen_throughput": 215.8, "acc_length": -1, "cache_hit_rate": 0.0}
{"run_name": "default", "batch_size": 64, "input_len": 512, "output_len": 256, "latency": 2.8051, "input_throughput": 99800.5, "output_throughput": 6599.0, "overall_throughput": 17521.3, "last_ttft": 0.3224, "last_gen_throughput": 6580.1, "acc_length": -1, "cache_hit_rate": 0.0}
{"run_name": "default", "batch_size": 256, "input_len": 512, "output_len": 256, "latency": 9.0012, "input_throughput": 101000.0, "output_throughput": 8876.0, "overall_throughput": 21843.3, "last_ttft": 1.6180, "last_gen_throughput": 8840.2, "acc_length": -1, "cache_hit_rate": 0.0}
"""

# what run_one_case prints: the warm-up case (1024/16) first, then the measured one
BENCH_STDOUT = """\
======== Warmup Begin ========
Warmup with batch_size=[64]
batch size: 64
input_len: 1024
output_len: 16
latency: 1.02 s
input throughput: 80000.00 tok/s
output throughput: 1500.00 tok/s
last_ttft: 0.80 s
last generation throughput: 1200.00 tok/s
======== Warmup End   ========

batch size: 64
input_len: 512
output_len: 256
latency: 2.81 s
input throughput: 99800.50 tok/s
output throughput: 6599.00 tok/s
last_ttft: 0.32 s
last generation throughput: 6580.10 tok/s
"""


def test_parse_bench_results():
    cases = bs.parse_bench_results(BENCH_JSONL)
    assert sorted(cases) == [1, 64, 256]
    assert cases[256]["output_tok_s"] == 8876.0
    assert cases[256]["itl_ms"] == pytest.approx(1000 * 256 / 8876.0)  # 28.84, as the report
    assert cases[1]["itl_ms"] == pytest.approx(4.623, abs=1e-3)
    assert cases[64]["ttft_s"] == 0.3224 and cases[64]["input_len"] == 512


def test_parse_bench_stdout_keeps_the_measured_case():
    cases = bs.parse_bench_stdout(BENCH_STDOUT)
    assert list(cases) == [64]
    assert cases[64]["input_len"] == 512 and cases[64]["output_tok_s"] == 6599.0
    assert cases[64]["itl_ms"] == pytest.approx(1000 * 64 / 6599.0)


def _decode_line(running, tps, queue=0, graph="True", accept=None):
    # metrics_reporter.report_decode_stats + pool_stats_observer (hybrid SSM parts)
    spec = "" if accept is None else f"accept len: {accept:.2f}, accept rate: 0.50, "
    return (f"[2026-12-02 10:00:00] Decode batch, #running-req: {running}, #full token: 1000, "
            f"full token usage: 0.01, mamba num: {running}, mamba usage: 0.50, {spec}"
            f"cuda graph: {graph}, gen throughput (token/s): {tps:.2f}, #queue-req: {queue}, ")


def test_speculative_decode_lines_give_the_verify_step():
    """With speculative decoding a step gives each request accept-len tokens:
    the step is running x accept len / throughput, and the accept length is
    kept per batch (median of the steady lines)."""
    log = "\n".join([_decode_line(16, 100.0, accept=1.0),  # first line: dropped
                     _decode_line(16, 3200.0, accept=4.0),   # 20 ms
                     _decode_line(16, 4000.0, accept=6.0),   # 24 ms
                     _decode_line(16, 3600.0, accept=5.0)])  # 22.2 ms
    lines = bs.parse_decode_lines(log)
    assert [r["accept_len"] for r in lines] == [1.0, 4.0, 6.0, 5.0]
    assert lines[1]["step_ms"] == pytest.approx(1000 * 16 * 4 / 3200)
    assert bs.steady_step_ms(lines, 16) == pytest.approx(1000 * 16 * 5 / 3600)
    assert bs.steady_step_ms(lines, 16, key="accept_len") == 5.0
    assert bs.parse_decode_lines(_decode_line(16, 3200.0))[0]["accept_len"] is None


def test_parse_decode_lines_and_steady_step():
    log = "\n".join([
        "[2026-12-02 10:00:00] Prefill batch, #new-seq: 64, #new-token: 32768, ...",
        _decode_line(1, 30.00),      # first line of a bs-1 run: includes idle time, dropped
        _decode_line(1, 216.00),     # 4.630 ms
        _decode_line(1, 215.00),     # 4.651 ms
        _decode_line(1, 214.00),     # 4.673 ms
        _decode_line(64, 1000.00),   # dropped (first)
        _decode_line(64, 6400.00),   # 10.0 ms
        _decode_line(64, 8000.00),   # 8.0 ms
        _decode_line(64, 6000.00, queue=3),  # requests waiting: not steady
        "[2026-12-02 10:00:09 TP0] Decode batch [123], #running-req: 256, #token: 5, "
        "token usage: 0.10, cuda graph: True, gen throughput (token/s): 9000.00, #queue-req: 0, ",
        _decode_line(256, 9360.00),  # 27.35 ms
    ])
    lines = bs.parse_decode_lines(log)
    assert [r["running"] for r in lines] == [1, 1, 1, 1, 64, 64, 64, 64, 256, 256]
    assert lines[1]["step_ms"] == pytest.approx(1000 / 216)
    assert lines[8]["cuda_graph"] is True
    assert bs.steady_step_ms(lines, 1) == pytest.approx(1000 / 215)
    assert bs.steady_step_ms(lines, 64) == pytest.approx(9.0)
    assert bs.steady_step_ms(lines, 256) == pytest.approx(1000 * 256 / 9360)
    assert bs.steady_step_ms(lines, 128) is None


def _partial(model, family, arm, tok_s, parity=None, dtype=None, **extra):
    return {"kind": "e2e_partial", "model": model, "family": family, "arm": arm,
            "checkpoint_dtype": dtype, "command": f"python scripts/bench_serving.py run --arms {arm}",
            "launch_command": f"python -m sglang.launch_server {arm}", "bench_command": "b",
            "git_commit": "abc123", "gpu": "NVIDIA H200",
            "versions": {"torch": "2.11.0", "sglang": "0.5.17"}, "created": "2026-12-03T10:00:00Z",
            "healthy_after_s": 60.0, "error": None, "parity": parity,
            "rows": [{"batch": b, "input_len": 512, "output_len": 256, "output_tok_s": t,
                      "itl_ms": 1000 * b / t, "step_ms": 1000 * b / t, "latency_s": 1.0,
                      "ttft_s": 0.1} for b, t in tok_s.items()], **extra}


def _dump(ids_per_prompt, lps_per_prompt):
    return bs.greedy_dump([[7, 8]] * len(ids_per_prompt),
                          [{"ids": i, "logprobs": l} for i, l in zip(ids_per_prompt, lps_per_prompt)])


STOCK_DUMP = _dump([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]],
                   [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7, -0.8], [-1.0, -1.0, -1.0, -1.0]])
REPLAY_DUMP = _dump([[1, 2, 3, 4], [5, 6, 0, 1], [9, 9, 9, 2]],
                    [[-0.1, -0.2001, -0.3, -0.4], [-0.5, -0.6, -0.75, -0.1], [-1.0, -1.0, -1.0, -3.0]])


def test_compare_parity_finds_the_first_divergence():
    e = bs.compare_parity(STOCK_DUMP, REPLAY_DUMP, model="m", checkpoint_dtype="float32")
    assert e["prompts"] == 3 and e["tokens"] == 4 and e["identical_prompts"] == 1
    assert e["first_divergence"]["prompt"] == 1 and e["first_divergence"]["position"] == 2
    assert e["first_divergence"]["logprob_gap"] == pytest.approx(0.05)
    assert e["max_logprob_diff_before_divergence"] == pytest.approx(1e-4)
    same = bs.compare_parity(STOCK_DUMP, STOCK_DUMP, model="m", checkpoint_dtype="auto")
    assert same["identical_prompts"] == 3 and same["first_divergence"] is None
    other_prompts = bs.greedy_dump([[1]] * 3, REPLAY_DUMP["outputs"])
    with pytest.raises(AssertionError):
        bs.compare_parity(STOCK_DUMP, other_prompts, model="m", checkpoint_dtype="auto")
    assert e["informative"] and "note" not in e


def test_greedy_dump_keeps_a_digest_of_its_prompts():
    prompts = bs.parity_prompts(4, 16)
    dump = bs.greedy_dump(prompts, [])
    assert "prompts" not in dump and dump["num_prompts"] == 4 and dump["prompt_len"] == 16
    assert dump["prompts_sha256"] == bs.greedy_dump(bs.parity_prompts(4, 16), [])["prompts_sha256"]
    assert dump["prompts_sha256"] != bs.greedy_dump(bs.parity_prompts(4, 16, seed=1), [])["prompts_sha256"]
    # a partial from before the digest (the ids themselves) compares with a new one
    old_style = {"prompts": [[7, 8]] * 3, "outputs": REPLAY_DUMP["outputs"]}
    e = bs.compare_parity(STOCK_DUMP, old_style, model="m", checkpoint_dtype="auto")
    assert e["identical_prompts"] == 1


def test_compare_parity_flags_flat_logits():
    # SGLang's dummy init: every logprob -ln(vocab); identical tokens prove nothing
    flat = _dump([[1, 2], [3, 4]], [[-11.7834835] * 2, [-11.7834835] * 2])
    e = bs.compare_parity(flat, flat, model="m", checkpoint_dtype="auto")
    assert e["identical_prompts"] == 2 and not e["informative"]
    assert "--dummy-init scaled" in e["note"]


def test_parse_generate_outputs():
    resp = [{"text": "ab", "meta_info": {"output_token_logprobs": [[-0.5, 11, None], [-1.5, 12, None]]}}]
    assert bs.parse_generate_outputs(resp) == [{"ids": [11, 12], "logprobs": [-0.5, -1.5]}]


def _records():
    return [
        _partial("nemotron-h-8b", "mamba2", "stock-triton", {1: 216.3, 256: 8876.0}, parity=STOCK_DUMP),
        _partial("nemotron-h-8b", "mamba2", "stock-flashinfer",
                 {1: 216.4, 256: 10813.0}),
        _partial("nemotron-h-8b", "mamba2", "replayssm", {1: 220.0, 256: 13000.0},
                 parity=REPLAY_DUMP, dtype="auto"),
        _partial("nemotron-h-8b", "mamba2", "replayssm-bfloat16", {256: 14000.0}, dtype="bfloat16"),
        _partial("qwen3-next-80b", "gdn", "stock-triton", {256: 9464.0}),
        _partial("qwen3-next-80b", "gdn", "sglang-replay", {256: 10129.0}),
        _partial("qwen3-next-80b", "gdn", "replayssm", {256: 11000.0}, dtype="auto"),
    ]


def test_merge_picks_the_fastest_stock_arm_per_row():
    rows = {(r["model"], r["batch"]): r for r in bs.merge_rows(_records())}
    nb1, nb256 = rows[("nemotron-h-8b", 1)], rows[("nemotron-h-8b", 256)]
    assert nb1["stock_backend"] == "flashinfer" and nb1["stock_tok_s"] == 216.4
    assert nb256["stock_backend"] == "flashinfer" and nb256["stock_tok_s"] == 10813.0
    assert nb256["replay_tok_s"] == 13000.0
    assert nb256["speedup"] == pytest.approx(13000 / 10813, abs=1e-4)
    assert nb256["speedup_vs_triton"] == pytest.approx(13000 / 8876, abs=1e-4)
    assert nb256["speedup_vs_flashinfer"] == nb256["speedup"]
    assert nb256["stock_triton_tok_s"] == 8876.0 and nb256["stock_flashinfer_tok_s"] == 10813.0
    assert nb256["itl_ms"] == pytest.approx(1000 * 256 / 13000)
    assert nb256["stock_itl_ms"] == pytest.approx(1000 * 256 / 10813)
    assert nb256["replay_bfloat16_tok_s"] == 14000.0
    assert nb256["speedup_bfloat16"] == pytest.approx(14000 / 10813, abs=1e-4)
    assert "sglang_replay_tok_s" not in nb256 and "replay_bfloat16_tok_s" not in nb1
    q = rows[("qwen3-next-80b", 256)]
    assert q["stock_backend"] == "triton" and q["stock_tok_s"] == 9464.0
    assert q["sglang_replay_tok_s"] == 10129.0
    assert q["speedup_vs_sglang_replay"] == pytest.approx(11000 / 10129, abs=1e-4)
    assert q["speedup"] == pytest.approx(11000 / 9464, abs=1e-4)


def test_merge_without_a_replay_run_leaves_speedups_empty():
    rows = bs.merge_rows([_partial("m", "mamba2", "stock-triton", {64: 100.0})])
    assert rows[0]["stock_backend"] == "triton"
    assert rows[0]["replay_tok_s"] is None and rows[0]["speedup"] is None


def test_merge_writes_json_md_and_header(tmp_path):
    partial_dir, out_dir = tmp_path / "partial", tmp_path / "results"
    partial_dir.mkdir()
    for rec in _records():
        with open(bs.partial_path(str(partial_dir), rec["model"], rec["arm"]), "w") as f:
            json.dump(rec, f)
    (partial_dir / "notes.json").write_text("{}")  # ignored: not an e2e_ partial
    assert bs.main(["merge", "--partial-dir", str(partial_dir), "--out-dir", str(out_dir)]) == 0
    doc = json.loads((out_dir / "e2e_decode.json").read_text())
    for key in ("command", "git_commit", "gpu", "versions", "created", "rows", "greedy_parity"):
        assert key in doc
    assert doc["git_commit"] == "abc123" and doc["gpu"] == "NVIDIA H200"
    assert doc["versions"]["sglang"] == "0.5.17"
    assert len(doc["rows"]) == 3 and len(doc["runs"]) == 7
    assert all(r["launch_command"].startswith("python -m sglang.launch_server") for r in doc["runs"])
    (parity,) = doc["greedy_parity"]
    assert parity["model"] == "nemotron-h-8b" and parity["checkpoint_dtype"] == "auto"
    assert parity["stock_arm"] == "stock-triton" and parity["identical_prompts"] == 1
    assert parity["first_divergence"] == {"prompt": 1, "position": 2,
                                          "logprob_gap": pytest.approx(0.05)}
    md = (out_dir / "e2e_decode.md").read_text()
    assert "## nemotron-h-8b" in md and "## qwen3-next-80b" in md
    assert "| 256 | 512/256 | flashinfer | 10813.0 | 13000.0 | 1.202x |" in md
    assert "prompt 1 at token 2" in md
    # --name: another GPU's runs go to their own file, the default one untouched
    before = (out_dir / "e2e_decode.json").read_text()
    assert bs.main(["merge", "--partial-dir", str(partial_dir), "--out-dir", str(out_dir),
                    "--name", "e2e_decode_h100"]) == 0
    assert json.loads((out_dir / "e2e_decode_h100.json").read_text())["rows"] == doc["rows"]
    assert (out_dir / "e2e_decode_h100.md").exists()
    assert (out_dir / "e2e_decode.json").read_text() == before


def test_merge_parity_reports_a_stock_vs_stock_noise_floor():
    recs = [_partial("q", "gdn", "stock-triton", {64: 1.0}, parity=STOCK_DUMP),
            _partial("q", "gdn", "stock-flashinfer", {64: 1.0}, parity=REPLAY_DUMP),
            _partial("q", "gdn", "replayssm", {64: 1.0}, parity=STOCK_DUMP, dtype="auto")]
    by_arm = {e["arm"]: e for e in bs.merge_parity(recs)}
    assert set(by_arm) == {"stock-flashinfer", "replayssm"}
    floor, ours = by_arm["stock-flashinfer"], by_arm["replayssm"]
    assert floor["noise_floor"] and not ours["noise_floor"]
    assert floor["stock_arm"] == ours["stock_arm"] == "stock-triton"
    assert floor["identical_prompts"] == 1 and ours["identical_prompts"] == len(STOCK_DUMP["outputs"])
    md = bs.markdown({"command": "c", "git_commit": "abc", "gpu": "g", "versions": {},
                      "created": "t", "rows": [], "runs": [],
                      "greedy_parity": bs.merge_parity(recs)})
    assert "stock-flashinfer (noise floor)" in md


def test_merge_parity_compares_an_arm_with_itself_in_smaller_batches():
    floor = dict(REPLAY_DUMP, group=8)
    recs = [_partial("q", "gdn", "stock-triton", {64: 1.0}, parity=STOCK_DUMP,
                     parity_floor=floor),
            _partial("q", "gdn", "replayssm", {64: 1.0}, parity=STOCK_DUMP, dtype="auto")]
    by_arm = {e["arm"]: e for e in bs.merge_parity(recs)}
    assert set(by_arm) == {"replayssm", "stock-triton in groups of 8"}
    e = by_arm["stock-triton in groups of 8"]
    assert e["noise_floor"] and e["stock_arm"] == "stock-triton batched"
    assert e["identical_prompts"] == 1
    assert e["first_divergence"] == {"prompt": 1, "position": 2, "logprob_gap": pytest.approx(0.05)}
    assert e["median_agreeing_tokens"] == 3  # agreeing runs 4, 2, 3
    assert not by_arm["replayssm"]["noise_floor"]


def test_parity_floor_needs_parity(models, tmp_path):
    root = os.path.dirname(models["nemotron-h-8b"])
    with pytest.raises(SystemExit, match="--parity-floor-group needs --parity"):
        bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root,
                 "--parity-floor-group", "8", "--partial-dir", str(tmp_path)])


def test_records_name_their_code(monkeypatch):
    # the commit logic itself: tests/test_provenance.py
    monkeypatch.setenv("GIT_COMMIT", "deadbeef")
    env = bs.environment()
    assert env["git_commit"] == "deadbeef" and "git_tree" in env


def test_run_rejects_an_unknown_arm_before_starting_anything(models, tmp_path):
    root = os.path.dirname(models["nemotron-h-8b"])
    with pytest.raises(ValueError, match="sglang-replay"):
        bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root, "--arms", "sglang-replay",
                 "--partial-dir", str(tmp_path), "--log-dir", str(tmp_path)])
    assert os.listdir(tmp_path) == []


def test_an_arm_may_name_its_decode_route(models, tmp_path):
    assert bs.split_arm("replayssm:split") == ("replayssm", "split")
    assert bs.split_arm("replayssm", "output_only") == ("replayssm", "output_only")
    assert bs.split_arm("stock-flashinfer", "split") == ("stock-flashinfer", "split")
    assert bs.arm_label(*bs.split_arm("replayssm:output_only")[:1], "auto",
                        bs.split_arm("replayssm:output_only")[1]) == "replayssm-output_only"
    cmd = bs.server_command(models["nemotron-h-8b"], "mamba2", "replayssm", port=1,
                            decode_route="output_only")
    assert cmd[cmd.index("--replayssm-decode-route") + 1] == "output_only"
    root = os.path.dirname(models["nemotron-h-8b"])
    for bad in ("replayssm:fast", "stock-triton:split"):
        with pytest.raises(ValueError, match="decode route suffix"):
            bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root, "--arms",
                     "stock-triton", bad, "--partial-dir", str(tmp_path),
                     "--log-dir", str(tmp_path)])
    assert os.listdir(tmp_path) == []


def test_server_is_killed_with_its_children_when_never_healthy(tmp_path):
    log_path = tmp_path / "server.log"
    server = bs.Server(["bash", "-c", "sleep 60 & echo started; sleep 60"], str(log_path))
    with server:
        with pytest.raises(TimeoutError):
            server.wait_healthy("http://127.0.0.1:9", timeout_s=1)
        child_group = server.proc.pid
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 10  # the orphaned child is reaped by init, not by us
    while time.monotonic() < deadline:
        try:
            os.killpg(child_group, 0)
        except ProcessLookupError:
            break  # the whole process group is gone
        time.sleep(0.1)
    else:
        pytest.fail("a process of the server's group survived")
    assert "started" in log_path.read_text()


def test_stock_arm_commands_parse_with_sglangs_own_arguments(models):
    """Every flag of the stock arms is one SGLang 0.5.17's launch_server knows
    (the replayssm arm's flags come from this package's plugin)."""
    import argparse
    server_args = pytest.importorskip("sglang.srt.server_args")
    for name, family in (("nemotron-h-8b", "mamba2"), ("qwen3-next-80b", "gdn"),
                         ("falcon-h1-4layer", "mamba2")):
        for arm in bs.arms_for(family):
            if arm == bs.REPLAY_ARM:
                continue
            parser = argparse.ArgumentParser()
            server_args.ServerArgs.add_cli_args(parser)
            ns = parser.parse_args(bs.server_command(models[name], family, arm, port=30000)[3:])
            assert ns.load_format == "dummy" and ns.disable_radix_cache
            assert ns.max_running_requests == 256 and ns.disable_flashinfer_autotune
            assert ns.enable_linear_replayssm == (arm == bs.SGLANG_REPLAY_ARM)
            assert ns.disable_prefill_cuda_graph == (name == "falcon-h1-4layer")
            if family == "mamba2":
                assert ns.mamba_backend == arm[len("stock-"):]
                assert ns.attention_backend == "flashinfer"
            else:
                assert ns.attention_backend == "triton" and ns.moe_runner_backend == "triton"


def test_profile_command_and_summary(tmp_path):
    cmd = bs.bench_command("m", "http://h", batch_sizes=[64], input_len=512, output_len=256,
                           result_file="r.jsonl", python="python3",
                           profile_dir=str(tmp_path), profile_steps=24)
    assert cmd[cmd.index("--profile-output-dir") + 1] == str(tmp_path)
    assert cmd[cmd.index("--profile-steps") + 1] == "24" and "--profile" in cmd
    assert "--profile" not in bs.bench_command("m", "http://h", batch_sizes=[1], input_len=1,
                                               output_len=1, result_file="r", python="p")
    import gzip
    sub = tmp_path / "1733000000.0"
    sub.mkdir()
    ev = [{"cat": "kernel", "name": "gdn", "dur": 80.0}, {"cat": "kernel", "name": "gdn", "dur": 90.0},
          {"cat": "kernel", "name": "moe", "dur": 500.0}, {"cat": "cpu_op", "name": "x", "dur": 9.0}]
    with gzip.open(sub / "TP-0.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    (sub / "server_args.json").write_text("{}")  # not a trace
    (tmp_path / "bench.jsonl").write_text("{}\n{}\n")  # not a trace (nor one JSON document)
    s = bs.summarize_profile(str(tmp_path), steps=2)
    assert [k["name"] for k in s["kernels"]] == ["moe", "gdn"]
    assert s["kernels"][1] == {"name": "gdn", "count": 2, "total_us": 170.0, "us_per_step": 85.0}
    assert s["gpu_us_per_step"] == 335.0 and s["trace_files"] == ["1733000000.0/TP-0.trace.json.gz"]


def test_median_rows_keeps_one_runs_whole_row():
    runs = [[{"batch": 64, "output_tok_s": t, "itl_ms": i}, {"batch": 1, "output_tok_s": 200.0 + t,
                                                             "itl_ms": 5.0}]
            for t, i in ((300.0, 1.0), (100.0, 3.0), (200.0, 2.0))]
    rows = bs.median_rows(runs)
    assert [r["batch"] for r in rows] == [64, 1]
    assert rows[0] == {"batch": 64, "output_tok_s": 200.0, "itl_ms": 2.0}
    assert rows[1]["output_tok_s"] == 400.0
    # an even count takes the lower middle run; a single run is itself
    assert bs.median_rows(runs[:2])[0]["output_tok_s"] == 100.0
    assert bs.median_rows(runs[:1]) == runs[0]
    assert bs.median_rows([]) == []


class _WarmServer:
    """A Server stand-in that is healthy at once and logs nothing."""

    def __init__(self, cmd, log_path, env=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_healthy(self, url, timeout):
        return 1.0

    def log_text(self):
        return ""


def _fake_bench_runs(monkeypatch, throughputs):
    """Serve run_arm from _WarmServer, each bench_one_batch_server run writing
    the next of ``throughputs`` (batch 64); once they run out, the next run
    is cut as a call's time limit cuts it (SIGTERM -> SystemExit). Returns
    the list the bench commands are appended to."""
    tok_s, benches = iter(throughputs), []
    real_run = bs.subprocess.run

    def fake_run(cmd, **kw):
        if "--result-filename" not in cmd:  # git, for the record's provenance
            return real_run(cmd, **kw)
        benches.append(cmd)
        t = next(tok_s, None)
        if t is None:
            raise SystemExit("signal 15")
        with open(cmd[cmd.index("--result-filename") + 1], "a") as f:
            f.write(json.dumps({"run_name": "default", "batch_size": 64, "input_len": 512,
                                "output_len": 256, "latency": 1.0, "input_throughput": 1.0,
                                "output_throughput": t, "overall_throughput": 1.0,
                                "last_ttft": 0.1, "last_gen_throughput": t}) + "\n")
        return type("Proc", (), {"returncode": 0, "stdout": f"output throughput: {t}\n"})()

    monkeypatch.setattr(bs, "Server", _WarmServer)
    monkeypatch.setattr(bs, "check_openai", lambda url: {})
    monkeypatch.setattr(bs.subprocess, "run", fake_run)
    return benches


def test_repeats_bench_the_same_server_and_keep_the_median(models, tmp_path, monkeypatch):
    """run_arm with --repeats 3 against a fake server: three bench runs, only
    the first with warm-up batches, rows from the median one, every run's
    figures in `repeats`."""
    benches = _fake_bench_runs(monkeypatch, [300.0, 100.0, 200.0])
    root = os.path.dirname(models["nemotron-h-8b"])
    assert bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root, "--arms",
                    "stock-triton", "--batch-sizes", "64", "--repeats", "3", "--warmup-runs", "0",
                    "--partial-dir", str(tmp_path), "--log-dir", str(tmp_path)]) == 0
    rec = json.load(open(tmp_path / "e2e_nemotron-h-8b_stock-triton.json"))
    assert rec["error"] is None
    assert ["--skip-warmup" not in cmd for cmd in benches] == [True, False, False]
    assert [r["output_tok_s"] for r in rec["rows"]] == [200.0]
    assert [[r["output_tok_s"] for r in run] for run in rec["repeats"]] == [[300.0], [100.0], [200.0]]
    assert "warmup_runs" not in rec
    for flag in ("--repeats", "--warmup-runs"):
        bad = "0" if flag == "--repeats" else "-1"
        with pytest.raises(SystemExit, match=f"{flag} must be >= "):
            bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root, flag, bad,
                     "--partial-dir", str(tmp_path)])


def test_a_warmup_run_is_measured_apart_from_the_rows(models, tmp_path, monkeypatch):
    """The default full-length warm-up run (bench's own warm-up batches in it
    alone) precedes the measured repeats; its figures are kept apart and a
    slow one does not reach the rows."""
    benches = _fake_bench_runs(monkeypatch, [50.0, 300.0, 100.0])
    root = os.path.dirname(models["nemotron-h-8b"])
    assert bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root, "--arms",
                    "stock-triton", "--batch-sizes", "64", "--repeats", "2",
                    "--partial-dir", str(tmp_path), "--log-dir", str(tmp_path)]) == 0
    rec = json.load(open(tmp_path / "e2e_nemotron-h-8b_stock-triton.json"))
    assert ["--skip-warmup" not in cmd for cmd in benches] == [True, False, False]
    assert [[r["output_tok_s"] for r in run] for run in rec["warmup_runs"]] == [[50.0]]
    assert [[r["output_tok_s"] for r in run] for run in rec["repeats"]] == [[300.0], [100.0]]
    assert [r["output_tok_s"] for r in rec["rows"]] == [100.0]  # the lower of two, not 50


def test_a_run_cut_during_warmup_has_no_rows(models, tmp_path, monkeypatch):
    """A call's time limit during the warm-up run: the partial records the
    error and the warm-up's figures, but no rows to merge."""
    _fake_bench_runs(monkeypatch, [])
    root = os.path.dirname(models["nemotron-h-8b"])
    bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root, "--arms", "stock-triton",
             "--batch-sizes", "64", "--partial-dir", str(tmp_path), "--log-dir", str(tmp_path)])
    rec = json.load(open(tmp_path / "e2e_nemotron-h-8b_stock-triton.json"))
    assert rec["error"] == "SystemExit: signal 15"
    assert rec["rows"] == [] and "warmup_runs" not in rec


def test_a_cut_repeat_keeps_the_runs_made(models, tmp_path, monkeypatch):
    """A call's time limit (SIGTERM -> SystemExit) during the third run: the
    partial records the error and the median of the two runs completed."""
    benches = _fake_bench_runs(monkeypatch, [300.0, 100.0])
    root = os.path.dirname(models["nemotron-h-8b"])
    bs.main(["run", "--model", "nemotron-h-8b", "--model-root", root, "--arms", "stock-triton",
             "--batch-sizes", "64", "--repeats", "3", "--warmup-runs", "0",
             "--partial-dir", str(tmp_path), "--log-dir", str(tmp_path)])
    assert len(benches) == 3
    rec = json.load(open(tmp_path / "e2e_nemotron-h-8b_stock-triton.json"))
    assert rec["error"] == "SystemExit: signal 15"
    assert [r["output_tok_s"] for r in rec["rows"]] == [100.0]  # the lower of two: (2-1)//2
    assert [[r["output_tok_s"] for r in run] for run in rec["repeats"]] == [[300.0], [100.0]]


def test_fp32_activations_reach_every_arms_launch_and_env(models, tmp_path, monkeypatch):
    """--fp32-activations: --dtype float32 before --server-args (which may
    override it), the native-fp32-ops knob in the server's environment only
    when asked, and the partial and parity rows say which activations ran."""
    launched = []

    class FakeServer:
        def __init__(self, cmd, log_path, env=None):
            launched.append((cmd, env))

        def __enter__(self):
            raise RuntimeError("not started in this test")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bs, "Server", FakeServer)
    knob = bs.NATIVE_FP32_OPS_ENV
    monkeypatch.setenv(knob, "1")  # a stale knob is not inherited
    root = os.path.dirname(models["nemotron-h-8b"])
    common = ["run", "--model", "nemotron-h-8b", "--model-root", root, "--batch-sizes", "64",
              "--partial-dir", str(tmp_path), "--log-dir", str(tmp_path)]
    bs.main(common + ["--arms", "stock-triton", "replayssm", "--fp32-activations"])
    bs.main(common + ["--arms", "stock-triton", "--fp32-activations",
                      "--server-args", "--attention-backend triton --log-level debug"])
    bs.main(common + ["--arms", "stock-triton"])
    (c1, e1), (c2, e2), (c4, e4), (c3, e3) = launched
    for cmd, env in ((c1, e1), (c2, e2)):
        assert cmd[cmd.index("--dtype") + 1] == "float32"
        assert "--disable-decode-cuda-graph" in cmd and "--disable-prefill-cuda-graph" in cmd
        last = max(i for i, a in enumerate(cmd) if a == "--attention-backend")
        assert cmd[last + 1] == "torch_native"  # after the family's flashinfer, so it wins
        assert env[knob] == "1" and env[bs.MAMBA_CONV_DTYPE_ENV] == "float32"
    assert "--dtype" not in c3 and "--disable-decode-cuda-graph" not in c3 and knob not in e3
    last = max(i for i, a in enumerate(c4) if a == "--attention-backend")
    assert c4[last + 1] == "triton" and c4[-2:] == ["--log-level", "debug"]  # --server-args win
    rec = json.load(open(tmp_path / "e2e_nemotron-h-8b_stock-triton.json"))
    assert rec["activations"] == "model"  # the last invocation overwrote the others
    recs = [_partial("q", "gdn", "stock-triton", {64: 1.0}, parity=STOCK_DUMP, activations="float32"),
            _partial("q", "gdn", "replayssm", {64: 1.0}, parity=STOCK_DUMP, dtype="auto",
                     activations="float32")]
    (entry,) = bs.merge_parity(recs)
    assert entry["activations"] == "float32"
    md = bs.markdown({"command": "c", "git_commit": "abc", "gpu": "g", "versions": {},
                      "created": "t", "rows": [], "runs": [], "greedy_parity": [entry]})
    assert "| sglang | float32 |" in md
    assert bs._fmt_small(3.3855e-05) == "3.4e-05" and bs._fmt_small(0.0123) == "0.0123"
    assert bs._fmt_small(0.0) == "0.0000" and bs._fmt_small(None) == "–"
    # a near-tie divergence names its gap, not 0.0000
    tie = dict(entry, first_divergence={"prompt": 50, "position": 125, "logprob_gap": 2.9e-06})
    md = bs.markdown({"command": "c", "git_commit": "abc", "gpu": "g", "versions": {},
                      "created": "t", "rows": [], "runs": [], "greedy_parity": [tie]})
    assert "prompt 50 at token 125, logprob gap 2.9e-06 |" in md


def test_merge_reads_several_folders_and_refuses_an_arm_found_twice(tmp_path):
    """A parity's stock arm kept from one call merges with our arm from the
    next (an archived folder's partials gzipped); the same (model, arm) in two
    folders is an error, not a pick."""
    import gzip

    recs = _records()
    recs[0]["activations"] = "float32"
    first, second, out_dir = tmp_path / "a", tmp_path / "b", tmp_path / "results"
    first.mkdir(), second.mkdir()
    for i, rec in enumerate(recs):
        path = bs.partial_path(str(first if i % 2 else second), rec["model"], rec["arm"])
        with (open(path, "w") if i % 2 else gzip.open(path + ".gz", "wt")) as f:
            json.dump(rec, f)
    assert bs.main(["merge", "--partial-dir", str(first), str(second),
                    "--out-dir", str(out_dir)]) == 0
    doc = json.loads((out_dir / "e2e_decode.json").read_text())
    assert len(doc["runs"]) == len(recs) and len(doc["greedy_parity"]) == 1
    # an fp32-activation run is eager: its table says so
    assert (f"Runs with float32 activations ({recs[0]['model']}) serve eagerly"
            in (out_dir / "e2e_decode.md").read_text())
    dup = recs[1]
    with open(bs.partial_path(str(second), dup["model"], dup["arm"]), "w") as f:
        json.dump(dup, f)
    with pytest.raises(SystemExit, match=f"{dup['model']} arm {dup['arm']} is in both"):
        bs.main(["merge", "--partial-dir", str(first), str(second), "--out-dir", str(out_dir)])


def test_radix_check_dumps_second_turns_against_the_cache_then_from_scratch(
        models, tmp_path, monkeypatch):
    """--radix-cache drops --disable-radix-cache from the launch; --radix-check
    sends second turns (prompt + the parity dump's greedy output + a suffix)
    twice, with /flush_cache between, keeping each dump's cached prompt
    tokens from the server log; merge compares the two per arm."""
    _fake_bench_runs(monkeypatch, [100.0])
    launches, calls, log = [], [], []

    class LoggingServer(_WarmServer):
        def __init__(self, cmd, log_path, env=None):
            launches.append(cmd)

        def log_text(self):
            return "".join(log)

    def fake_generate(url, prompts, tokens, timeout):
        calls.append(("generate", [len(p) for p in prompts]))
        cached = sum(len(p) - 1 for p in prompts) if calls.count(("flush",)) == 0 and \
            len(calls) > 1 else 0
        log.append(f"[t] Prefill batch, #new-seq: {len(prompts)}, #new-token: 5, "
                   f"#cached-token: {cached}, token usage: 0.01, \n")
        return [{"ids": [7 + i] * tokens, "logprobs": [-1.0] * tokens}
                for i in range(len(prompts))]

    monkeypatch.setattr(bs, "Server", LoggingServer)
    monkeypatch.setattr(bs, "generate_greedy", fake_generate)
    monkeypatch.setattr(bs, "http_text", lambda url, **kw: calls.append(("flush",)) or "ok")
    root = os.path.dirname(models["nemotron-h-8b"])
    common = ["run", "--model", "nemotron-h-8b", "--model-root", root, "--arms", "replayssm",
              "--batch-sizes", "64", "--warmup-runs", "0", "--parity", "--parity-prompts", "3",
              "--parity-tokens", "5", "--input-len", "20", "--partial-dir", str(tmp_path),
              "--log-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="--radix-check needs --parity and --radix-cache"):
        bs.main(common + ["--radix-check"])
    assert bs.main(common + ["--radix-cache", "--radix-check", "--radix-suffix-len", "4"]) == 0
    assert "--disable-radix-cache" not in launches[0]
    assert calls == [("generate", [20] * 3), ("generate", [29] * 3), ("flush",),
                     ("generate", [29] * 3)]
    rec = json.load(open(tmp_path / "e2e_nemotron-h-8b_replayssm.json"))
    hit, miss = rec["radix_check"]["hit"], rec["radix_check"]["miss"]
    assert (hit["cached_tokens"], miss["cached_tokens"]) == (84, 0)
    assert hit["prompts_sha256"] == miss["prompts_sha256"] != rec["parity"]["prompts_sha256"]
    (entry,) = bs.merge_parity([rec])  # no stock arm: only the arm against itself
    assert entry["arm"] == "replayssm radix hit (84 tokens cached)"
    assert entry["stock_arm"] == "replayssm from scratch (0)"
    assert entry["identical_prompts"] == 3 and not entry["noise_floor"]
    assert bs.cached_tokens("".join(log)) == 84
    assert bs.server_command(models["nemotron-h-8b"], "mamba2", "replayssm",
                             port=1).count("--disable-radix-cache") == 1
