"""Overlap past the layer (halves/): the split-phase collectives against the whole ones and
against full tensors, the two-halves model against the baseline in every gradient, and the
order of posts, GEMMs and waits, forward and backward (the mirror property).

The order test records, inside the ranks, every transfer's post and wait (from outside the
library, profiling/measure/transfers.py) and every GEMM: a schedule that waits for a transfer
before the other half computes anything fails it, forward or backward. The chain test reads
the autograd graph itself: the backward's collectives must be ordered by its edges, not by the
engine's choice among the nodes ready at once.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensor_parallel_toy import ModelConfig, Transformer
from tensor_parallel_toy.comm import all_gather_seq, reduce_scatter_seq
from tensor_parallel_toy.halves import (TransformerInHalves, block_in_halves,
                                        post_all_gather_seq, post_reduce_scatter_seq)
from tensor_parallel_toy.interop.data_parallel import apply_fsdp
from tensor_parallel_toy.launcher.initialize import current_device
from tensor_parallel_toy.model import TransformerBlock, draw_full_weights_
from tensor_parallel_toy.profiling.measure.timeline import GEMM_OPS
from tensor_parallel_toy.profiling.measure.transfers import recording
from tensor_parallel_toy.rotary import rotary_tables

from .helpers import (BACKENDS, BF16_EPS, CONFIG, FP32_TOL, assert_bf16, assert_errors,
                      assert_matches_baseline, assert_one_line, compare_on_world, max_rel_error,
                      world)


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------
def _shards(p, rows, dtype, strided, seed):
    """Every rank's `[rows, 3, 5]` shard and every rank's upstream gradient of the gathered
    `[p*rows, 3, 5]` (all drawn alike on each rank); `strided`: the shards as views that are
    not contiguous."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(p, 5, 3, rows, generator=gen).transpose(1, 3)  # [p, rows, 3, 5], strided
    x = x if strided else x.contiguous()
    dy = torch.randn(p, p * rows, 3, 5, generator=gen)
    return x.to(current_device(), dtype), dy.to(current_device(), dtype)


def _on_rank_split_phase(dtype_name, strided):
    """post/wait all-gather and reduce-scatter, forward and backward, against full tensors
    (errors) and against the whole collectives (bit for bit: same bytes, same sums)."""
    group, p, r = world()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    xs, dys = _shards(p, 3, dtype, strided, seed=5)
    out = {}
    # All-gather: forward the concatenation; backward each rank's rows summed over the ranks.
    x = xs[r].clone().requires_grad_() if not strided else xs[r].detach().requires_grad_()
    posted = post_all_gather_seq(x, group)
    between = x.sum() * 0  # work between the post and the wait, as a schedule would put there
    y = posted.wait() + between
    y.backward(dys[r])
    out["all-gather forward"] = max_rel_error(y, xs.flatten(0, 1))
    want = dys.float().sum(0).view(p, 3, 3, 5)[r]
    out["all-gather backward"] = max_rel_error(x.grad.float(), want)
    whole, _ = all_gather_seq(xs[r], group)
    whole_grad, _ = reduce_scatter_seq(dys[r], group)
    out["all-gather bitwise"] = float(not (torch.equal(y, whole) and torch.equal(x.grad,
                                                                                whole_grad)))
    # Reduce-scatter: forward this rank's rows of the sum; backward the gradient gathered.
    full = dys[r].detach().requires_grad_()  # [p*rows, 3, 5], different on every rank
    posted = post_reduce_scatter_seq(full, group)
    y = posted.wait()
    y.backward(xs[r])
    out["reduce-scatter forward"] = max_rel_error(y.float(), dys.float().sum(0).view(p, 3, 3,
                                                                                     5)[r])
    out["reduce-scatter backward"] = max_rel_error(full.grad, xs.flatten(0, 1))
    whole, _ = reduce_scatter_seq(dys[r], group)
    whole_grad, _ = all_gather_seq(xs[r], group)
    out["reduce-scatter bitwise"] = float(not (torch.equal(y, whole) and torch.equal(
        full.grad, whole_grad)))
    return out


def _on_rank_model(steps):
    return compare_on_world(CONFIG, steps=steps, batch=3, model_cls=TransformerInHalves)


GQA = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=1,
                  head_dim=12, ffn_hidden_size=48, max_seq_len=16, mlp="swiglu", qkv_bias=True,
                  qk_norm=True)


