"""The GEMM plumbing of the layers in parallel_linear.py: 2-D views, GEMMs written into slices,
and the fp32 sum of a weight gradient computed chunk by chunk.

Nothing here communicates; it keeps the layers' Functions down to the GEMMs and transfers they
are about.
"""
import torch


def flat(t):
    """[s, b, n] -> [s*b, n] view (the layers' GEMMs are plain 2-D matmuls)."""
    return t.reshape(-1, t.shape[-1])


def linear_into(out, x, weight, bias):
    """out = x @ weight^T + bias, written into `out` (a slice of a bigger tensor) directly."""
    if bias is None:
        torch.mm(flat(x), weight.t(), out=flat(out))
    else:
        torch.addmm(bias, flat(x), weight.t(), out=flat(out))


def bias_grad(dy):
    """The gradient of a bias added to every row of dy's rows: their sum."""
    return flat(dy).sum(dim=0)


_FP32_OUT_GEMM = {}  # device type -> whether a bf16/fp16 GEMM can write fp32 there (out_dtype)


def has_fp32_out_gemm(device):
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` runs on this device for bf16 inputs:
    on CUDA it does (one tensor-core GEMM, fp32 output), on CPU torch 2.13 has no such kernel.
    Asked once per device type, by trying."""
    if device.type not in _FP32_OUT_GEMM:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        try:
            _FP32_OUT_GEMM[device.type] = torch.mm(a, a, out_dtype=torch.float32).dtype == \
                torch.float32
        except (NotImplementedError, RuntimeError, TypeError):
            _FP32_OUT_GEMM[device.type] = False
    return _FP32_OUT_GEMM[device.type]


class WeightGradAccumulator:
    """dW = sum over chunks c of dY_c^T X_c, summed in fp32 whatever the weight's dtype.

    Summing bf16 partial products in bf16 rounds once per chunk; one GEMM over the whole
    sequence (the basic layers) rounds once at the end. Accumulating in fp32 and rounding once
    keeps the overlapped weight gradient as accurate as the basic one (Megatron does the same
    with its fused fp32 gradient accumulation). For bf16 inputs, where the device has a GEMM
    that reads bf16 and writes fp32 (CUDA: `out_dtype`), each chunk is one such GEMM at bf16
    speed into a scratch buffer, then added; elsewhere (CPU) the chunks are upcast and
    multiplied in fp32, which is slower but the same arithmetic.
    """

    def __init__(self, weight):
        self.dtype = weight.dtype
        self.acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        self.fp32_out = self.dtype != torch.float32 and has_fp32_out_gemm(weight.device)
        self.scratch = torch.empty_like(self.acc) if self.fp32_out else None

    def add(self, dy_c, x_c):
        dy_c, x_c = flat(dy_c), flat(x_c)
        if self.fp32_out:
            # addmm's out_dtype form wants its addend in the inputs' dtype: multiply, then add.
            torch.mm(dy_c.t(), x_c, out_dtype=torch.float32, out=self.scratch)
            self.acc.add_(self.scratch)
            return
        if self.dtype != torch.float32:
            dy_c, x_c = dy_c.float(), x_c.float()
        self.acc.addmm_(dy_c.t(), x_c)

    def result(self):
        return self.acc.to(self.dtype)
