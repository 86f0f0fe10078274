"""2D parallelism on 4 ranks, a 2 x 2 (data parallel x tensor parallel) grid: the loss and
every gradient equal the baseline's on the whole batch."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensor_parallel_toy import ModelConfig, Transformer
from tensor_parallel_toy.comm import all_reduce_
from tensor_parallel_toy.data_parallel import (average_gradients, data_parallel_loss,
                                               destroy_mesh_2d, init_mesh_2d, split_batch)
from tensor_parallel_toy.sharding import grad_norm

from .helpers import (MODEL_FP32_TOL, assert_errors, max_rel_error, random_batch,
                      value_error_messages)

CONFIG = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=12,
                     ffn_hidden_size=96, max_seq_len=32, num_kv_heads=2)
GLOBAL_BATCH = 4


def _on_rank_2d(overlap, seq, steps=2):
    mesh = init_mesh_2d(dp_size=2, tp_size=2)
    base = Transformer(CONFIG, seed=0)
    model = Transformer(CONFIG, tp_group=mesh.tp_group, overlap=overlap, seed=0)
    opt_base = torch.optim.SGD(base.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    base_params = dict(base.named_parameters())
    errors = {"#grads": 0}
    note = lambda key, value: errors.__setitem__(key, max(errors.get(key, 0.0), value))  # noqa
    for step in range(steps):
        # The ignored labels fall unevenly on the two DP halves: the loss must still be the
        # mean over the whole batch's counted tokens, not the mean of the two halves' means.
        ids, labels = random_batch(CONFIG, GLOBAL_BATCH, seq, seed=step, ignore_frac=0.4)
        labels[:GLOBAL_BATCH // 2, : seq // 2] = -100
        loss_base = F.cross_entropy(base(ids).flatten(0, 1), labels.flatten())
        loss_base.backward()

        loss = data_parallel_loss(model, split_batch(ids, mesh.dp_group),
                                  split_batch(labels, mesh.dp_group), mesh.dp_group)
        loss.backward()
        average_gradients(model, mesh.dp_group)
        whole_batch_loss = all_reduce_(loss.detach().clone(), mesh.dp_group) / mesh.dp_size
        note("loss", max_rel_error(whole_batch_loss, loss_base))
        grads = model.full_grads()  # gathered over the TP group
        errors["#grads"] = len(grads)
        for name, grad in grads.items():
            note("grad:" + name, max_rel_error(grad, base_params[name].grad))
        base_norm = torch.nn.utils.get_total_norm([p.grad for p in base.parameters()])
        note("grad_norm", max_rel_error(torch.tensor(grad_norm(model, mesh.tp_group)), base_norm))
        opt_base.step(), opt.step()
        opt_base.zero_grad(), opt.zero_grad()
    for name, value in model.full_state_dict().items():
        note("param:" + name, max_rel_error(value, base_params[name]))
    destroy_mesh_2d(mesh)
    return errors


@pytest.mark.parametrize("overlap,seq", [(False, 8), (True, 7)], ids=["basic-seq8", "overlap-seq7"])
def test_2x2_data_x_tensor_parallel_matches_baseline_on_the_whole_batch(pools, overlap, seq):
    per_rank = pools(4).run(_on_rank_2d, overlap, seq)
    counts = {errors.pop("#grads") for errors in per_rank}
    n_params = len(dict(Transformer(CONFIG).named_parameters()))
    assert counts == {n_params}, f"compared {counts} gradients, the model has {n_params}"
    assert_errors(per_rank, MODEL_FP32_TOL, f"2x2 dp x tp, overlap={overlap}, seq={seq}")


def _on_rank_bad_mesh():
    return value_error_messages({
        "mesh": lambda: init_mesh_2d(dp_size=3, tp_size=2),
        "batch": lambda: split_batch(torch.zeros(3, 4), dist.group.WORLD)})


def test_bad_mesh_or_batch_size_raises_one_clear_error(pools):
    messages = pools(4).run(_on_rank_bad_mesh)[0]
    assert messages["mesh"] and "dp_size=3 x tp_size=2 = 6" in messages["mesh"] \
        and "has 4" in messages["mesh"], messages
    assert messages["batch"] and "batch size 3" in messages["batch"] \
        and "data-parallel size 4" in messages["batch"], messages