def _on_rank_model_gqa():
    """SwiGLU, one k/v head shared by the ranks (its rows through `f` over their holders),
    q/k/v biases, q/k norms: every gradient against the baseline."""
    return compare_on_world(GQA, steps=2, batch=4, seq=10, model_cls=TransformerInHalves)


def _on_rank_model_bf16():
    """bf16: the halves model no further from the fp32 baseline than one device in bf16."""
    group, _, _ = world()
    dev = current_device()
    ref = Transformer(CONFIG, seed=0).to(dev)
    base = Transformer(CONFIG, seed=0).to(dev, torch.bfloat16)
    halves = TransformerInHalves(CONFIG, group, seed=0).to(dev, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=gen).to(dev)
    labels = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=gen).to(dev)
    from tensor_parallel_toy.support.sharding import full_grads
    got = {}
    for model in (ref, base, halves):
        loss = model(ids, labels)
        loss.backward()
        grads = full_grads(model) if model is halves else {
            n: p.grad for n, p in model.named_parameters()}
        got[model] = {"loss": loss, **{"grad:" + n: g for n, g in grads.items()}}
    return {k: (max_rel_error(got[halves][k], v), max_rel_error(got[base][k], v))
            for k, v in got[ref].items()}


class _Events(TorchDispatchMode):
    """Records, in order, every GEMM ("gemm") and every transfer's post and wait."""

    def __init__(self):
        super().__init__()
        self.events, self.count = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in GEMM_OPS:
            self.events.append(("gemm",))
        return func(*args, **(kwargs or {}))

    def transfer(self, kind, nbytes, post):
        n, self.count = self.count, self.count + 1
        self.events.append(("post", kind, n))
        handle, events = post(), self.events

        class Handle:
            def wait(self):
                events.append(("wait", kind, n))
                return handle.wait()
        return Handle()


def _on_rank_order():
    """The events of one block's forward and of its backward, in halves, on a batch of 4, and
    its output and every gradient against the whole block's."""
    group, p, _ = world()
    block = TransformerBlock(CONFIG, group)
    draw_full_weights_(block, group, seed=1)
    cos, sin = rotary_tables(12, CONFIG.head_dim, CONFIG.rope_base)
    cos, sin = cos[:, None, None], sin[:, None, None]  # [s, 1, 1, hd/2], as Transformer.rotary
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(12 // p, 4, CONFIG.hidden_size, generator=gen).requires_grad_()
    dy = torch.randn(12 // p, 4, CONFIG.hidden_size, generator=gen)
    forward, backward = _Events(), _Events()
    with recording(forward), forward:
        y = block_in_halves(block, x, cos, sin, group)
    backward.count = 100  # the backward's transfers numbered apart
    with recording(backward), backward:
        y.backward(dy)
    halves = {"x": x.grad, **{n: p.grad.clone() for n, p in block.named_parameters()}}
    block.zero_grad()
    x_whole = x.detach().clone().requires_grad_()
    whole = block(x_whole, cos, sin)
    whole.backward(dy)
    grads = {"x": x_whole.grad, **{n: p.grad for n, p in block.named_parameters()}}
    errors = {"output": max_rel_error(y, whole),
              **{"grad:" + k: max_rel_error(g, grads[k]) for k, g in halves.items()}}
    return {"forward": forward.events, "backward": backward.events, "errors": errors}


def _on_rank_handles_alive():
    """Posted handles still alive after steps of the model, with Python's cycle collector off:
    a handle in a reference cycle would keep its buffers, and the graph before it, alive until
    the collector happens to run. Gloo's thread may hold a finished transfer's output buffer
    for a moment after `wait()` returns (and through its grad_fn the whole forward's graph:
    seen once in CI, 20 handles on one rank), so the count gets a second to fall to zero; a
    cycle never frees without the collector."""
    import gc
    import time

    from tensor_parallel_toy.halves.split_phase import Posted
    group, _, _ = world()
    model = TransformerInHalves(CONFIG, group, seed=0)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, Posted)}
    gc.disable()
    try:
        for _ in range(2):
            model(ids, ids).backward()
        forward_only = model(ids, ids)  # evaluation under grad, never backpropagated
        del forward_only
        deadline = time.monotonic() + 1.0
        while True:
            alive = [o for o in gc.get_objects() if isinstance(o, Posted) and id(o) not in before]
            if not alive or time.monotonic() > deadline:
                return {"alive": len(alive), "before": len(before),
                        "held by": _holders(alive[:2])}
            del alive
            time.sleep(0.01)
    finally:
        gc.enable()


