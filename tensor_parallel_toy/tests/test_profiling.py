"""The profile, end to end on a tiny model, and the pieces it is built from.

The smoke test runs every phase (four modes, overlap benchmark, timeline) on the shared 2-rank
pool with tiny shapes and checks that results.json holds every section and that every plot was
written; it checks wiring and agreement between modes, not speed.
"""
import json
import os
import sys

import pytest
import torch
import torch.nn as nn

from tensor_parallel_toy.profiling import cli as profile
from tensor_parallel_toy.profiling.measure.bench_overlap import OPS
from tensor_parallel_toy.profiling.measure.metrics import SavedActivationBytes, ratio_interval
from tensor_parallel_toy.profiling.measure.timeline import nccl_kernel_us
from tensor_parallel_toy.profiling.report import report, targets
from tensor_parallel_toy.profiling.run import data, phases
from tensor_parallel_toy.profiling.run.train import interleaved_order
from tensor_parallel_toy.profiling.spec import MODELS, MODES

from .collective_guard import GuardedRunner, guarded_call
from .helpers import BACKENDS

TINY = ["--steps", "4", "--warmup", "1", "--batch", "2", "--seq", "16", "--hidden", "32",
        "--heads", "4", "--ffn", "64", "--layers", "1", "--bench-iters", "2",
        "--bench-shape", "16,2,32,64", "--timeline-iters", "1"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_profile_smoke_writes_results_json_and_every_plot(pools, tmp_path, backend):
    flags = [*TINY, "--bench-iters", "12", "--timeline-iters", "3"]  # 3 blocks, 3 recordings
    device = ["--device", "cuda"] if backend == "nccl" else []
    args = profile.parse_args([*flags, *device, "--out", str(tmp_path)], env={})
    args.argv = flags
    # Every collective of every phase, on every rank, passes through comm.py with its tensors
    # on the group's device (collective_guard.py): the defect that crashed the profile on NCCL.
    runner = GuardedRunner(phases.PoolRunner(pools(2, backend)))
    results = phases.run_phases(runner, args)
    assert not runner.violations, "\n".join(runner.violations)
    results["meta"]["runtime_s"] = 0.0
    summary = phases.write_outputs(results, str(tmp_path))

    written = sorted(os.listdir(tmp_path))
    expected = ["grad_norm.png", "loss.png", "memory.png", "overlap.png", "results.json",
                "step_time.png", "summary.txt", "timeline.png"]
    assert written == expected, f"files: {written} (no temporary files may be left behind)"
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("meta", "config", "modes", "overlap_benchmark", "timeline", "targets", "files"):
        assert key in saved, f"results.json lacks {key!r}"
    for key in ("torch", "device", "backend", "world_size", "tp", "threads_per_rank"):
        assert key in saved["meta"], f"meta lacks {key!r}"
    assert list(saved["modes"]) == list(MODELS["default"]["modes"])
    for mode, d in saved["modes"].items():
        for key in ("loss", "grad_norm", "step_time_s", "step_time", "tokens_per_s",
                    "memory_per_rank"):
            assert key in d, f"{mode} lacks {key!r}"
        assert len(d["loss"]) == 4 and all(n > 0 for n in d["grad_norm"]), (mode, d["grad_norm"])
        if mode != "baseline":
            assert max(d["loss_rel_err_vs_baseline"]) <= 1e-4, (mode, d["loss_rel_err_vs_baseline"])
            assert max(d["grad_norm_rel_err_vs_baseline"]) <= 1e-4, mode
            assert d["memory_per_rank"][0]["saved_activation_bytes"] > 0, mode
    assert saved["modes"]["tp"]["memory_per_rank"][0]["param_bytes"] < \
        saved["modes"]["baseline"]["memory_per_rank"][0]["param_bytes"]
    assert sorted(saved["overlap_benchmark"]["ops"]) == sorted(OPS)
    for name, row in saved["overlap_benchmark"]["ops"].items():
        for key in ("overlap_over_max_blocks", "basic_over_max_blocks"):
            d = row[key]  # blocks of 5, 5 and 2 rounds
            assert d["n"] == 3 == len(d["values"]) and d["p10"] <= d["median"] <= d["p90"], \
                (name, key, d)
    assert set(saved["timeline"]["spans"]) == set(saved["timeline"]["summary"]) == {
        "tp", "tp_overlap", "tp_halves"}, list(saved["timeline"]["summary"])
    for mode, tl in saved["timeline"]["summary"].items():
        for key, d in tl["over_recordings"].items():
            assert d["n"] == 3 == len(d["values"]), (mode, key, d)
            assert d["min"] <= d["p10"] <= d["median"] <= d["p90"] <= d["max"], (mode, key, d)
        # The recording drawn is the median one of the slowest rank's block times.
        assert tl["total_ms"] == pytest.approx(tl["over_recordings"]["total_ms"]["median"]), tl
    classic = saved["memory_tp_no_sp"]
    act = {m: saved["modes"][m]["memory_per_rank"][0]["saved_activation_bytes"]
           for m in ("baseline", "tp")}
    assert classic["loss_rel_diff_vs_baseline"] <= 1e-6, classic
    assert classic["loss"] == pytest.approx(saved["modes"]["baseline"]["loss"][0], rel=1e-6)
    assert classic["baseline_memory"]["saved_activation_bytes"] == act["baseline"], classic
    assert act["tp"] < classic["memory_per_rank"][0]["saved_activation_bytes"] < \
        act["baseline"], (act, classic["memory_per_rank"])
    assert "tp_no_sp (classic TP without sequence parallelism" in summary
    assert "per block of 5 rounds, 3 blocks" in summary and "3 recordings per mode" in summary
    assert len(saved["targets"]) == 4
    assert "\ntargets (met: " in summary and summary.count("  legend: ") == 5, summary
    # Where the modes land: tp's block split into waiting and the rest, the two bounds from it.
    land, tl_tp = saved["landing"], saved["timeline"]["summary"]["tp"]["over_recordings"]
    assert land["total_ms"] == tl_tp["total_ms"]["median"], land
    assert land["comm_ms"] == tl_tp["blocked_in_comm_ms"]["median"], land
    assert land["limit"] == pytest.approx(max(land["comm_ms"], land["compute_ms"])
                                          / land["total_ms"]), land
    assert land["limit"] <= land["ring_ceiling"] <= 1.0, land
    for mode in ("tp_overlap", "tp_halves"):
        assert land["modes"][mode]["step"] == saved["ratios"][f"{mode}/tp"], mode
    assert "where the modes land against tp" in summary, summary
    for name, r in saved["ratios"].items():  # every pair, paired over the same timed steps
        a, b = name.split("/")
        assert r["n"] == 3 and r["ci95"][0] <= r["ratio"] <= r["ci95"][1], (name, r)
        assert r["ratio"] == pytest.approx(saved["modes"][a]["step_time"]["median"]
                                           / saved["modes"][b]["step_time"]["median"]), name
    assert "tp_overlap/tp" in saved["ratios"] and "95%" in summary

    # The same results as a GPU run would label them: the GPU-only lines of the report render,
    # and no CPU explanation is left in them.
    gpu = json.loads(json.dumps(saved))
    gpu["meta"].update(device="cuda", gpu="NVIDIA H100", nccl_high_priority_streams=True,
                       overlap_weight_grad="bf16 GEMMs with fp32 output into an fp32 sum")
    gpu["config"]["run"]["dtype"] = "bf16"
    for mode in gpu["timeline"]["summary"].values():
        mode["nccl_kernel_ms"] = 1.25
    # A missed overlap target, so that its explanation is printed.
    gpu["overlap_benchmark"]["ops"]["column_fwd"].update(
        t_comm_ms=1.0, t_gemm_ms=2.0, t_seq_ms=3.0, overlap_over_max=5.0)
    gpu["targets"] = targets.evaluate_targets(gpu)
    text = report.summary_text(gpu)
    for words in ("GPU: NVIDIA H100; NCCL's streams at high priority", "CUDA events",
                  "compute stream stalled at waits", "NCCL kernels 1.2",
                  "bf16 GEMMs with fp32 output", "take SMs and memory bandwidth"):
        assert words in text, (words, text)
    assert "a transfer there is CPU work" not in text and ", posting" not in text, text


def test_the_targets_are_data_the_report_reads(monkeypatch):
    """The committed run's targets come back word for word from targets.json; a bound changed
    there changes the text and the verdict, so no bound is left in the report's code."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "blog", "results", "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    assert targets.evaluate_targets(results) == results["targets"]
    changed = json.loads(json.dumps(targets.TARGETS))
    changed["overlap_vs_dtensor"]["bound"] = 0.5
    changed["overlap_vs_tp_loopback"]["bound"] = 0.25
    changed["loss_vs_baseline"]["relative_error"] = 1e-9
    monkeypatch.setattr(targets, "TARGETS", changed)
    verdicts = {t["name"]: t["met"] for t in targets.evaluate_targets(results)}
    assert verdicts == {
        "forward AG+GEMM overlapped <= 1.2 x max(comm, GEMM)": None,
        "tp_overlap / tp step time <= 0.25 (overlap never costs time), whole interval": False,
        "tp_overlap / dtensor step time <= 0.5, whole interval": False,
        "per-step loss of every TP mode within 1e-9 relative of baseline": False}, verdicts


def test_modes_are_interleaved_each_first_equally_often_in_one_order_on_every_rank():
    orders = [interleaved_order(MODES, step) for step in range(2 * len(MODES))]
    assert all(sorted(o) == sorted(MODES) for o in orders), orders
    firsts = [o[0] for o in orders]
    assert all(firsts.count(m) == 2 for m in MODES), firsts
    # Consecutive steps never repeat the order (a mode never always follows the same mode).
    assert all(a != b for a, b in zip(orders, orders[1:])), orders


def test_ratio_interval_is_paired_and_covers_the_true_ratio():
    gen = torch.Generator().manual_seed(0)
    load = 1 + 3 * torch.rand(40, generator=gen)  # a machine whose load swings 1x to 4x
    fast = (10 * load).tolist()
    slow = (15 * load * (1 + 0.01 * torch.randn(40, generator=gen))).tolist()
    r = ratio_interval(slow, fast)
    assert r["ci95"][0] <= 1.5 <= r["ci95"][1] and r["ci95"][1] - r["ci95"][0] < 0.05, r
    # Unpaired (one side shuffled against the other), the same numbers say far less.
    shuffled = ratio_interval(slow, fast[::-1][5:] + fast[::-1][:5])
    assert shuffled["ci95"][1] - shuffled["ci95"][0] > 4 * (r["ci95"][1] - r["ci95"][0]), shuffled
    assert ratio_interval(fast, fast)["ci95"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="paired"):
        ratio_interval([1.0, 2.0], [1.0])


def test_an_interrupted_write_leaves_the_previous_results_intact(tmp_path, monkeypatch):
    """The profile renders into a staging folder and moves files only when all exist."""
    previous = {"results.json": "{\"old\": true}", "loss.png": "old picture"}
    for name, text in previous.items():
        (tmp_path / name).write_text(text)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as if Ctrl-C arrived while drawing
    monkeypatch.setattr(phases.plots, "plot_memory", crash)
    results = {"modes": {}, "config": {"run": {}}, "meta": {"world_size": 2}}
    monkeypatch.setattr(phases.plots, "plot_losses", lambda *a: None)
    monkeypatch.setattr(phases.plots, "plot_grad_norms", lambda *a: None)
    monkeypatch.setattr(phases.plots, "plot_step_times", lambda *a: None)
    with pytest.raises(KeyboardInterrupt):
        phases.write_outputs(results, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(previous), os.listdir(tmp_path)
    for name, text in previous.items():
        assert (tmp_path / name).read_text() == text, name


def test_batches_are_deterministic_and_labels_are_the_next_token():
    corpus = data.make_corpus()
    ids, labels = data.batch(corpus, step=3, batch_size=4, seq_len=32)
    again, _ = data.batch(data.make_corpus(), step=3, batch_size=4, seq_len=32)
    other, _ = data.batch(corpus, step=4, batch_size=4, seq_len=32)
    assert ids.shape == labels.shape == (4, 32) and ids.max() < data.CORPUS_VOCAB
    assert torch.equal(ids, again) and not torch.equal(ids, other)
    assert torch.equal(ids[:, 1:], labels[:, :-1])


def test_saved_activation_bytes_counts_each_storage_once_and_skips_parameters():
    lin = nn.Linear(8, 4, bias=False)
    x = torch.randn(5, 8)
    with SavedActivationBytes(lin) as meter:
        y = lin(x).exp()  # linear saves x (160 B) and a view of its weight (a parameter)
        (y * y).sum().backward()  # exp saves y (80 B); y * y saves y twice: one storage
    assert meter.bytes == 5 * 8 * 4 + 5 * 4 * 4, (meter.bytes, meter.count)


def test_saved_activation_bytes_skips_parameters_swapped_in_after_it_started():
    """FSDP2 replaces a block's Parameters by their unsharded versions for its forward: those
    are not the model's parameters when the meter starts, and still no activations."""
    lin = nn.Linear(8, 4, bias=False)
    x = torch.randn(5, 8, requires_grad=True)  # so that the weight is saved, for x's gradient
    with SavedActivationBytes(lin) as meter:
        lin.weight = nn.Parameter(lin.weight.detach().clone())  # a new storage, as FSDP2's
        y = lin(x).exp()
        (y * y).sum().backward()
    assert meter.bytes == 5 * 8 * 4 + 5 * 4 * 4, (meter.bytes, meter.count)


BACKGROUND = {"torchrun": lambda folder: dict(argv=[
    sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
    "tensor_parallel_toy", "profile", *TINY, "--bench-iters", "0", "--timeline-iters", "0",
    "--out", os.path.join(folder, "torchrun-profile")],
    # A rank that aborts (C++'s terminate) prints every Python thread's stack first.
    env={**os.environ, "PYTHONFAULTHANDLER": "1"})}


@pytest.mark.background("torchrun")
def test_profile_runs_under_torchrun(background):
    """Started the standard way (env:// rendezvous, one process per rank, no WorkerPool)."""
    code, out, err = background.result("torchrun", timeout=120)
    # torchrun's own report ends stderr; a rank's cause is above it, among its lines.
    causes = [line for line in err.splitlines() if line.startswith("[rank") or "rror" in line
              or "terminate" in line or "abort" in line.lower()]
    assert code == 0, out[-1500:] + "\n".join(causes[:40]) + "\n" + err[-1500:]
    with open(os.path.join(background.folder, "torchrun-profile", "results.json")) as f:
        saved = json.load(f)
    assert saved["meta"]["world_size"] == 2 and saved["meta"]["tp"] == 2, saved["meta"]
    assert list(saved["modes"]) == list(MODELS["default"]["modes"]), list(saved["modes"])
    for mode, d in saved["modes"].items():
        if mode != "baseline":
            assert max(d["loss_rel_err_vs_baseline"]) <= 1e-4, (mode, d["loss_rel_err_vs_baseline"])


def test_profile_trains_every_mode_with_grouped_query_attention(pools, tmp_path):
    """GQA on (2 k/v heads for 4 query heads, split over TP 2) in all four modes, including the
    DTensor plan; the hand-written modes use the vocab-parallel loss as always."""
    flags = [*TINY, "--kv-heads", "2", "--bench-iters", "0", "--timeline-iters", "0",
             "--out", str(tmp_path)]
    args = profile.parse_args(flags, env={})
    args.argv = flags
    results = phases.run_phases(phases.PoolRunner(pools(2)), args)
    assert results["config"]["model"]["num_kv_heads"] == 2, results["config"]["model"]
    assert list(results["modes"]) == list(MODELS["default"]["modes"]), list(results["modes"])
    for mode, d in results["modes"].items():
        if mode != "baseline":
            assert max(d["loss_rel_err_vs_baseline"]) <= 1e-4, (mode, d["loss_rel_err_vs_baseline"])


def _on_rank_recorded_transfers(overlap):
    """Every transfer of one model loss + backward, as the timeline's recorder sees them:
    {kind: count}, and whether every span is well formed."""
    import torch.distributed as dist

    from tensor_parallel_toy import ModelConfig, Transformer, guard
    from tensor_parallel_toy.profiling.measure.timeline import Clock, record_into

    config = ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2,
                         ffn_hidden_size=32, max_seq_len=8)
    # Guarded as the profile's models are (the batch check), the gradient check left out.
    model = guard(Transformer(config, tp_group=dist.group.WORLD, overlap=overlap),
                  check_replicated_grads=None)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with record_into(Clock(torch.device("cpu"))) as clock:
        model.loss(ids, ids.roll(-1, 1)).backward()
    counts = {}
    for span in clock.finish():
        if span["row"] == "comm":
            counts[span["kind"]] = counts.get(span["kind"], 0) + 1
            assert span["end"] >= span["start"] and span["bytes"] > 0, span
    return counts


