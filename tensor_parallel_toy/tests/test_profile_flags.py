"""The profile's command line: every bad flag is one line and exit status 2, in process and as a
real command (before any rank starts); the flags' defaults are ProfileSpec's; under torchrun the
grid must match the world.
"""
import os
import sys

import pytest
import torch

from tensor_parallel_toy.profiling import cli as profile


@pytest.mark.parametrize("flags, words", [
    (["--tp", "3"], ["hidden_size=256", "size 3"]),
    (["--dtype", "fp16"], ["--dtype", "fp32, bf16"]),
    (["--seq", "127"], ["sequence length 127", "--seq 128"]),
    (["--kv-heads", "3"], ["num_kv_heads=3"]),
    (["--kv-heads", "1", "--tp", "2"], ["num_kv_heads=1 < TP size 2"]),
    (["--tie-embeddings"], ["tie_embeddings=True"]),
    (["--steps", "3", "--warmup", "2"], ["--steps 3", "--warmup 2"]),
    (["--vocab", "64"], ["--vocab 64", "128"]),
    (["--device", "tpu"], ["--device 'tpu'"]),
    (["--modes", "tp,nope"], ["--modes", "dtensor"]),
    (["--bench-shape", "15,2,32,64"], ["S=15", "TP size 2"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--stpes", "3"], ["--stpes", "did you mean --steps for --stpes?"]),
    (["--tp", "3"], ["hidden_size=256, num_heads=8, ffn_hidden_size=1024 are", "size 3",
                     "[2, 4, 8]"]),
    # The hand-written modes pad any vocabulary; the dtensor mode (in the default modes) not.
    (["--vocab", "257"], ["vocab_size=257", "size 2", "does not pad"]),
    (["--timeout", "0"], ["--timeout 0", "positive number of seconds"]),
    (["--tp", "65"], ["--tp 65", "between 2 and 64"]),
    (["--steps", "0"], ["--steps 0"]),
    (["--steps", "-5"], ["--steps -5"]),
    (["--batch", "0"], ["--batch 0", "at least 1"]),
    (["--seq", "-1"], ["--seq -1", "at least 1"]),
    (["--dp", "0"], ["--dp 0", "between 1 and 64"]),
    (["--dp", "2", "--batch", "3"], ["--batch 3", "--dp 2", "--batch 4"]),
    (["--dp", "2", "--tp", "3"], ["hidden_size=256", "size 3"]),
    (["--model", "gpt"], ["--model 'gpt'", "default, llama"]),
    (["--modes", "tp,tp_halves", "--batch", "1"], ["--batch 1", "--batch 2 or more"]),
    (["--modes", "tp_halves", "--dp", "2"], ["--modes tp_halves", "--dp 2", "--dp 1"]),
    (["--modes", "tp,hf_dtensor"], ["baseline, tp, tp_overlap, tp_halves, dtensor",
                                    "hf_dtensor needs --model llama"]),
    (["--model", "llama", "--modes", "dtensor"], ["hf_dtensor", "dtensor needs --model default"]),
    (["--model", "llama", "--kv-heads", "1"], ["num_key_value_heads=1", "size 2"]),
    (["--model", "llama", "--tie-embeddings"], ["tie_word_embeddings=True"]),
    (["--device", "cpu", "--nccl-high-priority"], ["--nccl-high-priority", "gloo",
                                                    "--device cuda"]),
    (["--check-replicated-grads", "0"], ["--check-replicated-grads '0'", "first", "off"]),
    (["--link", "model:fast"], ["--link 'model:fast'", "model:1gbit"]),
    (["--link", "model:1gbit:5s"], ["--link 'model:1gbit:5s'", "model:4gbit:50us"]),
    (["--link", "model:1gbit", "--modes", "tp,dtensor"], ["dtensor", "modeled wire"]),
    (["--link", "model:1gbit", "--device", "cuda"], ["model:1gbit", "--device cuda"]),
    (["--link", "model:1gbit", "--dp", "2", "--batch", "4"], ["model:1gbit", "--dp 2", "--dp 1"]),
    (["--ring-pieces", "3"], ["--ring-pieces 3", "64 sequence rows", "multiple of 6"]),
    (["--ring-pieces", "0"], ["--ring-pieces 0", "between 1 and 64"]),
])
def test_bad_flags_are_one_line_and_exit_status_2(flags, words, capsys, tmp_path):
    code = profile.main([*flags, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err


# Each real command costs a Python start and a torch import (~3 s on 2 cores): a few, one per
# kind of check (a range, the output folder, the device), started together; the in-process test
# covers the rest.
REAL_BAD_FLAGS = [
    (["--tp", "0"], ["--tp 0", "between 2 and 64"]),
    (["--out", "/proc/no/such/folder"], ["--out '/proc/no/such/folder'", "cannot create"]),
] + ([(["--device", "cuda"], ["--device cuda", "no CUDA device"])]
     if not torch.cuda.is_available() else [])


def _bad_flags_command(i):
    def start(folder):
        flags = REAL_BAD_FLAGS[i][0]
        out = ["--out", os.path.join(folder, f"bad-flags-{i}")] if "--out" not in flags else []
        return dict(argv=[sys.executable, "-m", "tensor_parallel_toy", "profile", *flags, *out])
    return start


# Started with the session (conftest.py).
BACKGROUND = {f"bad flags {i}": _bad_flags_command(i) for i in range(len(REAL_BAD_FLAGS))}


@pytest.mark.background(*(f"bad flags {i}" for i in range(len(REAL_BAD_FLAGS))))
def test_bad_flags_exit_2_with_one_line_before_any_rank_starts(background):
    """As a real command: exit status 2, one line on stderr, no traceback, nothing spawned."""
    for i, (flags, words) in enumerate(REAL_BAD_FLAGS):
        code, printed, err = background.result(f"bad flags {i}", timeout=60)
        err = err.strip()
        assert code == 2, (flags, code, err)
        assert "\n" not in err and "Traceback" not in err and "spawning" not in printed, err
        assert all(w in err for w in words), (flags, err)


def test_out_folder_that_is_a_file_is_rejected(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert profile.main(["--out", str(blocker)]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_every_default_is_the_spec_default(tmp_path):
    """The flags' defaults are read from ProfileSpec, and the spec the ranks get carries the
    flags: one set of defaults, nowhere else to drift (bench iterations once said 30 in one
    place and 60 in another)."""
    from tensor_parallel_toy.profiling.spec import MODEL_DEFAULTS, ProfileSpec

    default = ProfileSpec()
    out = ["--out", str(tmp_path)]
    spec = profile.parse_args(out, env={}).spec
    for field in ("tp", "steps", "warmup", "batch", "seq", "lr", "dtype", "seed", "modes",
                  "threads", "bench_iters", "bench_warmup", "bench_shape", "timeline_iters",
                  "trace_dir", "check_replicated_grads"):
        assert getattr(spec, field) == getattr(default, field), field
    assert spec.config == default.config
    assert {k: getattr(spec.config, k) for k in MODEL_DEFAULTS} == MODEL_DEFAULTS
    changed = profile.parse_args(["--bench-iters", "7", "--timeline-iters", "0", "--seq", "64",
                                  "--modes", "tp,baseline", *out], env={}).spec
    assert (changed.bench_iters, changed.timeline_iters, changed.seq, changed.modes) == \
        (7, 0, 64, ("baseline", "tp")), changed
    guards = [profile.parse_args(["--check-replicated-grads", flag, *out], env={}).spec
              .check_replicated_grads for flag in ("first", "off", "3")]
    assert guards == ["first", None, 3], guards


@pytest.mark.parametrize("flags, world, words", [
    (["--dp", "3"], 4, ["--dp 3 x --tp 1 = 3 ranks", "world size 4"]),
    (["--dp", "2", "--tp", "4"], 4, ["--dp 2 x --tp 4 = 8 ranks", "world size 4"]),
    (["--tp", "2"], 4, ["--dp 1 x --tp 2 = 2 ranks", "world size 4"]),
])
def test_under_torchrun_dp_times_tp_must_be_the_world_size(flags, world, words, tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": str(world)}
    with pytest.raises(profile.UsageError) as info:
        profile.parse_args([*flags, "--out", str(tmp_path)], env=env)
    assert all(w in str(info.value) for w in words), str(info.value)
    args = profile.parse_args(["--dp", "2", "--out", str(tmp_path)], env=env)
    assert (args.spec.dp, args.spec.tp) == (2, 2), args.spec


def test_tp_halves_leaves_the_default_modes_where_it_cannot_run(tmp_path):
    """A batch of one row, or a 2-D run: the default modes go on without tp_halves."""
    for flags in (["--batch", "1"], ["--dp", "2", "--batch", "2"]):
        args = profile.parse_args([*flags, "--out", str(tmp_path)], env={})
        assert "tp_halves" not in args.modes and "tp" in args.modes, (flags, args.modes)
