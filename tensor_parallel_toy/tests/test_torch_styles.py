"""A plan written for PyTorch runs as written: PyTorch's own TP test model
(`common_dtensor.Transformer`), planned with PyTorch's own style objects and applied the way its
`Transformer.parallelize` applies them (the root's entries, then one call per block, then a bare
style on the output head, the tie made again by hand), equals one device: loss and every
gradient, SP on and off, overlap on and off, TP 2 (and with a vocabulary of 7, padded to 8, in
the tied embedding and the gathered head). And what cannot be carried out is refused in
one line on every rank: `use_local_output=False`, a PyTorch argument the package does not carry
out, a plan left incomplete after several calls.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel as tp
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from tensor_parallel_toy.apply import NoParallel, compare_with_one_device, parallelize_module

from .helpers import assert_one_line, value_error_messages

# Tiny: V and the heads divisible by 2; a tied head (PyTorch's default), no dropout.
ARGS = ModelArgs(n_layers=2, vocab_size=8, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)


def _parallelize(model, group, use_seq_parallel, overlap=False, skip=()):
    """PyTorch's `Transformer.parallelize(model, tp_mesh, use_seq_parallel,
    local_output_for_attn=True)`, line for line, with our parallelize_module and the group for
    the mesh. One addition: without SP the norms see the same data on every rank, which PyTorch
    leaves out of its plan and ours says (NoParallel), so that a norm forgotten under SP is
    caught. `skip`: calls left out (for the refusals)."""
    def call(module, plan):
        parallelize_module(module, group, plan, overlap=overlap)

    if use_seq_parallel:
        root_plan = {
            "tok_embeddings": tp.RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1)),
            "pos_embeddings": tp.RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(0)),
            "norm": tp.SequenceParallel(),
        }
    else:
        root_plan = {
            "tok_embeddings": tp.RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate()),
            "pos_embeddings": tp.RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate()),
            "norm": NoParallel(),
        }
    call(model, root_plan)
    for i, layer in enumerate(model.layers):
        if f"layers.{i}" in skip:
            continue
        plan = {}
        if use_seq_parallel:
            plan["attention"] = tp.PrepareModuleInput(input_layouts=Shard(1),
                                                      desired_input_layouts=Replicate())
            plan["attention_norm"] = tp.SequenceParallel()
            plan["ffn_norm"] = tp.SequenceParallel()
        else:
            plan["attention_norm"] = plan["ffn_norm"] = NoParallel()
        plan["attention.wq"] = tp.ColwiseParallel(use_local_output=True)
        plan["attention.wk"] = tp.ColwiseParallel(use_local_output=True)
        plan["attention.wv"] = tp.ColwiseParallel(use_local_output=True)
        plan["attention.wo"] = (tp.RowwiseParallel(output_layouts=Shard(1))
                                if use_seq_parallel else tp.RowwiseParallel())
        plan["feed_forward.w1"] = (tp.ColwiseParallel(input_layouts=Shard(1))
                                   if use_seq_parallel else tp.ColwiseParallel())
        plan["feed_forward.w2"] = (tp.RowwiseParallel(output_layouts=Shard(1))
                                   if use_seq_parallel else tp.RowwiseParallel())
        call(layer, plan)
    if "output" not in skip:
        call(model.output, tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
             if use_seq_parallel else tp.ColwiseParallel(output_layouts=Replicate()))
    for layer in model.layers:
        layer.attention.n_heads = model.model_args.n_heads // dist.get_world_size(group)
    if model.model_args.weight_tying and "tie" not in skip:
        model.output.weight = model.tok_embeddings.weight
    return model


def _batch(seed=0, vocab=ARGS.vocab_size):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (3, ARGS.max_seq_len), generator=gen),
            torch.randint(0, vocab, (3, ARGS.max_seq_len), generator=gen))


def _loss(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())


def _on_rank_equal_one_device(args, cases):
    reports = {}
    for sp, overlap in cases:
        report = compare_with_one_device(
            lambda: Transformer(args), lambda m, g: _parallelize(m, g, sp, overlap),
            _batch(vocab=args.vocab_size), _loss)
        reports[f"sp={sp} overlap={overlap}"] = (report.ok, len(report.errors), str(report))
    return reports


ODD_VOCAB = dataclasses.replace(ARGS, vocab_size=7)


@pytest.mark.parametrize("args,cases", [
    (ARGS, [(True, False), (True, True), (False, False), (False, True)]),
    (ODD_VOCAB, [(True, True), (False, False)])], ids=["vocab8", "vocab7-padded"])
def test_pytorchs_model_and_plan_equal_one_device_sp_and_overlap_on_and_off(pools, args, cases):
    # every parameter once (the tied head is the embedding's), plus the loss
    n = len(list(Transformer(args).parameters())) + 1
    for rank, reports in enumerate(pools(2).run(_on_rank_equal_one_device, args, cases)):
        for case, (ok, n_errors, text) in reports.items():
            assert ok and n_errors == n, f"rank {rank}, {case}:\n{text}"


# ----------------------------------------------------------------------------------------------
# Refusals: one line, on every rank, before any collective of the step
# ----------------------------------------------------------------------------------------------
def _on_rank_refusals():
    from tensor_parallel_toy.apply import ColwiseParallel

    group = dist.group.WORLD

    def build():
        torch.manual_seed(0)
        return Transformer(ARGS)

    def with_wq(style):
        def run():
            model = build()
            parallelize_module(model.layers[0], group, {"attention.wq": style})
        return run

    def incomplete(skip):
        def run():
            model = _parallelize(build(), group, True, skip=skip)
            _loss(model, _batch())
        return run

    def twice():
        model = _parallelize(build(), group, True)
        parallelize_module(model.layers[1], group, {"ffn_norm": tp.SequenceParallel()})

    moved = tp.ColwiseParallel()
    moved.desired_input_layouts = (Shard(1),)
    untied = dataclasses.replace(ARGS, weight_tying=False)
    cases = {
        "torch local output": with_wq(tp.ColwiseParallel(use_local_output=False)),
        "our local output": with_wq(ColwiseParallel(use_local_output=False)),
        "torch rowwise local output": lambda: parallelize_module(
            build().layers[0], group, {"attention.wo": tp.RowwiseParallel(use_local_output=False)}),
        "desired input": with_wq(moved),
        "input and output": with_wq(tp.PrepareModuleInputOutput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(),
            output_layouts=Replicate(), desired_output_layouts=Shard(1))),
        "embedding ids split": lambda: parallelize_module(
            build(), group, {"tok_embeddings": tp.RowwiseParallel()}),
        "block left out": incomplete({"layers.1"}),
        "tied head left out": incomplete({"output", "tie"}),
        "head left out": lambda: _loss(_parallelize(
            (torch.manual_seed(0), Transformer(untied))[1], group, True, skip={"output"}),
            _batch()),
        "planned twice": twice,
    }
    return value_error_messages(cases)


def test_what_is_not_carried_out_is_refused_in_one_line_on_every_rank(pools):
    words = {
        "torch local output": ["'attention.wq'", "use_local_output=False", "valid is True"],
        "our local output": ["'attention.wq'", "use_local_output=False", "valid is True"],
        "torch rowwise local output": ["'attention.wo'", "use_local_output=False",
                                       "valid is True"],
        "desired input": ["desired_input_layouts=(Shard(dim=1),)", "valid is (Replicate(),)"],
        "input and output": ["PrepareModuleInputOutput", "valid are ColwiseParallel"],
        "embedding ids split": ["'tok_embeddings'", "input_layouts=Shard(dim=-1)",
                                "Replicate()"],
        "block left out": ["'layers.1.attention_norm.weight'", "neither split nor kept whole"],
        "tied head left out": ["output.weight", "tied", "not split the same way"],
        "head left out": ["'output.weight'", "neither split nor kept whole"],
        "planned twice": ["'ffn_norm'", "planned already"],
    }
    for rank, messages in enumerate(pools(2).run(_on_rank_refusals)):
        assert set(messages) == set(words), messages
        for key, message in messages.items():
            assert_one_line(message, words[key], f"rank {rank}, {key}")


# ----------------------------------------------------------------------------------------------
# What one device refuses, or what would be a silently wrong number, raises on every rank
# ----------------------------------------------------------------------------------------------
def _on_rank_silent_results():
    """PyTorch's model split by PyTorch's plan (SP), as a user would: each case would return a
    number without the guards (a loss with the bad ids embedded as zeros, a loss of no batch,
    a norm trained on partial gradients); each must raise on every rank instead."""
    group, rank = dist.group.WORLD, dist.get_rank()

    def planned(sp_norms=True):
        torch.manual_seed(0)
        model = _parallelize(Transformer(ARGS), group, True)
        if not sp_norms:  # the norms see sequence shards; NoParallel says they see all of it
            torch.manual_seed(0)
            model = Transformer(ARGS)
            norms = {"norm": NoParallel()}
            parallelize_module(model, group, {
                "tok_embeddings": tp.RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Shard(1)),
                "pos_embeddings": tp.RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Shard(0)), **norms})
            for layer in model.layers:
                parallelize_module(layer, group, {
                    "attention": tp.PrepareModuleInput(input_layouts=Shard(1),
                                                       desired_input_layouts=Replicate()),
                    "attention_norm": NoParallel(), "ffn_norm": NoParallel(),
                    "attention.wq": tp.ColwiseParallel(), "attention.wk": tp.ColwiseParallel(),
                    "attention.wv": tp.ColwiseParallel(),
                    "attention.wo": tp.RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w1": tp.ColwiseParallel(input_layouts=Shard(1)),
                    "feed_forward.w2": tp.RowwiseParallel(output_layouts=Shard(1))})
                layer.attention.n_heads = ARGS.n_heads // 2
            parallelize_module(model.output, group, tp.ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Replicate()))
            model.output.weight = model.tok_embeddings.weight
        return model

    ids, labels = _batch()
    bad = ids.clone()
    bad[1, 3] = ARGS.vocab_size
    negative = ids.clone()
    negative[0, 0] = -1
    other = _batch(seed=1)[0] if rank == 1 else ids
    return value_error_messages({
        "id = vocabulary size": lambda: _loss(planned(), (bad, labels)),
        "id = -1": lambda: _loss(planned(), (negative, labels)),
        "batches differ": lambda: _loss(planned(), (other, labels)),
        "norm on sequence shards kept whole": lambda: _loss(planned(sp_norms=False),
                                                            (ids, labels)).backward(),
    })


def test_the_silent_results_of_a_planned_model_raise_on_every_rank(pools):
    """One device raises IndexError on an id outside the vocabulary; a split vocabulary would
    embed it as zeros. Ranks fed different batches would each return a loss of no batch. A norm
    marked NoParallel that sees sequence shards would train on partial gradients (caught at the
    first backward, by default). Each fails without `guard`, which parallelize_module ends with."""
    words = {
        "id = vocabulary size": [f"token id {ARGS.vocab_size} is out of range",
                                 f"0..{ARGS.vocab_size - 1}"],
        "id = -1": ["token id -1 is out of range"],
        "batches differ": ["different tokens", "on rank 0", "on rank 1"],
        "norm on sequence shards kept whole": ["replicated parameter", "norm.weight",
                                               "different gradients"],
    }
    for rank, messages in enumerate(pools(2).run(_on_rank_silent_results)):
        for key, message in messages.items():
            assert_one_line(message, words[key], f"rank {rank}, {key}")
