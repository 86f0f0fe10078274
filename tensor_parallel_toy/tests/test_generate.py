"""Generating text under TP (inference/generate.py) against one device and `transformers`.

Checked: greedy tokens at TP 2 and 4 equal Hugging Face's own `generate` on tiny random Llama
3.2-like (8 query heads, 2 k/v heads: at TP 4 two ranks share each k/v head), Qwen3-like
(q/k norms, head_dim 24) and Llama 2-like models with a vocabulary of 101 (padded to 102 and 104),
on a batch of a 7-token and a left-padded 4-token prompt; the tokens one device generates
through the KV cache are the argmax of the model's own full forward at every position; sampled
tokens equal one device's for the same seed (a vocabulary of 63, padded to 64 at TP 2: the
padding's logit would change every draw); each rank's KV
cache is 1/p of one device's, or one shared head per rank when there are fewer k/v heads than
ranks; ranks that draw different tokens, or are given different prompts, raise one line on
every rank; bad requests are refused in one line before any collective.
"""
import dataclasses
import functools
import json

import pytest
import torch
import torch.distributed as dist

from tensor_parallel_toy import ModelConfig, Transformer, from_hf, load_full_state_dict
from tensor_parallel_toy.guards import RanksDisagreeError
from tensor_parallel_toy.inference.generate import KVCache, generate
from tensor_parallel_toy.launcher.initialize import current_device

from .helpers import BACKENDS, assert_usage_error, import_transformers, tiny_hf_model, world

NEW = 6  # tokens generated per prompt
SHAPES = {"llama3.2": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_attention_heads=8, tie_word_embeddings=True)),
          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
          "vocab101": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=101, hidden_size=32))}


