"""Hugging Face's own tensor parallelism, beside ours, for generation: what a `transformers`
user would pick instead, `from_pretrained(path, tp_plan="auto")`.

transformers splits a Llama by the plan its model class declares: q, k, v, gate and up
column-wise, o and down row-wise (an all-reduce each, under `torch.no_grad` a plain
`dist.all_reduce`), the embedding by vocabulary rows and the head column-wise with its output
gathered. The norms stay whole on every rank and nothing is split along the sequence: there is
no sequence parallelism (its `DistributedConfig` reserves `enable_sequence_parallel`, not wired
up in 5.23). So at decode it makes the same transfers as `inference.generate`, less the tokens'
check.

Loading needs `accelerate` installed (transformers refuses a `tp_plan` without it, though this
path runs none of its code) and torchrun's RANK, LOCAL_RANK and WORLD_SIZE in the environment;
it reuses a default process group that already exists. A `WorkerPool`'s ranks are given the
three variables for the load only. `transformers` is imported only here.
"""
import contextlib
import os

import torch
import torch.distributed as dist

from ...interop.hf_checkpoint import to_hf
from .hf_llama import hf_llama_config


def save_checkpoint(config, state, folder):
    """Our baseline's `state` as a Hugging Face Llama checkpoint in `folder` (save_pretrained)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_llama_config(config))
    model.load_state_dict(to_hf(config, state), strict=True)
    model.save_pretrained(folder)


@contextlib.contextmanager
def _torchrun_environment():
    """RANK, LOCAL_RANK and WORLD_SIZE as torchrun sets them, for as long as the block runs."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=before["LOCAL_RANK"] or str(dist.get_rank()))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_tp(folder):
    """On every rank of the default group: the checkpoint in `folder` split by transformers'
    own plan over all the ranks (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    with _torchrun_environment():
        model = AutoModelForCausalLM.from_pretrained(
            folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32)
    return model.eval()


def greedy(model, ids, new_tokens):
    """Exactly `new_tokens` greedy tokens after `ids` (no end token), as `inference.generate`
    produces them."""
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          eos_token_id=None, pad_token_id=0)
