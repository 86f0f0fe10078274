"""A Hugging Face checkpoint trained with tensor + sequence parallelism, then written back as one.

    python -m tensor_parallel_toy.examples.finetune_hf         # tiny Llama 3.2-like, 2 CPU ranks
    python -m tensor_parallel_toy.examples.finetune_hf --family qwen3 --ranks 4
    python -m tensor_parallel_toy.examples.finetune_hf --checkpoint /path/to/model --out tuned/
    torchrun --nproc-per-node 2 -m tensor_parallel_toy.examples.finetune_hf --out tuned/

On every rank:
1. the Hugging Face model: read from --checkpoint (a local folder; nothing is downloaded), or
   built from a tiny config with random weights, the same on every rank (same seed);
2. `from_hf`: our config and the full state dict; `Transformer(config, tp_group)` keeps this
   rank's shards of it;
3. a few AdamW steps on the package's corpus (ASCII bytes: token ids below 128, valid in any
   vocabulary at least that large, if meaningless to a real tokenizer);
4. `full_state_dict` -> `to_hf` -> the Hugging Face model -> `save_pretrained` (rank 0);
5. rank 0 reloads that folder with `AutoModelForCausalLM` and compares its logits with the TP
   model's, which every rank computed (a collective).
"""
import argparse
import contextlib
import os
import tempfile

import torch
import torch.distributed as dist

from tensor_parallel_toy import (Transformer, current_device, from_hf, full_state_dict, guard,
                                 load_full_state_dict, to_hf)
from tensor_parallel_toy.profiling.run.data import CORPUS_VOCAB, batch, make_corpus

# Small enough for a laptop CPU, shaped like the real ones: Llama 3.2 (llama3 rope scaling, a
# head tied to the embedding, 4 query heads per k/v head) and Qwen3 (per-head q/k norms, a
# head_dim that is not hidden / heads).
TINY = dict(vocab_size=CORPUS_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2,
                                  tie_word_embeddings=True,
                                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                       factor=32.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0,
                                                       original_max_position_embeddings=64))),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}
SAME_LOGITS_TOL = 1e-4  # fp32, two implementations: only the order of additions differs


def hf_model(options):
    """The Hugging Face `...ForCausalLM` to start from, in fp32."""
    import transformers

    if options.checkpoint:
        return transformers.AutoModelForCausalLM.from_pretrained(options.checkpoint,
                                                                 dtype=torch.float32)
    config_cls, change = FAMILIES[options.family]
    torch.manual_seed(options.seed)  # the same random weights on every rank
    return transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_cls)(**TINY, **change), dtype=torch.float32)


def run_rank(options):
    """Steps 1-5 on this rank, TP over all ranks; returns {"losses", "error", "out"} (rank 0's
    comparison; None elsewhere)."""
    group, rank = dist.group.WORLD, dist.get_rank()
    hf = hf_model(options)
    config, state = from_hf(hf, max_seq_len=options.seq)  # rotary tables for --seq tokens
    device = current_device()  # this rank's GPU under NCCL, else the CPU
    model = guard(Transformer(config, tp_group=group, overlap=options.overlap).to(device))
    load_full_state_dict(model, state)  # each rank keeps its shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr)
    corpus, losses = make_corpus(seed=options.seed), []
    for step in range(options.steps):
        ids, labels = batch(corpus, step, options.batch, options.seq, options.seed,
                            device=device)  # [b, s]
        loss = model(ids, labels)  # the same full batch on every rank
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    trained = to_hf(config, full_state_dict(model))  # a collective: every rank gathers
    ids = batch(corpus, options.steps, options.batch, options.seq, options.seed,
                device=device)[0]
    with torch.no_grad():
        logits = model(ids)  # [b, s, V], gathered on every rank
    result = {"losses": losses, "error": None, "out": options.out}
    if rank == 0:
        import transformers

        transformers.logging.disable_progress_bar()  # keep the example's own lines readable
        hf.load_state_dict(trained)  # strict: every tensor, under Hugging Face's names
        with contextlib.ExitStack() as stack:  # without --out: a folder removed at the end
            out = options.out or stack.enter_context(
                tempfile.TemporaryDirectory(prefix="tp_toy_checkpoint_"))
            hf.save_pretrained(out)
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(out,
                                                                         dtype=torch.float32)
        with torch.no_grad():  # transformers' model, reloaded on the CPU
            want = reloaded(ids.cpu()).logits
        result["error"] = ((logits.cpu() - want).abs().max() / want.abs().max()).item()
    dist.barrier()  # no rank leaves while rank 0 still writes
    return result


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tensor_parallel_toy.examples.finetune_hf",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="a local Hugging Face model folder (default: a "
                                             "tiny random model of --family)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--out", help="where to save the trained checkpoint (default: a "
                                      "temporary folder, removed at the end)")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (ignored under "
                                                             "torchrun)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap", action="store_true", help="overlap communication with "
                                                               "the GEMMs (the ring schedules)")
    return parser.parse_args(argv)


def report(result):
    """The lines a reader checks; raises if the reloaded checkpoint's logits differ."""
    losses = result["losses"]
    print(f"loss over {len(losses)} steps: " + " ".join(f"{x:.3f}" for x in losses))
    print(f"saved the trained checkpoint to {result['out']}" if result["out"] else
          "saved the trained checkpoint to a temporary folder, removed (--out DIR keeps it)")
    if not result["error"] <= SAME_LOGITS_TOL:
        raise SystemExit(f"the reloaded checkpoint's logits differ from the TP model's by "
                         f"{result['error']:.3g} (relative), more than {SAME_LOGITS_TOL:g}")
    print(f"reloaded with transformers: its logits equal the TP model's "
          f"(max relative difference {result['error']:.2g})")


def main(argv=None, pool=None):
    """Run on `pool` (a `WorkerPool`), else under torchrun when its variables are set, else on
    a new pool of --ranks local processes."""
    from tensor_parallel_toy.launcher.initialize import init_from_env, shutdown
    from tensor_parallel_toy.launcher.pool import WorkerPool

    options = parse(argv)
    if pool is not None:
        return report(pool.run(run_rank, options)[0])
    if "RANK" in os.environ:  # torchrun: this process is one rank
        init_from_env()
        result, rank = run_rank(options), dist.get_rank()
        shutdown()  # first: a verdict raised on rank 0 must not leave the others waiting
        if rank == 0:
            report(result)
        return
    pool = WorkerPool(options.ranks)
    try:
        report(pool.run(run_rank, options)[0])
    finally:
        pool.close()


if __name__ == "__main__":
    main()