@pytest.mark.parametrize("overlap", [False, True], ids=["basic", "overlap"])
def test_timeline_sees_every_collective_of_the_model_vocabulary_and_norms_included(pools,
                                                                                  overlap):
    """Counted from the model's structure (L = 2 blocks, p = 2 ranks, no biases):
    the batch check AG; forward: embedding RS; per block qkv AG, proj RS, fc1 AG, fc2 RS; head
    AG; loss 2 AR (max, then the stacked sums). Backward: head AG + RS; final norm f AR; per
    block fc2 AG, fc1 AG + RS, mlp_norm AR, proj AG, qkv AG + RS, attn_norm AR; embedding AG.
    Overlapped, every layer's AG and RS become p - 1 ring steps each (the column backward has
    one ring of each), and the batch check's, the embedding's, the loss's and the norms' stay
    collectives."""
    L, p = 2, 2
    counts = pools(p).run(_on_rank_recorded_transfers, overlap)
    if overlap:
        columns, rows = 2 * L + 1, 2 * L
        expected = {"ring": (p - 1) * (3 * columns + 2 * rows), "reduce-scatter": 1,
                    "all-gather": 2, "all-reduce": 2 * L + 3}
    else:
        expected = {"reduce-scatter": 4 * L + 2, "all-gather": 6 * L + 4, "all-reduce": 2 * L + 3}
    for rank, got in enumerate(counts):
        assert got == expected, f"rank {rank}: recorded {got}, the model makes {expected}"