def _holders(objects, depth=3):
    """What keeps `objects` alive, `depth` referrers deep, by type: a failure's diagnosis."""
    import gc
    import inspect

    out = []
    for o in objects:
        chain, level = [], [o]
        for _ in range(depth):
            level = [r for x in level for r in gc.get_referrers(x)
                     if r is not level and r is not objects and not inspect.isframe(r)][:4]
            chain.append(sorted({type(r).__name__ for r in level}))
        out.append(chain)
    return out


# The autograd nodes whose backward calls a collective, by their classes' names: the split-phase
# post and wait (halves/split_phase.py), `f` and `f` over the holders of shared rows (comm.py).
COLLECTIVE_NODES = ("_PostBackward", "_WaitBackward", "_CopyToTensorParallelRegionBackward",
                    "_CopyToRowHoldersBackward")
CHAIN_CASES = {"odd batch, 2 blocks": (CONFIG, 3), "shared k/v head, q/k norms": (GQA, 4)}


def _graph(root):
    """Every node reachable from `root` through `next_functions`."""
    seen, todo = {root}, [root]
    while todo:
        for child, _ in todo.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _on_rank_collective_chain():
    """Per case, the collective nodes of one forward to the loss, in the order of their
    creation (sequence numbers), and each pair of consecutive ones where the earlier node is
    not reachable from the later: a backward free to run the earlier one first."""
    group, _, _ = world()
    out = {}
    for case, (config, batch) in CHAIN_CASES.items():
        model = TransformerInHalves(config, group, seed=0)
        ids = torch.randint(0, config.vocab_size, (batch, 10),
                            generator=torch.Generator().manual_seed(4))
        loss = model(ids, ids)
        nodes = sorted((n for n in _graph(loss.grad_fn) if type(n).__name__ in COLLECTIVE_NODES),
                       key=lambda n: n._sequence_nr())
        named = [f"{type(n).__name__}#{n._sequence_nr()}" for n in nodes]
        out[case] = {"nodes": named, "unordered": [
            (named[i], named[i + 1]) for i in range(len(nodes) - 1)
            if nodes[i] not in _graph(nodes[i + 1])]}
    return out


def _on_rank_refusals():
    group, _, _ = world()
    messages = {}
    model = TransformerInHalves(CONFIG, group, seed=0)
    ids = torch.zeros(1, 12, dtype=torch.long)
    for name, call in {"batch of 1": lambda: model(ids, ids),
                       "overlap": lambda: TransformerInHalves(CONFIG, group, overlap=True),
                       "no group": lambda: TransformerInHalves(CONFIG, None),
                       "fsdp": lambda: apply_fsdp(model, {"dp": None})}.items():
        try:
            call()
        except ValueError as e:
            messages[name] = str(e)
    return messages


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,dtype,strided", [(2, "fp32", True), (3, "bf16", False),
                                              (4, "fp32", False), (2, "bf16", True)])
def test_split_phase_collectives_match_whole_ones_and_full_tensors(pools, tp, dtype, strided):
    per_rank = pools(tp).run(_on_rank_split_phase, dtype, strided)
    tol = FP32_TOL if dtype == "fp32" else BF16_EPS * tp
    assert_errors(per_rank, tol, f"split-phase tp={tp} {dtype} strided={strided}")


@pytest.mark.parametrize("tp,backend", [(2, "gloo"), pytest.param(
    2, "nccl", id="2-nccl", marks=BACKENDS[1].marks)])
def test_two_halves_model_matches_baseline_in_every_gradient(pools, tp, backend):
    """An odd batch (3 rows: halves of 2 and 1), ignored labels, SGD steps: logits, loss, every
    gradient, the parameters."""
    assert_matches_baseline(pools(tp, backend).run(_on_rank_model, 2), CONFIG,
                            f"halves tp={tp}")


def test_two_halves_with_shared_kv_heads_swiglu_biases_and_qk_norms(pools):
    assert_matches_baseline(pools(4).run(_on_rank_model_gqa), GQA, "halves GQA tp=4")


def test_two_halves_model_in_bf16(pools):
    assert_bf16(pools(2).run(_on_rank_model_bf16), "halves bf16 tp=2")


SPLIT_PHASE = ("all-gather", "reduce-scatter")


def _mirrored(events):
    """The backward a mirrored schedule gives: the forward's events reversed, each post a wait
    and each wait a post of the conjugate collective."""
    swap = {"post": "wait", "wait": "post"}
    conj = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather"}
    return [e if e[0] == "gemm" else (swap[e[0]], conj[e[1]], e[2]) for e in reversed(events)]