def _prompts(vocab):
    """A 7-token prompt and a 4-token one, left-padded with 0s, as a tokenizer pads them."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, vocab, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


@functools.lru_cache(maxsize=None)
def reference(name):
    """In the pytest process: (config, baseline state, ids, mask, Hugging Face's greedy tokens,
    its eos id)."""
    hf = tiny_hf_model(*SHAPES[name][:2], **SHAPES[name][2])
    ids, mask = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        tokens = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
    config, state = from_hf(hf)
    return config, state, ids, mask, tokens, hf.config.eos_token_id


def _tp_model(config, state):
    model = Transformer(config, tp_group=dist.group.WORLD, seed=5)
    load_full_state_dict(model, state)
    return model.eval()


def _on_rank_greedy(cases):
    """Per case: our greedy tokens at this TP size, and the KV cache's bytes here and on one
    device."""
    out = {}
    for name, (config, state, ids, mask, _, eos) in cases.items():
        tp = _tp_model(config, state)
        one = Transformer(config, seed=5)
        load_full_state_dict(one, state)
        out[name] = {"tokens": generate(tp, ids, mask, max_new_tokens=NEW, eos_token_id=eos),
                     "cache": KVCache(tp, 2, 16).nbytes(), "one": KVCache(one, 2, 16).nbytes()}
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_equal_hugging_faces_generate_and_the_cache_is_split(pools, tp):
    cases = {name: reference(name) for name in SHAPES}
    for rank, got in enumerate(pools(tp).run(_on_rank_greedy, cases)):
        for name, (config, *_, hf_tokens, _) in cases.items():
            assert torch.equal(got[name]["tokens"], hf_tokens), (
                f"{name} tp={tp} rank {rank}:\nours {got[name]['tokens'].tolist()}\n"
                f"hf   {hf_tokens.tolist()}")
            # Each rank caches its own k/v heads: nkv/p of them, or one it shares when nkv < p.
            share = max(config.num_kv_heads // tp, 1) / config.num_kv_heads
            assert got[name]["cache"] == got[name]["one"] * share, (name, tp, got[name])


SMALL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=64, max_seq_len=24, mlp="swiglu")


def _on_rank_sampled(seeds):
    """Sampled tokens at TP 2 for this rank's seed, and one device's for seed 0, with a
    vocabulary of 63 that TP 2 pads to 64."""
    _, _, rank = world()
    config = dataclasses.replace(SMALL, vocab_size=63)
    one = Transformer(config, seed=3)
    tp = Transformer(config, tp_group=dist.group.WORLD, seed=3)
    ids, mask = _prompts(config.vocab_size)
    kwargs = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20)
    try:
        mine = generate(tp, ids, mask, seed=seeds[rank], **kwargs)
    except RanksDisagreeError as e:
        mine = str(e)
    return mine, generate(one, ids, mask, seed=0, **kwargs)


def test_sampled_tokens_equal_one_devices_and_ranks_that_draw_differently_raise(pools):
    for mine, one in pools(2).run(_on_rank_sampled, [0, 0]):
        assert torch.equal(mine, one), (mine.tolist(), one.tolist())
        assert len(set(mine[:, 7:].flatten().tolist())) > 2, "nothing was sampled"
    for message, _ in pools(2).run(_on_rank_sampled, [0, 1]):  # a rank with another seed
        assert isinstance(message, str) and "\n" not in message, message
        assert "chose different tokens at step" in message and "seed=" in message, message


def _on_rank_checks():
    _, _, rank = world()
    tp = Transformer(SMALL, tp_group=dist.group.WORLD, seed=3)
    ids, mask = _prompts(SMALL.vocab_size)
    messages = []
    for args, kwargs in [((ids, mask), dict(max_new_tokens=20)),  # 7 + 20 > 24 positions
                         ((ids, torch.zeros_like(mask)), {}),  # empty prompts
                         ((ids[:, :0],), {}),
                         ((ids + 64,), {}),  # ids past the vocabulary
                         ((ids + rank,), dict(max_new_tokens=2)),  # different prompts
                         ((ids,), dict(max_new_tokens=2 + rank))]:  # different requests
        try:
            generate(tp, *args, **kwargs)
            messages.append(None)
        except ValueError as e:  # RanksDisagreeError included
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def test_bad_requests_are_one_line_on_every_rank(pools):
    expected = [["ValueError: a prompt of 7 positions plus max_new_tokens=20 is 27 positions, "
                 "more than the model's max_seq_len=24"],
                ["ValueError: prompt 0 is empty (its attention_mask is all 0)"],
                ["ValueError: input_ids of shape (2, 0)"],
                ["token id", "out of range: valid are 0..63"],
                ["RanksDisagreeError: the ranks of the tensor-parallel group were given "
                 "different input_ids"],
                ["RanksDisagreeError: the 2 ranks of the tensor-parallel group built different "
                 "generate() requests: max_new_tokens: 2 on rank 0, 3 on rank 1"]]
    for rank, messages in enumerate(pools(2).run(_on_rank_checks)):
        assert len(messages) == len(expected)
        for message, words in zip(messages, expected):
            assert message and "\n" not in message and all(w in message for w in words), (
                rank, message)


def _draw_biases_(model):
    """Large q/k/v biases, so that a bias applied wrongly shows in the tokens."""
    with torch.no_grad():
        for block in model.layers:
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias.copy_(torch.linspace(-1, 1, block.attn.qkv.bias.numel()))


# The other paths through a block: GELU MLP with biases on q/k/v, q/k norms, a window shorter
# than the sequence, tied embeddings.
OTHER = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                    max_seq_len=24, qkv_bias=True, qk_norm=True, sliding_window=4,
                    tie_embeddings=True)


@pytest.mark.parametrize("config", [SMALL, OTHER], ids=["swiglu-gqa", "gelu-bias-qknorm-window"])
def test_the_tokens_one_device_generates_are_its_full_forwards_argmax_at_every_step(config):
    """The KV cache path against the model itself: feed the whole generated sequence through
    `model(ids)` and take the argmax at each position that produced a token."""
    model = Transformer(config, seed=4).eval()
    _draw_biases_(model)
    ids = torch.randint(0, config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    out = generate(model, ids, max_new_tokens=10)
    with torch.no_grad():
        full = model(out).argmax(-1)  # [b, s + n]: the next token after each position
    assert torch.equal(full[:, 4:-1], out[:, 5:]), (full[:, 4:-1].tolist(), out[:, 5:].tolist())


def test_the_decode_measurement_reports_latency_transfers_and_the_cache(pools, tmp_path,
                                                                        capsys):
    """A tiny run of `profiling/run/decode.py` on the suite's 2-rank pool: per batch size both
    modes' latency, the transfers a TP token makes (an all-reduce for the embedding and two per
    block, the logits' all-gather, the tokens' check), and the KV cache against its formula."""
    from tensor_parallel_toy.profiling.run import decode

    out = tmp_path / "decode"
    assert decode.main(["--hidden", "64", "--layers", "2", "--batches", "1,3", "--tokens", "3",
                        "--repeats", "1", "--prompt", "4", "--out", str(out)],
                       pool=pools(2)) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "decode.json").read_text())
    assert (out / "summary.txt").read_text().strip() == printed.strip()
    for b in (1, 3):
        tp, one = results["modes"][f"tp/b{b}"], results["modes"][f"tp1/b{b}"]
        assert tp["transfers_per_token"] == 1 + 2 * 2 + 2, tp
        assert one["transfers_per_token"] == 0 and one["comm_ms"] == 0, one
        assert tp["latency_ms"]["median"] > 0 and one["latency_ms"]["median"] > 0
        cache = results["kv_cache"][str(b)]
        assert cache["tp"] == cache["formula_tp"] == cache["tp1"] // 2 > 0, cache
        assert cache["tp1"] == cache["formula_tp1"], cache
    lines = printed.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["1", "3"], printed
    assert "decode: TP 2 lowers the latency per token at batch" in printed, printed
    assert "on an H100 (read, not run)" in printed and "Llama 3 70B" in printed, printed
    # The envelope's weight count is the block's own: SwiGLU and grouped-query attention.
    config = ModelConfig(**{**decode.DEFAULT_CONFIG, "hidden_size": 64, "num_layers": 2})
    block = Transformer(config).layers[0]
    weights = sum(p.numel() for n, p in block.named_parameters() if not n.endswith("norm.weight"))
    assert weights == decode.block_params(config.hidden_size, config.num_heads,
                                          config.num_kv_heads, config.head_dim,
                                          config.ffn_hidden_size), weights


@pytest.mark.parametrize("flags, words", [(["--tokens", "1"], "--tokens 1: must be 2 or more"),
                                          (["--batches", "0,2"], "give positive integers"),
                                          (["--tp", "3"], "not divisible by the tensor-parallel")])
def test_the_decode_measurements_bad_flags_are_one_line_and_exit_2(flags, words, capsys):
    from tensor_parallel_toy.profiling.run import decode

    assert_usage_error(decode.main, flags, words, capsys)


def _on_rank_hf_tp(folder):
    """transformers' own TP of our baseline's checkpoint (saved by rank 0): its greedy tokens,
    ours at TP 2, one device's; a training step's loss beside one device's; what it split."""
    from torch.distributed.tensor import DTensor
    from tensor_parallel_toy.profiling.run import hf_tp

    _, _, rank = world()
    one = Transformer(SMALL, seed=3)
    if rank == 0:
        hf_tp.save_checkpoint(SMALL, one.state_dict(), folder)
    dist.barrier()
    hf = hf_tp.load_tp(folder)
    ids, _ = _prompts(SMALL.vocab_size)
    ours = Transformer(SMALL, tp_group=dist.group.WORLD, seed=3)
    out = {"hf": hf_tp.greedy(hf, ids, 6), "ours": generate(ours, ids, max_new_tokens=6),
           "one": generate(one, ids, max_new_tokens=6)}
    hf.train()
    loss = hf(ids, labels=ids).loss
    loss.backward()
    out["loss"], out["one_loss"] = float(loss), float(one(ids[:, :-1], ids[:, 1:]))
    out["split"] = sorted({name.split(".")[-2] for name, p in hf.named_parameters()
                           if isinstance(p, DTensor) and "layers.0." in name})
    out["whole"] = sorted(name for name, p in hf.named_parameters()
                          if "norm" in name and not isinstance(p, DTensor))
    out["grads"] = sum(p.grad is not None for p in hf.parameters())
    return out


