"""The replicated-gradient guard (replicated_grads.py) fires on the trap and only on it.

The trap: a replicated weight applied to each rank's part of the data (its tokens, its heads)
whose gradient is never summed over the TP group. Two instances, each built by removing the
sum from a correct model, at TP 2:
- Qwen3 under PyTorch's DTensor plan with the q/k-norm entries left out of the plan (applied
  with `parallelize_module` directly, since `parallelize_hf_model` refuses such a plan);
- our Transformer with the norms' `f` (`copy_to_tensor_parallel_region` in RMSNorm) replaced
  by the identity;
and a third, on the classic-TP door with its default options: a block's own scalar gain applied
to the split hidden features between its column and row layer.
On every rank the first backward raises, naming the first parameter whose ranks disagree. The
correct models (ours with q/k norms, classic TP on a model of one's own, Qwen3 and Llama under
the DTensor plan, before and after `reduce_partial_grads`) pass the same check, which really
compared their replicated parameters, along two steps.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensor_parallel_toy import guard
from tensor_parallel_toy.config import ModelConfig

from .helpers import (CONFIG, draw_norms_and_biases_, fixed_batch, mesh_2x2,
                      value_error_messages)

QK_CONFIG = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden_size=96, max_seq_len=32, mlp="swiglu",
                        qk_norm=True)


def _tiny_qwen3():
    """A random Qwen3ForCausalLM (q/k norms drawn away from ones), the same on every rank."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      vocab_size=128, max_position_embeddings=64)
    return draw_norms_and_biases_(transformers.Qwen3ForCausalLM(config).eval())  # no biases


def _error_of(fn):
    """The guard's message from running `fn`, or None; then a barrier (no rank left behind)."""
    from tensor_parallel_toy.guards.replicated_grads import ReplicatedGradientsDisagreeError

    try:
        fn()
        message = None
    except ReplicatedGradientsDisagreeError as e:
        message = str(e)
    dist.barrier()
    return message


def _hf_step(model, seed=3):
    from tensor_parallel_toy.interop import dtensor_tp

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 12), generator=gen)
    labels = torch.randint(0, 128, (2, 12), generator=gen)
    return dtensor_tp.hf_loss_and_backward(model, ids, labels)