def _transfers(events):
    """Only posts and waits, the transfers numbered in order of first appearance."""
    names, out = {}, []
    for e in events:
        if e[0] != "gemm":
            out.append((e[0], e[1], names.setdefault(e[2], len(names))))
    return out


def _gemms_while_in_flight(events):
    """For every transfer: the GEMMs between its post and its wait."""
    inside, count = set(), {}
    for e in events:
        if e[0] == "post":
            inside.add(e[2])
            count[e[2]] = 0
        elif e[0] == "wait":
            inside.discard(e[2])
        else:
            for n in inside:
                count[n] += 1
    return count


def test_the_schedule_hides_every_transfer_under_a_gemm_and_the_backward_mirrors_it(pools):
    for rank in pools(2).run(_on_rank_order):
        # The split-phase transfers and the GEMMs (the norms' weight gradients are summed by
        # small blocking all-reduces in the backward, as in the reading path).
        forward, backward = ([e for e in rank[k] if e[0] == "gemm" or e[1] in SPLIT_PHASE]
                             for k in ("forward", "backward"))
        assert_errors([rank["errors"]], FP32_TOL, "one block in halves against the whole block")
        transfers = [e for e in forward if e[0] == "post"]
        assert len(transfers) == 8, f"one block in halves posts 8 transfers: {transfers}"
        for name, events in (("forward", forward), ("backward", backward)):
            # A pipeline's fill and drain: the first half's first transfer and the second
            # half's last have nothing beside them; every other transfer is in flight while a
            # GEMM runs.
            posts = [e[2] for e in events if e[0] == "post"]
            waits = [e[2] for e in events if e[0] == "wait"]
            lonely = {n for n, c in _gemms_while_in_flight(events).items() if c == 0}
            assert lonely <= {posts[0], waits[-1]}, (
                f"{name}: transfers {sorted(lonely)} waited for with no GEMM beside them "
                f"(only the first and the last may be): {events}")
        # The backward's transfers are the forward's, mirrored: reversed, post <-> wait,
        # each collective its conjugate.
        assert _transfers(backward) == _transfers(_mirrored(forward)), (forward, backward)


def test_the_backward_collectives_lie_on_one_path_in_the_order_of_their_creation(pools):
    """Every collective node of a forward (both halves' posts and waits, the `f` of the norms'
    weights, q/k norms included, and of the shared k/v rows) is reachable from the next one
    created: the graph runs them, backward, in one order on every rank."""
    problems = []
    for rank, cases in enumerate(pools(2).run(_on_rank_collective_chain)):
        for case, found in cases.items():
            kinds = {name.split("#")[0] for name in found["nodes"]}
            # `f` over the holders of shared rows only where the 2 ranks share a k/v head.
            shares = CHAIN_CASES[case][0].num_kv_heads < 2
            want = set(COLLECTIVE_NODES) - (set() if shares else {"_CopyToRowHoldersBackward"})
            if kinds != want:  # a test that found no collectives would prove nothing
                problems.append(f"rank {rank}, {case}: found {sorted(kinds)}, "
                                f"expected {sorted(want)}")
            if found["unordered"]:
                problems.append(
                    f"rank {rank}, {case}: {len(found['unordered'])} of "
                    f"{len(found['nodes']) - 1} consecutive collective nodes not ordered by the "
                    f"graph (earlier, later): {found['unordered']}")
    assert not problems, "\n".join(problems)


def test_no_transfer_handle_outlives_its_step(pools):
    ranks = pools(2).run(_on_rank_handles_alive)
    assert [r["alive"] for r in ranks] == [0, 0], (
        f"Posted handles alive after the steps, per rank (with those alive before the steps "
        f"and what holds them): {ranks}")


def test_two_halves_refuse_a_batch_of_one_overlap_no_group_and_fsdp(pools):
    messages = pools(2).run(_on_rank_refusals)[0]
    assert_one_line(messages.get("batch of 1"), ["batch of 1", "at least 2"], "batch of 1")
    assert_one_line(messages.get("overlap"), ["overlap=True", "overlap=False"], "overlap")
    assert_one_line(messages.get("no group"), ["tp_group=None"], "no group")
    assert_one_line(messages.get("fsdp"), ["apply_fsdp(TransformerInHalves)", "Transformer"],
                    "FSDP2 over the halves")