def test_hugging_faces_own_tp_generates_one_devices_tokens_and_trains_without_sp(pools,
                                                                                 tmp_path):
    """What a transformers user would pick instead: from_pretrained(tp_plan="auto") on gloo,
    TP 2. Its greedy tokens equal one device's and ours; one training step runs, with one
    device's loss; its plan splits the projections and leaves every norm whole (no SP)."""
    import_transformers()
    for got in pools(2).run(_on_rank_hf_tp, str(tmp_path / "hf")):
        assert torch.equal(got["hf"], got["one"]) and torch.equal(got["ours"], got["one"]), got
        assert abs(got["loss"] - got["one_loss"]) <= 1e-5 * abs(got["one_loss"]), got
        assert got["split"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                "up_proj", "v_proj"], got["split"]
        assert len(got["whole"]) == 2 * SMALL.num_layers + 1 and got["grads"] > 0, got


def test_a_sequence_that_produced_the_end_token_continues_with_padding_and_all_stop():
    model = Transformer(SMALL, seed=4).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    free = generate(model, ids, max_new_tokens=8)  # no end token: 8 new tokens each
    eos = int(free[0, 7])  # row 0's third new token
    stopped = generate(model, ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=-1)
    first = [int((row[5:] == eos).nonzero()[0]) if (row[5:] == eos).any() else None
             for row in free]
    for row, end in enumerate(first):
        if end is None:  # never ended: the same tokens for as long as the other row ran
            assert torch.equal(stopped[row], free[row, :stopped.shape[1]])
            continue
        assert torch.equal(stopped[row, :5 + end + 1], free[row, :5 + end + 1])
        assert (stopped[row, 5 + end + 1:] == -1).all(), stopped[row].tolist()
    expected = 5 + (max(first) + 1 if None not in first else 8)
    assert stopped.shape[1] == expected, (stopped.shape, first)


def _on_rank_other_paths():
    """Greedy and sampled tokens of OTHER at TP 2 and on one device, the same weights, a
    left-padded batch, on this rank's device (a GPU under NCCL)."""
    device = current_device()
    one = Transformer(OTHER, seed=4).eval()
    _draw_biases_(one)
    tp = Transformer(OTHER, tp_group=dist.group.WORLD, seed=4).eval()
    load_full_state_dict(tp, one.state_dict())
    tp.to(device), one.to(device)
    ids, mask = (t.to(device) for t in _prompts(OTHER.vocab_size))
    out = []
    for kwargs in (dict(), dict(do_sample=True, top_k=8, seed=1)):
        out.append((generate(tp, ids, mask, max_new_tokens=8, **kwargs).cpu(),
                    generate(one, ids, mask, max_new_tokens=8, **kwargs).cpu()))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_biases_qk_norms_and_a_window_generate_one_devices_tokens_at_tp_2(pools, backend):
    for per_rank in pools(2, backend).run(_on_rank_other_paths):
        for tp_tokens, one_tokens in per_rank:  # greedy, then sampled
            assert torch.equal(tp_tokens, one_tokens), (tp_tokens.tolist(), one_tokens.tolist())
