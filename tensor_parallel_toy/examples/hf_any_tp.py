"""A Hugging Face decoder of a family `from_hf` does not know, split by its own plan: TP + SP.

    python -m tensor_parallel_toy.examples.hf_any_tp                     # Phi-3, 2 local CPU ranks
    python -m tensor_parallel_toy.examples.hf_any_tp --family olmo2      # or gemma3, glm4
    torchrun --nproc-per-node 2 -m tensor_parallel_toy.examples.hf_any_tp

`from_hf` converts the families the package's own `Transformer` can express (Llama, Mistral,
Qwen2, Qwen3). Every other `transformers` 5.x decoder ships a tensor-parallel plan of its own,
`model.tp_plan`; `hf_plan` reads it into a plan in PyTorch's words and the package's
`parallelize_module` carries it out with TP + SP, the model keeping its own forward and loss.
Where transformers' plan gathers a layer's output on every rank, hf_plan splits it instead:
Phi-3's fused `qkv_proj` by heads and `gate_up_proj` by halves, GLM-4's `gate_up_proj`, and
OLMo 2's q/k/v by heads, its q/k norm over every head made a norm over split features
(`NormOverSplit`: the sum of squares all-reduced, the weight split).

On every rank: a tiny random model of --family (nothing is downloaded; the same weights on
every rank), the upgrades printed (`hf_plan_upgrades`), then the model split over the ranks
and checked against itself on one device (`compare_with_one_device`): the loss and every
gradient, each rank's shard against the matching slice. Exits non-zero when one differs.
"""
import argparse
import dataclasses
import functools
import os

import torch
import torch.distributed as dist

from tensor_parallel_toy import current_device, launch
from tensor_parallel_toy.apply import compare_with_one_device, parallelize_module
from tensor_parallel_toy.interop.hf_plan import hf_plan, hf_plan_upgrades

# Small enough for a laptop CPU, shaped like the real ones: 4 query heads, 2 k/v heads.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # --family: (config class, model class, what differs from TINY)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
}
BATCH, SEQ = 2, 16  # SEQ: a multiple of the TP size (the sequence is split)


def build_model(family, device):
    """The family's tiny random `...ForCausalLM`, in fp32 and eval mode, the same on every
    rank (seeded), its norm weights drawn off their init (all ones, or zeros for Gemma's
    1 + weight), so a norm split wrongly shows in the loss too."""
    import transformers

    config_cls, model_cls, change = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **change})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    return model.to(device)


def split(model, group):
    """The model split by its own plan, TP + SP over `group`."""
    return parallelize_module(model, group, hf_plan(model, tp_size=dist.get_world_size(group)))


def loss_fn(model, batch):
    ids, labels = batch
    return model(ids, labels=labels).loss  # transformers' own loss, on whole logits


def written(style):
    """A style as one would write it: its class and the arguments that differ from the
    defaults."""
    args = [f"{f.name}={getattr(style, f.name)!r}" for f in dataclasses.fields(style)
            if getattr(style, f.name) != f.default]
    return f"{type(style).__name__}({', '.join(args)})"


def run_rank(family):
    """Returns {"upgrades": [(key, transformers' string, our style written)], "report": the
    `Comparison`}, the same on every rank."""
    group, device = dist.group.WORLD, current_device()  # this rank's GPU under NCCL, else CPU
    model = build_model(family, device)
    upgrades = hf_plan_upgrades(model, hf_plan(model, tp_size=dist.get_world_size(group)))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (BATCH, SEQ), generator=gen).to(device)
    report = compare_with_one_device(functools.partial(build_model, family, device), split,
                                     (ids, ids), loss_fn, tp_group=group)
    return {"upgrades": [(key, string, written(style)) for key, string, style in upgrades],
            "report": report}


def report(family, result):
    """The lines a reader checks; raises if the split model differs from one device's."""
    print(f"{family}: where transformers' plan gathers on every rank, hf_plan splits "
          f"(hf_plan_upgrades):")
    if not result["upgrades"]:
        print("  none: its plan gathers nothing inside the blocks")
    width = max((len(key) for key, _, _ in result["upgrades"]), default=0)
    for key, string, style in result["upgrades"]:
        print(f"  {key:<{width}}  {string or '(not in its plan)':<22} -> {style}")
    print("and sequence parallelism, which transformers' plan has not: between the blocks, "
          "each rank holds its s/p positions")
    comparison = result["report"]
    if not comparison.ok:
        raise SystemExit(f"the split model differs from one device's:\n{comparison}")
    grads = {k: v for k, v in comparison.errors.items() if k != "loss"}
    worst = max(grads, key=grads.get)
    print(f"loss: TP + SP {comparison.loss:.6f}, one device {comparison.one_device_loss:.6f}")
    print(f"loss and all {len(grads)} gradients equal one device's (worst relative error "
          f"{grads[worst]:.2g}, {worst})")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tensor_parallel_toy.examples.hf_any_tp",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="phi3",
                        help="the tiny random model's family (default: phi3)")
    options = parser.parse_args(argv)
    results = launch(run_rank, 2, options.family)  # under torchrun: this rank's result only
    if os.environ.get("RANK", "0") == "0":
        report(options.family, results[0])


if __name__ == "__main__":
    main()
