"""`compare_with_one_device` (apply/compare.py) on the nanoGPT-style example at TP 2: what its
report says when it cannot or should not find equality.

- Training mode with dropout in the tensor-parallel region (attention dropout marked
  NoParallel: each rank's own stream): the report says first that randomness differs by
  design and how to compare, blames no layer; the same model in eval mode equals one device.
- A fused c_attn split as plain rows: the hint names the c_attn layers only, not the correctly
  split c_fc whose gradients differ downstream of them.
- A model built in bf16 is compared as a bf16 model (against its exact fp32 copy), not reported
  all different; a model of mixed dtypes without `dtype=` is refused in one line.
"""
import dataclasses

import torch
from torch.distributed.tensor import Shard

from tensor_parallel_toy.apply import (ColwiseParallel, NoParallel, compare_with_one_device,
                                       parallelize_module)
from tensor_parallel_toy.examples import nanogpt_tp as ex

from .helpers import assert_one_line, value_error_messages


def _compare(build, plan, **kwargs):
    report = compare_with_one_device(build, lambda m, g: parallelize_module(m, g, plan),
                                     ex.batch_of(0), ex.gpt_loss, **kwargs)
    return {"ok": report.ok, "text": str(report), "plain": report.plain_column_layers}


def _on_rank_dropout_in_tp_region():
    config = dataclasses.replace(ex.CONFIG, dropout=0.3)
    plan = {**ex.make_plan(config), "transformer.h.*.attn.attn_dropout": NoParallel()}
    return {"train": _compare(lambda: ex.GPT(config), plan),
            "eval": _compare(lambda: ex.GPT(config).eval(), plan)}


def test_dropout_in_the_tp_region_is_said_first_to_differ_by_design(pools):
    for r in pools(2).run(_on_rank_dropout_in_tp_region):
        train, text = r["train"], r["train"]["text"]
        assert not train["ok"], text
        assert text.startswith("randomness differs from one device by design"), text
        assert "model.eval()" in text.splitlines()[0] and "p = 0" in text.splitlines()[0], text
        assert not train["plain"] and "split as plain rows" not in text, text
        assert r["eval"]["ok"], r["eval"]["text"]
        assert not r["eval"]["text"].startswith("randomness"), r["eval"]["text"]


def _on_rank_plain_c_attn():
    plan = {**ex.make_plan(ex.CONFIG),
            "transformer.h.*.attn.c_attn": ColwiseParallel(input_layouts=Shard(1))}
    return _compare(lambda: ex.GPT(ex.CONFIG), plan)


def test_plain_rows_hint_names_only_the_layers_at_fault(pools):
    for r in pools(2).run(_on_rank_plain_c_attn):
        assert not r["ok"], r["text"]
        assert sorted(r["plain"]) == ["transformer.h.0.attn.c_attn",
                                      "transformer.h.1.attn.c_attn"], r["text"]
        assert "c_fc" not in r["text"].splitlines()[-1], r["text"]


def _on_rank_bf16_model():
    plan = ex.make_plan(ex.CONFIG)

    def mixed():
        model = ex.GPT(ex.CONFIG)
        model.transformer.ln_f.to(torch.bfloat16)
        return model

    refused = value_error_messages({"mixed": lambda: _compare(mixed, plan)})
    return {"bf16": _compare(lambda: ex.GPT(ex.CONFIG).to(torch.bfloat16), plan),
            "refused": refused["mixed"]}


def test_a_bf16_model_is_compared_in_bf16_and_mixed_dtypes_are_refused(pools):
    for r in pools(2).run(_on_rank_bf16_model):
        assert r["bf16"]["ok"], r["bf16"]["text"]
        assert_one_line(r["refused"], ["torch.bfloat16", "torch.float32", "dtype="],
                        "a model of two dtypes")