def test_profile_2d_dp2_tp2_trains_every_mode_to_the_baselines_losses(pools, tmp_path):
    """--dp 2 --tp 2 on the shared 4-rank pool: tp, tp_overlap and dtensor wrapped by FSDP2
    over two data-parallel halves of the batch, the baseline on the whole batch on one rank;
    the loss and gradient norm of every step agree, and the run is recorded as 2 x 2."""
    flags = [*TINY, "--dp", "2", "--tp", "2", "--out", str(tmp_path)]  # bench, timeline skipped
    args = profile.parse_args(flags, env={})
    args.argv = flags
    results = phases.run_phases(phases.PoolRunner(pools(4)), args)
    meta = results["meta"]
    assert (meta["dp"], meta["tp"], meta["world_size"]) == (2, 2, 4), meta
    assert "overlap_benchmark" not in results and "timeline" not in results, list(results)
    assert "memory_tp_no_sp" not in results, list(results)  # one TP group: --dp 1 only
    # tp_halves bypasses the blocks' forward, where FSDP2 gathers their weights: 1-D only.
    assert list(results["modes"]) == [m for m in MODELS["default"]["modes"] if m != "tp_halves"]
    for mode, d in results["modes"].items():
        if mode == "baseline":
            assert len(d["memory_per_rank"]) == 1, d["memory_per_rank"]
            continue
        assert len(d["memory_per_rank"]) == 4, (mode, d["memory_per_rank"])
        assert max(d["loss_rel_err_vs_baseline"]) <= 1e-4, (mode, d["loss_rel_err_vs_baseline"])
        assert max(d["grad_norm_rel_err_vs_baseline"]) <= 1e-4, \
            (mode, d["grad_norm_rel_err_vs_baseline"])
        assert d["loss_spread_across_ranks"] <= 1e-6 * abs(d["loss"][0]), (mode, d)
    # FSDP2 keeps 1/dp of each TP shard of the parameters on a rank.
    param_bytes = {m: results["modes"][m]["memory_per_rank"][0]["param_bytes"]
                   for m in ("baseline", "tp")}
    assert param_bytes["tp"] * 4 <= param_bytes["baseline"] * 1.05, param_bytes
    assert "DP=2 (FSDP2) x TP=2" in phases.report.summary_text(
        {**results, "targets": []}), "summary header"


