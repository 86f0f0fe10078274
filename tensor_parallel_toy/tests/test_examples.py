"""The examples run as a reader would run them, and check what they claim. (`train_tp`, the
README's training script, is run from a copy of the README's block: test_readme.py.)"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


BACKGROUND = {
    "try_it": lambda folder: dict(
        argv=[sys.executable, "-m", "tensor_parallel_toy.examples.try_it"], cwd=ROOT),
    "hf_any_tp": lambda folder: dict(
        argv=[sys.executable, "-m", "tensor_parallel_toy.examples.hf_any_tp"], cwd=ROOT),
}


@pytest.mark.background("try_it")
def test_try_it_checks_a_column_layer_against_f_linear_on_two_ranks(background):
    code, out, err = background.result("try_it")
    assert code == 0, out + err
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r}: output, dX and dW equal F.linear's" for r in range(2)], out + err


@pytest.mark.background("hf_any_tp")
def test_hf_any_tp_splits_phi3_by_its_own_plan_and_prints_what_it_upgraded(background):
    """As a reader runs it (Phi-3 by default): the fused projections transformers' plan gathers
    are printed split by their layout, and the loss and every gradient equal one device's."""
    code, out, err = background.result("hf_any_tp")
    assert code == 0, out + err
    assert any("self_attn.qkv_proj" in line and "colwise_gather_output" in line and
               "ColwiseParallel(output_sizes=(64, 32, 32))" in line
               for line in out.splitlines()), out + err
    assert any(line.startswith("loss and all 15 gradients equal one device's")
               for line in out.splitlines()), out + err


def test_finetune_hf_trains_a_checkpoint_on_two_ranks_and_writes_it_back(pools, tmp_path, capsys):
    """The example's whole path but the launcher (the suite's 2-rank pool stands in for it):
    a tiny Llama 3.2-like model, trained 3 steps with TP + SP, saved with save_pretrained, and
    reloaded by transformers with the TP model's logits."""
    from tensor_parallel_toy.examples import finetune_hf

    out = tmp_path / "tuned"
    finetune_hf.main(["--family", "llama", "--steps", "3", "--batch", "2", "--seq", "16",
                      "--overlap", "--out", str(out)], pool=pools(2))
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("reloaded with transformers: its logits equal the TP model's")
               for line in lines), lines
    losses = [float(x) for x in lines[0].split(":")[1].split()]
    assert len(losses) == 3 and losses[-1] < losses[0], lines
    assert (out / "config.json").exists() and (out / "model.safetensors").exists(), \
        sorted(p.name for p in out.iterdir())


def test_hf_any_tp_splits_olmo2_by_heads_with_its_q_k_norm_over_split_features(pools):
    """The example's rank function for OLMo 2 on the suite's 2-rank pool (after finetune_hf,
    whose ranks have imported transformers' model code already): q/k/v split by heads,
    q_norm and k_norm upgraded to NormOverSplit, every gradient equal to one device's."""
    from tensor_parallel_toy.examples import hf_any_tp

    for r, result in enumerate(pools(2).run(hf_any_tp.run_rank, "olmo2")):
        upgraded = {key.rpartition(".")[2]: style for key, _, style in result["upgrades"]}
        assert upgraded == {"q_proj": "ColwiseParallel()", "k_proj": "ColwiseParallel()",
                            "v_proj": "ColwiseParallel()", "q_norm": "NormOverSplit()",
                            "k_norm": "NormOverSplit()",
                            "o_proj": "RowwiseParallel(output_layouts=Shard(dim=1))"}, (r, result)
        assert result["report"].ok, (r, str(result["report"]))


def test_own_model_tp_output_and_every_gradient_equal_the_one_device_models(pools):
    from tensor_parallel_toy.examples import own_model_tp

    for r, result in enumerate(pools(2).run(own_model_tp.run_rank)):
        assert max(result.values()) <= own_model_tp.TOL, (r, result)


def test_fsdp_tp_2d_losses_equal_the_one_device_models_on_a_2x2_grid(pools):
    from tensor_parallel_toy.examples import fsdp_tp_2d

    for r, result in enumerate(pools(4).run(fsdp_tp_2d.run_rank)):
        diff = max(abs(a - b) for a, b in zip(result["2d"], result["one_device"]))
        assert len(result["2d"]) == fsdp_tp_2d.STEPS and diff <= fsdp_tp_2d.TOL, (r, result)


def test_generate_tp_generates_the_same_tokens_under_tp_as_on_one_device(pools):
    """The example's rank function on the suite's 2-rank pool, trained 3 steps: greedy and
    sampled tokens under TP equal one device's with the same weights, after the prompts."""
    from tensor_parallel_toy.examples import generate_tp

    ids, _ = generate_tp.encode(generate_tp.PROMPTS)
    for r, out in enumerate(pools(2).run(generate_tp.run_rank, 3, 8)):
        for name in ("greedy", "sampled"):
            tp_tokens, one_tokens = out[name]
            assert tp_tokens.shape == (len(generate_tp.PROMPTS), ids.shape[1] + 8), name
            assert torch.equal(tp_tokens[:, :ids.shape[1]], ids), (r, name)
            assert torch.equal(tp_tokens, one_tokens), (r, name, tp_tokens, one_tokens)
        assert not torch.equal(out["greedy"][0], out["sampled"][0]), "nothing was sampled"


def _device_problems(folder):
    """One line per example that starts ranks (`launch`) but never asks where its rank computes
    (`current_device()`), or talks to torch.distributed itself: on a box with a GPU per rank
    `launch` picks NCCL, and a CPU model or batch fails at the first collective ("No backend
    type associated with device type cpu"). On the CPU the two are the same device, so this is
    read from the source (gpu-check runs the examples under NCCL)."""
    import ast

    problems = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py") or name == "__init__.py":
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        called = {node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                  for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, (ast.Name, ast.Attribute))}
        direct = sorted(f"dist.{node.func.attr}" for node in ast.walk(tree)
                        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                        and node.func.attr in ("all_reduce", "broadcast", "all_gather",
                                               "reduce_scatter", "send", "recv"))
        if "launch" in called and "current_device" not in called:
            problems.append(f"{name}: starts ranks but never calls current_device()")
        problems += [f"{name}: calls {d} itself" for d in direct]
    return problems


def test_every_example_computes_on_its_ranks_device():
    problems = _device_problems(os.path.join(ROOT, "tensor_parallel_toy", "examples"))
    assert not problems, "\n".join(problems)


def test_the_device_rule_catches_an_example_built_on_the_cpu(tmp_path):
    source = os.path.join(ROOT, "tensor_parallel_toy", "examples", "train_tp.py")
    with open(source, encoding="utf-8") as f:
        text = f.read()
    (tmp_path / "train_tp.py").write_text(text.replace("current_device()", "torch.device('cpu')"))
    assert _device_problems(str(tmp_path)) == [
        "train_tp.py: starts ranks but never calls current_device()"]
