"""When can overlap pay on GPUs? A back-of-envelope for one tensor-parallel linear layer.

A column layer all-gathers its input `[s, b, h]` along the sequence and multiplies by its
weight rows `[n/p, h]`; a row layer multiplies `[s, b, n/p]` by its weight columns `[h, n/p]`
and reduce-scatters the `[s, b, h]` partial sums. `n` is the layer's other width: the MLP size
for fc1 and fc2, the q/k/v width for qkv, `h` for the attention's output projection.
Either way, per rank and per pass:

    bytes sent:  (p - 1)/p · s·b·h · B           (a ring all-gather or reduce-scatter)
    GEMM FLOPs:  2 · s·b·h · n / p

so with a link of `link_bytes_per_s` (one direction, per GPU) and `flops_per_s`,

    T_comm / T_gemm = (p - 1) · B · flops_per_s / (2 · n · link_bytes_per_s)

`s`, `b` and `h` cancel: the ratio depends on the hardware, the TP size and one width.
`ratio` is that formula; `layer_times` counts the two sides directly, for a test to compare.
The hardware numbers are peak datasheet rates; achieved rates are lower on both sides.
"""
from dataclasses import dataclass

BF16 = 2  # bytes per element


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float  # one direction, per GPU


# NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16; NVLink 4 is 900 GB/s per GPU counting
# both directions (450 GB/s each way is the line rate; NCCL's tests reach about 370 GB/s);
# a ConnectX-7 NIC per GPU gives 400 Gbit/s. One NIC is what a single flat ring of P2P sends
# crossing between servers gets; NCCL runs several rings at once, each leaving the server
# through another of its 8 NICs, about 8 x 50 GB/s per server.
H100_BF16_FLOPS = 989e12
NVLINK_H100 = Link("NVLink 4 (H100), line rate", 450e9)
INFINIBAND_NDR = Link("InfiniBand NDR, one 400 Gbit/s NIC (one flat ring)", 50e9)
INFINIBAND_8_NICS = Link("InfiniBand NDR, NCCL over a server's 8 NICs", 400e9)

# Llama 3 70B (Dubey et al. 2024): hidden 8192, MLP 28672 (SwiGLU: fc1 holds gate and up),
# 64 query heads and 8 k/v heads of 128.
LLAMA3_70B = {"h": 8192, "m": 28672, "heads": 64, "kv_heads": 8, "head_dim": 128}


# Decode, read, not run: an H100 SXM has 80 GB of HBM3 read at 3.35 TB/s (datasheet). Llama 3
# 70B has 80 blocks and a 128,256-token vocabulary, its embedding and head untied.
H100_HBM_BYTES, H100_HBM_BYTES_PER_S = 80e9, 3.35e12
LLAMA3_70B_LAYERS, LLAMA3_70B_VOCAB = 80, 128256


def decode_block_params(model=LLAMA3_70B):
    """Weights of one block: q and o [h, heads·d], k and v [h, kv_heads·d], SwiGLU's three."""
    h, d = model["h"], model["head_dim"]
    return 2 * h * model["heads"] * d + 2 * h * model["kv_heads"] * d + 3 * h * model["m"]


def decode_tp8_vs_tp4(model=LLAMA3_70B, bytes_per_element=BF16):
    """Decode per block and token, in microseconds and GB: a decode GEMM reads each weight for a
    handful of tokens, so its time is the rank's weight bytes over HBM bandwidth (the KV cache's
    reads are left out). TP 8 reads half of TP 4's share, saving read/8 per block; it pays while
    each of its block's two all-reduces costs at most read/16 more than TP 4's."""
    block = decode_block_params(model) * bytes_per_element
    read_us = block / H100_HBM_BYTES_PER_S * 1e6
    weights = (LLAMA3_70B_LAYERS * decode_block_params(model)
               + 2 * LLAMA3_70B_VOCAB * model["h"]) * bytes_per_element
    return {"weights_gb": weights / 1e9, "tp4_gb": weights / 4 / 1e9,
            "tp4_us": read_us / 4, "tp8_us": read_us / 8, "extra_us": read_us / 16}


def layer_widths(model=LLAMA3_70B):
    """{layer: n}, the width each of a block's four TP layers splits over the ranks."""
    h, m, d = model["h"], model["m"], model["head_dim"]
    return {"qkv": (model["heads"] + 2 * model["kv_heads"]) * d, "proj": h,
            "fc1": 2 * m, "fc2": m}


def ratio(p, n, link, flops_per_s=H100_BF16_FLOPS, bytes_per_element=BF16):
    """T_comm / T_gemm of one TP layer of width `n` at TP size `p` (the formula above)."""
    if p < 2 or n < 1:
        raise ValueError(f"need p >= 2 and n >= 1, got p={p}, n={n}")
    return (p - 1) * bytes_per_element * flops_per_s / (2 * n * link.bytes_per_s)


