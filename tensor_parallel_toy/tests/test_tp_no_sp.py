"""Classic TP without sequence parallelism, as the profile measures it (profiling/run/tp_no_sp.py).

The baseline Transformer converted by `apply_tensor_parallel` must be the same model (the same
loss and gradient norm on the step as the unsplit baseline, plain PyTorch on one rank), and
it must save for backward more than TP with sequence parallelism and less than the baseline:
that is the bar the memory figure draws.
"""
import pytest

from tensor_parallel_toy import ModelConfig
from tensor_parallel_toy.profiling.run import tp_no_sp, train
from tensor_parallel_toy.profiling.spec import ProfileSpec


def _on_rank(spec):
    """This rank's classic-TP and baseline step, and the memory of step 0 of the SP mode."""
    return tp_no_sp.measure(spec), train.run_modes(("tp",), spec)["tp"]["memory"]


@pytest.mark.parametrize("kv_heads, dtype", [(None, "fp32"), (2, "fp32"), (None, "bf16")],
                         ids=["mha", "gqa", "mha-bf16"])
def test_classic_tp_is_the_baseline_model_and_saves_between_sp_and_the_baseline(pools, kv_heads,
                                                                              dtype):
    config = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=kv_heads, ffn_hidden_size=128, max_seq_len=15)
    spec = ProfileSpec(config=config, tp=2, steps=1, warmup=1, batch=3, seq=15, dtype=dtype,
                       modes=("tp",), progress=False)  # odd batch and sequence
    per_rank = pools(2).run(_on_rank, spec)
    result = tp_no_sp.summarize([classic for classic, _ in per_rank], dtype)

    tol = {"fp32": 1e-6, "bf16": 1e-3}[dtype]
    assert result["loss_rel_diff_vs_baseline"] <= tol, \
        (f"loss {result['loss']!r} vs baseline {result['baseline_loss']!r}: rel diff "
         f"{result['loss_rel_diff_vs_baseline']:.2e}, tolerance {tol:g}")
    assert result["grad_norm_rel_diff_vs_baseline"] <= 10 * tol, \
        (f"grad norm {result['grad_norm']!r} vs baseline {result['baseline_grad_norm']!r}: "
         f"rel diff {result['grad_norm_rel_diff_vs_baseline']:.2e}")
    base = result["baseline_memory"]["saved_activation_bytes"]
    for rank, ((classic, sp_memory), mem) in enumerate(zip(per_rank, result["memory_per_rank"])):
        act, sp = mem["saved_activation_bytes"], sp_memory["saved_activation_bytes"]
        assert sp < act < base, (f"rank {rank}: saved activations, TP with SP {sp}, classic TP "
                                 f"{act}, baseline {base} bytes: expected in that order")
        assert mem["param_bytes"] < result["baseline_memory"]["param_bytes"], (rank, mem)
        assert mem["optimizer_bytes"] > 0 and mem["grad_bytes"] == mem["param_bytes"], mem


def test_a_loss_that_is_not_the_baselines_is_refused_with_the_numbers():
    memory = {"saved_activation_bytes": 1, "param_bytes": 1}
    ranks = [{"baseline": {"loss": 2.0, "grad_norm": 1.0, "memory": memory},
              "tp_no_sp": {"loss": 2.01, "grad_norm": 1.0, "memory": memory}}] * 2
    with pytest.raises(RuntimeError, match=r"loss 2\.01 differs from the baseline's 2\.0 by "
                                           r"5\.00e-03 relative"):
        tp_no_sp.summarize(ranks, "fp32")
    assert tp_no_sp.summarize(ranks, "bf16")["loss_rel_diff_vs_baseline"] == pytest.approx(5e-3)


@pytest.mark.parametrize("kwargs, words", [
    ({"mlp": "swiglu"}, ["mlp='swiglu'", "gate rows only"]),
    ({"num_kv_heads": 1}, ["num_kv_heads=1", "2 ranks"]),
])
def test_configs_classic_tp_cannot_split_are_named(kwargs, words):
    config = ModelConfig(vocab_size=128, hidden_size=64, num_layers=1, num_heads=4,
                         ffn_hidden_size=128, max_seq_len=16, **kwargs)
    reason = tp_no_sp.unsupported(config, 2)
    assert reason is not None and all(w in reason for w in words), reason
    assert tp_no_sp.unsupported(ModelConfig(vocab_size=128, hidden_size=64, num_layers=1,
                                            num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                                            max_seq_len=16), 2) is None
