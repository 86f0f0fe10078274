"""What one profile run is: the typed spec every phase receives, and its defaults, defined once.

The command line (cli.py) builds a `ProfileSpec` from its flags, whose defaults are read from
here; the ranks receive it whole (it is pickled to each worker) and read typed fields, so a
phase cannot ask for a key nobody set, nor find a default that disagrees with the flag's.
"""
import dataclasses
import os
from typing import Optional, Tuple, Union

import torch

from ..config import ModelConfig

MODES = ("baseline", "tp", "tp_overlap", "tp_halves", "dtensor", "hf_dtensor")  # in run order
# --model: the MLP of the profile's network, and the modes that can run it (default: all of them).
# PyTorch's plan for our Transformer names the GELU MLP; on the Llama network it runs on a
# Hugging Face LlamaForCausalLM instead (hf_dtensor), holding the same weights.
MODELS = {"default": {"mlp": "gelu",
                     "modes": ("baseline", "tp", "tp_overlap", "tp_halves", "dtensor")},
          "llama": {"mlp": "swiglu",
                    "modes": ("baseline", "tp", "tp_overlap", "tp_halves", "hf_dtensor")}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# The profile's model, larger than ModelConfig's defaults: big enough for the GEMMs to matter.
MODEL_DEFAULTS = {"hidden_size": 256, "num_layers": 2, "num_heads": 8, "ffn_hidden_size": 1024,
                  "vocab_size": 256}
SEQ = 128  # the sequence length, which is also the model's max_seq_len


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
    config: ModelConfig = ModelConfig(**MODEL_DEFAULTS, max_seq_len=SEQ)
    tp: int = 2
    dp: int = 1  # data-parallel size: dp > 1 makes the TP modes 2-D, dp x tp ranks (run/train.py)
    steps: int = 60  # training steps per mode
    warmup: int = 5  # first steps left out of the timing statistics (at least 1)
    batch: int = 8  # global batch size
    seq: int = SEQ
    lr: float = 1e-3  # AdamW, ramped over the first train.LR_WARMUP_STEPS steps
    dtype: str = "fp32"  # a key of DTYPES
    seed: int = 0  # weights and data
    model: str = "default"  # a key of MODELS
    modes: Tuple[str, ...] = MODELS["default"]["modes"]
    threads: Optional[int] = None  # torch threads per rank; None: CPU cores / ranks
    baseline_threads: int = os.cpu_count() or 1  # the baseline runs alone: every core
    bench_iters: int = 60  # timed rounds per op in the overlap benchmark; 0 skips it
    bench_warmup: int = 3  # untimed rounds before them
    bench_shape: Optional[Tuple[int, int, int, int]] = None  # S, B, H, F; None: calibrated
    timeline_iters: int = 11  # timeline recordings per mode; 0 skips it
    trace_dir: Optional[str] = None  # where torch.profiler traces go; None: no trace
    progress: bool = True  # print a line per mode on rank 0
    # The replicated-gradient guard of the TP modes (replicated_grads.py): "first" (after the
    # first backward), N (every N-th backward) or None (off). 2-D runs leave it off (below).
    check_replicated_grads: Union[str, int, None] = "first"
    ring_pieces: int = 1  # tp_overlap's ring: transfers per chunk (the layers' ring_pieces)
    wire: Optional[dict] = None  # --link model:RATE: the modeled wire (wire.parse); None: none

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]