def layer_times(s, b, h, n, p, link, flops_per_s=H100_BF16_FLOPS, bytes_per_element=BF16):
    """(T_comm, T_gemm) in seconds, counted directly: the p - 1 ring steps that each send one
    [s/p, b, h] chunk, and the per-rank GEMM of [s·b, h] by [h, n/p] (or its transpose)."""
    chunk_bytes = (s // p) * b * h * bytes_per_element
    t_comm = (p - 1) * chunk_bytes / link.bytes_per_s
    t_gemm = 2 * (s * b) * h * (n // p) / flops_per_s
    return t_comm, t_gemm


ROWS = [(2, NVLINK_H100), (4, NVLINK_H100), (8, NVLINK_H100), (16, INFINIBAND_NDR),
        (16, INFINIBAND_8_NICS)]


def table(model=LLAMA3_70B, rows=ROWS):
    """The post's markdown rows: per TP size and link, T_comm / T_gemm of each layer, and of
    the whole block (four collectives against the four GEMMs)."""
    widths = layer_widths(model)
    lines = []
    for p, link in rows:
        cells = [f"{ratio(p, n, link):.2f}" for n in widths.values()]
        block = 4 * ratio(p, sum(widths.values()), link)  # 4 collectives, 4 GEMMs
        lines.append(f"| {p} | {link.name} | " + " | ".join(cells) + f" | {block:.2f} |")
    return "\n".join(lines)


def named():
    """The numbers the post quotes, by placeholder name."""
    widths = layer_widths()
    out = {"envelope_table": table(),
           "env.flops": f"{H100_BF16_FLOPS / 1e12:.0f}",
           "env.nvlink": f"{NVLINK_H100.bytes_per_s / 1e9:.0f}",
           "env.ib": f"{INFINIBAND_NDR.bytes_per_s / 1e9:.0f}",
           "env.ib_gbit": f"{INFINIBAND_NDR.bytes_per_s * 8 / 1e9:.0f}"}
    out.update({f"env.n.{name}": f"{n:,}" for name, n in widths.items()})
    out.update({f"env.{k}": f"{v:,}" for k, v in LLAMA3_70B.items()})
    for p, link in ROWS[:3]:  # the block's ratio, and the most overlap could save, pooled
        r = 4 * ratio(p, sum(widths.values()), link)
        out[f"env.block.p{p}"] = f"{r:.2f}"
        out[f"env.hide.p{p}"] = f"{min(r, 1) / (1 + r) * 100:.0f} %"
        out[f"env.layerwise.p{p}"] = f"{layerwise_saving(p, link) * 100:.0f} %"
    out["env.block.p16_1nic"] = f"{4 * ratio(16, sum(widths.values()), INFINIBAND_NDR):.1f}"
    out["env.block.p16_8nic"] = f"{4 * ratio(16, sum(widths.values()), INFINIBAND_8_NICS):.1f}"
    for p in (2, 4, 8):  # each layer's GEMM time in units of its transfer's (all send alike)
        c = ratio(p, 1, NVLINK_H100)
        gemms = {name: n / c for name, n in widths.items()}
        out.update({f"env.g{p}.{name}": f"{g:.2f}" for name, g in gemms.items()})
        out[f"env.g{p}.saved"] = f"{sum(min(1.0, g) for g in gemms.values()):.2f}"
        out[f"env.g{p}.gemms"] = f"{sum(gemms.values()):.2f}"
        out[f"env.g{p}.total"] = f"{4 + sum(gemms.values()):.2f}"
    decode = decode_tp8_vs_tp4()
    out.update({"env.decode.weights_gb": f"{decode['weights_gb']:.0f}",
                "env.decode.hbm_gb": f"{H100_HBM_BYTES / 1e9:.0f}",
                "env.decode.tp4_gb": f"{decode['tp4_gb']:.0f}",
                "env.decode.tp4_us": f"{decode['tp4_us']:.1f}",
                "env.decode.tp8_us": f"{decode['tp8_us']:.1f}",
                "env.decode.extra_us": f"{decode['extra_us']:.1f}"})
    fwd, bwd, step = pass_ratios(8, NVLINK_H100)
    out.update({"env.fwd.p8": f"{fwd:.2f}", "env.bwd.p8": f"{bwd:.2f}",
                "env.step.p8": f"{step:.2f}"})
    return out


def layerwise_saving(p, link, model=LLAMA3_70B):
    """The most a block's forward could save by overlap, as a share of its unoverlapped TP
    time: each layer's ring hides only its own transfer, so sum_i min(C_i, G_i) over
    sum_i (C_i + G_i), with C_i the layer's transfer time and G_i its GEMM's."""
    t_comm = ratio(p, 1, link)  # every layer sends the same bytes; in units of a width-1 GEMM
    saved = sum(min(t_comm, n) for n in layer_widths(model).values())
    return saved / (4 * t_comm + sum(layer_widths(model).values()))


def pass_ratios(p, link, model=LLAMA3_70B):
    """T_comm / T_gemm of a block's forward, backward and whole step, the four layers together.
    Forward: one transfer and one GEMM per layer. Backward: two GEMMs per layer (dX, dW); a
    column layer re-gathers its input and reduce-scatters dX (two transfers), a row layer
    gathers dY (one)."""
    widths = layer_widths(model)
    t_comm = ratio(p, 1, link)  # one layer's transfer, in units of a width-1 GEMM
    gemm = sum(widths.values())
    fwd = 4 * t_comm / gemm
    bwd = (2 + 1 + 2 + 1) * t_comm / (2 * gemm)
    step = (4 + 6) * t_comm / (3 * gemm)
    return fwd, bwd, step