@pytest.mark.parametrize("dp", [1, 2], ids=["tp2", "dp2xtp2"])
def test_profile_llama_runs_pytorchs_plan_on_the_hugging_face_model_from_the_same_weights(
        pools, tmp_path, dp):
    """--model llama: our SwiGLU Transformer in every mode, and hf_dtensor, a Hugging Face
    LlamaForCausalLM holding the baseline's converted weights under PyTorch's plan (padded:
    seq 15 is odd; grouped-query attention); each step's loss and grad norm equal the
    baseline's. With --dp 2 every TP mode is FSDP2-wrapped over two halves of the batch."""
    flags = [*TINY, "--model", "llama", "--seq", "15", "--kv-heads", "2", "--dp", str(dp),
             "--bench-iters", "0", "--timeline-iters", "0", "--out", str(tmp_path)]
    args = profile.parse_args(flags, env={})
    args.argv = flags
    results = phases.run_phases(phases.PoolRunner(pools(2 * dp)), args)
    assert results["config"]["model"]["mlp"] == "swiglu", results["config"]["model"]
    assert results["config"]["run"]["model"] == "llama", results["config"]["run"]
    assert "memory_tp_no_sp" not in results, list(results)  # SwiGLU: not two nn.Linear
    # tp_halves: 1-D only, left out of the default modes with --dp 2 (flags._check_halves).
    assert list(results["modes"]) == ["baseline", "tp", "tp_overlap"] + (
        ["tp_halves"] if dp == 1 else []) + ["hf_dtensor"], list(results["modes"])
    for mode, d in results["modes"].items():
        if mode != "baseline":
            assert max(d["loss_rel_err_vs_baseline"]) <= 1e-4, (mode, d["loss_rel_err_vs_baseline"])
            assert max(d["grad_norm_rel_err_vs_baseline"]) <= 1e-4, \
                (mode, d["grad_norm_rel_err_vs_baseline"])
    assert {"tp_overlap/hf_dtensor", "tp/hf_dtensor"} <= set(results["ratios"]), results["ratios"]


def _on_rank_calibrate():
    """The overlap benchmark's calibration (skipped by the smoke test's --bench-shape)."""
    import torch.distributed as dist

    from tensor_parallel_toy.launcher.initialize import current_device
    from tensor_parallel_toy.profiling.measure.bench_overlap import choose_ffn
    return choose_ffn(16, 2, 32, dist.group.WORLD, current_device(), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_calibration_communicates_through_comm_on_the_group_device(pools, backend):
    per_rank = pools(2, backend).run(guarded_call, _on_rank_calibrate)
    violations = [line for _, found in per_rank for line in found]
    assert not violations, "\n".join(violations)
    ffn = [f for f, _ in per_rank]
    assert ffn[0] == ffn[1] and ffn[0] % 16 == 0, ffn  # one m for all ranks, a multiple of 8p


def test_nccl_kernel_time_counts_only_nccl_kernels():
    kernels = [("ncclDevKernel_SendRecv(ncclDevKernelArgs)", 5.0), ("sm90_xmma_gemm_bf16", 100.0),
               ("ncclKernel_AllGather_RING_LL_Sum_int8_t", 2.5), ("elementwise_kernel", 1.0)]
    assert nccl_kernel_us(kernels) == 7.5