def _on_rank_broken():
    """Both instances of the trap, each with the guard on: the message of each, per rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tensor_parallel_toy import model as model_module
    from tensor_parallel_toy.interop import dtensor_tp
    from tensor_parallel_toy.model import Transformer
    from tensor_parallel_toy.guards.replicated_grads import watch_replicated_gradients

    group = dist.group.WORLD
    qwen = _tiny_qwen3()
    plan = {k: v for k, v in dtensor_tp.dtensor_plan(qwen.config).items()
            if not k.endswith(("q_norm", "k_norm"))}
    parallelize_module(qwen, DeviceMesh.from_group(group, "cpu"), plan)
    watch_replicated_gradients(qwen, group, "first")
    messages = {"qwen3 without q/k-norm plan": _error_of(lambda: _hf_step(qwen))}

    identity = lambda x, group: x  # noqa: E731: the norm weight's f, without its all-reduce
    original = model_module.copy_to_tensor_parallel_region
    model_module.copy_to_tensor_parallel_region = identity
    try:
        ours = guard(Transformer(CONFIG, tp_group=group, seed=0), check_replicated_grads="first")
        ids, labels = fixed_batch()
        messages["ours without the norm's f"] = _error_of(lambda: ours(ids, labels).backward())
    finally:
        model_module.copy_to_tensor_parallel_region = original
    return messages


def test_the_guard_fires_on_every_rank_naming_the_first_replicated_parameter(pools):
    pytest.importorskip("transformers")
    expected = {"qwen3 without q/k-norm plan": "'model.layers.0.self_attn.q_norm.weight'",
                "ours without the norm's f": "'layers.0.attn_norm.weight'"}
    per_rank = pools(2).run(_on_rank_broken)
    for rank, messages in enumerate(per_rank):
        for case, name in expected.items():
            message = messages[case]
            assert message is not None, f"rank {rank}, {case}: the guard did not fire"
            assert name in message and "different gradients" in message and "\n" not in message, (
                f"rank {rank}, {case}: {message!r} does not name {name} in one line")


def _on_rank_correct():
    """The correct models along two steps with the guard checking every backward: how many
    replicated parameters each check compared (a guard that compares nothing proves nothing)."""
    import copy

    from torch.distributed.device_mesh import DeviceMesh

    from tensor_parallel_toy.interop import dtensor_tp
    from tensor_parallel_toy.apply.classic_tp import apply_tensor_parallel, sync_replicated_gradients
    from tensor_parallel_toy.examples.own_model_tp import MyModel
    from tensor_parallel_toy.model import Transformer
    from tensor_parallel_toy.guards.replicated_grads import check_replicated_gradients

    group = dist.group.WORLD
    compared = {}
    ours = guard(Transformer(QK_CONFIG, tp_group=group, seed=0), check_replicated_grads=1)
    torch.manual_seed(0)
    classic = apply_tensor_parallel(copy.deepcopy(MyModel()), group, check_replicated_grads=1)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    qwen = dtensor_tp.parallelize_hf_model(_tiny_qwen3(), DeviceMesh.from_group(group, "cpu"),
                                           check_replicated_grads=1)
    for step in range(2):
        ids, labels = fixed_batch(seed=step)
        ours(ids, labels).backward()
        F.cross_entropy(classic(x), y).backward()
        sync_replicated_gradients(classic, group)
        _hf_step(qwen, seed=step)
        compared[f"qwen3 partial, step {step}"] = check_replicated_gradients(qwen, group)
        dtensor_tp.reduce_partial_grads(qwen)
        compared[f"qwen3 reduced, step {step}"] = check_replicated_gradients(qwen, group)
        for model in (ours, classic, qwen):
            for param in model.parameters():
                param.grad = None
    for name, model in (("ours", ours), ("classic", classic), ("qwen3", qwen)):
        guards = getattr(model, "guards", None)  # guard()'s, or the DTensor plan's own watch
        watch = guards.replicated_grads_watch if guards else model.replicated_grads_watch
        compared[name] = (watch.checks, watch.compared)
    return compared


def test_the_guard_is_silent_on_correct_models_and_compares_their_replicated_weights(pools):
    pytest.importorskip("transformers")
    for compared in pools(2).run(_on_rank_correct):
        # (checks run, replicated parameters compared): ours 2 layers x (2 norms + q/k norms)
        # + the final norm; classic TP 2 LayerNorms' weight and bias, 2 row biases, the head's
        # weight and bias; Qwen3 under the DTensor plan none (every replicated gradient is
        # Partial at the end of backward, which DTensor sums when it is read).
        assert compared["ours"] == (2, 9) and compared["classic"] == (2, 8), compared
        assert compared["qwen3"] == (2, 0), compared
        for step in range(2):
            # Before the reduction every replicated weight's gradient is Partial (left to
            # DTensor); after it, 2 layers x 4 norms + the final norm are compared.
            assert compared[f"qwen3 partial, step {step}"] == 0, compared
            assert compared[f"qwen3 reduced, step {step}"] == 9, compared


def _on_rank_different_options():
    """Rank 0 asks for the guard, rank 1 does not: refused at construction, on every rank (a
    guard on one rank only would leave it alone in the check's collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    from tensor_parallel_toy.interop import dtensor_tp
    from tensor_parallel_toy.apply.classic_tp import apply_tensor_parallel
    from tensor_parallel_toy.model import Transformer

    class _FeedForward(torch.nn.Module):
        tp_column, tp_row = "up", "down"

        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    group = dist.group.WORLD
    option = "first" if dist.get_rank() == 0 else None
    builders = {"ours": lambda: guard(Transformer(CONFIG, tp_group=group), check_replicated_grads=option),
                "hf": lambda: dtensor_tp.parallelize_hf_model(
                    _tiny_qwen3(), DeviceMesh.from_group(group, "cpu"),
                    check_replicated_grads=option),
                "dtensor": lambda: dtensor_tp.parallelize_transformer(
                    Transformer(CONFIG), group, check_replicated_grads=option),
                "classic": lambda: apply_tensor_parallel(
                    _FeedForward(), group, check_replicated_grads=option)}
    return value_error_messages(builders)  # RanksDisagreeError is a ValueError


def test_ranks_asking_for_different_guards_are_refused_at_construction(pools):
    pytest.importorskip("transformers")
    for messages in pools(2).run(_on_rank_different_options):
        for name, message in messages.items():
            assert message is not None and "check_replicated_grads: first on rank 0, None on " \
                "rank 1" in message, f"{name}: {message!r}"


def _on_rank_classic_trap():
    """Classic TP with its default options, on a block whose own scalar gain multiplies the
    split hidden features between its column and row layer: the preset keeps the gain whole
    (NoParallel), each rank's gradient of it sums over its own features only."""
    import torch.nn as nn

    from tensor_parallel_toy.apply.classic_tp import apply_tensor_parallel

    class GainedFeedForward(nn.Module):
        tp_column, tp_row = "up", "down"

        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.gain = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.down(self.gain * F.gelu(self.up(x)))  # gain on [..., 16/p]

    torch.manual_seed(0)
    model = apply_tensor_parallel(nn.Sequential(nn.Linear(4, 8), GainedFeedForward()),
                                  dist.group.WORLD)
    x = torch.randn(2, 3, 4)
    return _error_of(lambda: model(x).square().sum().backward())


def test_classic_tp_catches_a_weight_between_its_split_layers_by_default(pools):
    for rank, message in enumerate(pools(2).run(_on_rank_classic_trap)):
        assert message is not None, f"rank {rank}: the default guard did not fire"
        assert "'1.gain'" in message and "different gradients" in message and \
            "\n" not in message, f"rank {rank}: {message!r}"


def _on_rank_non_finite():
    """A replicated weight whose gradient overflowed (an inf): the same on both ranks is no
    disagreement (a loss scaler skips such a step); on one rank only it is, named as such."""
    import torch.nn as nn

    from tensor_parallel_toy.guards.replicated_grads import check_replicated_gradients

    group, rank = dist.group.WORLD, dist.get_rank()
    norm = nn.LayerNorm(4)
    out = {}
    for case, grads in {"both": ([1.0, float("inf"), 2.0, 3.0],) * 2,
                        "rank 1": ([1.0, 5.0, 2.0, 3.0], [1.0, float("inf"), 2.0, 3.0])}.items():
        norm.weight.grad = torch.tensor(grads[rank])
        norm.bias.grad = torch.ones(4)
        out[case] = _error_of(lambda: out.setdefault(f"{case} compared",
                                                     check_replicated_gradients(norm, group)))
    return out


def test_an_overflowed_gradient_is_told_apart_from_a_partial_one(pools):
    for out in pools(2).run(_on_rank_non_finite):
        assert out["both"] is None and out["both compared"] == 2, out
        assert out["rank 1"] is not None and "'weight'" in out["rank 1"] and \
            "a non-finite gradient on rank 1" in out["rank 1"], out


def _on_rank_fsdp():
    """Our model under FSDP2 over a 2 x 2 grid, the check called after backward, with and
    without the norms' `f`: (parameters compared or None, the message or None)."""
    from tensor_parallel_toy import model as model_module
    from tensor_parallel_toy.interop.data_parallel import apply_fsdp, data_parallel_loss, split_batch
    from tensor_parallel_toy.model import Transformer
    from tensor_parallel_toy.guards.replicated_grads import (ReplicatedGradientsDisagreeError,
                                                      check_replicated_gradients)

    mesh = mesh_2x2()
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()
    ids, labels = fixed_batch()
    ids, labels = split_batch(ids, dp), split_batch(labels, dp)
    original, out = model_module.copy_to_tensor_parallel_region, {}
    for case in ("correct", "without f"):
        if case == "without f":
            model_module.copy_to_tensor_parallel_region = lambda x, group: x
        try:
            model = apply_fsdp(Transformer(CONFIG, tp_group=tp, seed=0), mesh)
            data_parallel_loss(model, ids, labels, dp).backward()
            out[case] = (check_replicated_gradients(model, tp), None)
        except ReplicatedGradientsDisagreeError as e:
            out[case] = (None, str(e))
        finally:
            model_module.copy_to_tensor_parallel_region = original
    dist.barrier()
    return out


def test_the_check_after_backward_compares_fsdp2_shards_over_tp(pools):
    """Under FSDP2 each TP rank of a data-parallel coordinate holds the same shard of a norm
    weight: the check compares those shards, silent when right, firing without the `f`."""
    for out in pools(4).run(_on_rank_fsdp):
        assert out["correct"] == (5, None), out
        assert out["without f"][1] is not None and "'layers.0.attn_norm.weight'" in \
            out["without f"][1], out
