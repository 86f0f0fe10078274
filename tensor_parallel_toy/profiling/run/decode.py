"""`python -m tensor_parallel_toy.profiling.run.decode`: what tensor parallelism costs, and saves,
per generated token.

For each batch size (default 1, 4, 16): `inference.generate` prefills a prompt of `--prompt`
tokens and decodes `--tokens` more, greedily, at TP 1 (one rank, the others waiting) and at TP p
(every rank of the pool), interleaved `--repeats` times so that load from outside hits both
alike. Each rank is one process with one thread, as a GPU is one device.

Per mode and batch size:
- decode latency per token: (time of prefill + n tokens - time of prefill + 1 token) / (n - 1),
  so the prefill and the first token drop out, median over the repeats, with its spread;
  throughput is b tokens per that latency;
- prefill: the time of prefill + 1 token;
- communication per decode token, from every transfer the ranks make (watched from outside,
  measure/transfers.py): how many, their bytes, and the time blocked in them (gloo's collectives
  block the host: that time is the transfer, plus any wait for the slower rank); compute is the
  rest of the token's latency;
- the KV cache per rank, allocated, against 2 * layers * b * length * (k/v heads here) * head
  size * bytes;
- with `--hf`, transformers' own TP of the same weights (`hf_tp.py`), its latency only: some of
  its collectives do not go through torch.distributed's module attributes, where the transfers
  are watched, so its transfer counts would be short.

Why the numbers come out as they do: a decode step has one token per sequence, so its GEMMs are
[b, h] times a weight, few FLOPs per weight byte read, and the two all-reduces of [b, h] per
block are small, latency-bound messages. TP halves the weight bytes each rank reads and adds
those all-reduces: it pays where reading the weights costs more than the messages, and only
costs where the messages' latency dominates (small models, small batches, slow links).
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from ...config import ModelConfig
from ...guards.collectives import barrier, broadcast_, reduce_numbers
from ...inference.generate import KVCache, generate
from ...launcher.initialize import current_device, init_from_env, shutdown
from ...launcher.pool import WorkerPool
from ..measure.metrics import summarize
from ..measure.transfers import recording
from ..wires import link

PROG = "python -m tensor_parallel_toy.profiling.run.decode"
# Big enough that a token's GEMMs are not lost in Python's overhead on a CPU, small enough to
# run in about a minute on 2 cores.
DEFAULT_CONFIG = dict(vocab_size=8192, hidden_size=1024, num_layers=4, num_heads=16,
                      num_kv_heads=8, ffn_hidden_size=4096, max_seq_len=256, mlp="swiglu")


class _Blocked:
    """A recorder (measure/transfers.py) that counts the transfers and the time blocked in them."""

    def __init__(self):
        self.count, self.bytes, self.seconds = 0, 0, 0.0

    def transfer(self, kind, nbytes, post):
        start = time.perf_counter()
        handle = post()
        if handle is not None:
            handle.wait()
        self.seconds += time.perf_counter() - start
        self.count, self.bytes = self.count + 1, self.bytes + nbytes
        return None if handle is None else _Done()


class _Done:
    def wait(self):
        pass


def _timed(run, ids, n):
    """(seconds, transfers) of `run(ids, n)`: generating n tokens after `ids`."""
    recorder = _Blocked()
    with recording(recorder):
        start = time.perf_counter()
        run(ids, n)
        seconds = time.perf_counter() - start
    return seconds, recorder


def _ours(model):
    return lambda ids, n: generate(model, ids, max_new_tokens=n)


def _on_rank(config_fields, batches, prompt, tokens, repeats, seed, hf_folder=None):
    """On every rank: the TP model over the pool, and on rank 0 the one-device model, timed;
    with `hf_folder`, also transformers' own TP of the same weights (`hf_tp.py`)."""
    from ...model import Transformer
    from ...support.sharding import full_state_dict

    group, rank = dist.group.WORLD, dist.get_rank()
    device = current_device()  # this rank's GPU under NCCL, else the CPU
    config = ModelConfig(**config_fields)
    torch.manual_seed(seed)
    tp = Transformer(config, tp_group=group, seed=seed).to(device).eval()
    full = full_state_dict(tp)
    one = None
    if rank == 0:
        one = Transformer(config, seed=seed).to(device).eval()
        one.load_state_dict(full)
    runs = {"tp1": _ours(one) if one else None, "tp": _ours(tp)}
    if hf_folder:
        from . import hf_tp
        if rank == 0:
            hf_tp.save_checkpoint(config, full, hf_folder)
        barrier(group)
        hf = hf_tp.load_tp(hf_folder)
        runs["hf_tp"] = lambda ids, n: hf_tp.greedy(hf, ids, n)
    del full
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for repeat in range(repeats + 1):  # the first round warms up and is dropped
        for b in batches:
            ids = torch.randint(0, config.vocab_size, (b, prompt), generator=gen).to(device)
            broadcast_(ids, 0, group)  # the same prompts on every rank
            for mode, run in runs.items():
                for n in (1, tokens):
                    barrier(group)  # every rank starts together
                    if mode != "tp1":
                        seconds, seen = _timed(run, ids, n)
                    else:  # one device: rank 0 alone, the others wait at the next barrier
                        seconds, seen = _timed(run, ids, n) if rank == 0 else (0.0, _Blocked())
                    if repeat:
                        rows.append(dict(mode=mode, batch=b, new=n, seconds=seconds,
                                         comm_s=seen.seconds, transfers=seen.count,
                                         bytes=seen.bytes))
    caches = {b: {"tp": KVCache(tp, b, prompt + tokens).nbytes(),
                  "tp1": KVCache(one, b, prompt + tokens).nbytes() if one else 0}
              for b in batches}
    # The slowest rank's time for the TP rows: the step is done when every rank is.
    slowest = reduce_numbers([r["seconds"] for r in rows], group, dist.ReduceOp.MAX)
    for row, seconds in zip(rows, slowest):
        if row["mode"] != "tp1":
            row["seconds"] = seconds
    return {"rows": rows, "caches": caches}


# The back-of-envelope for a GPU node, read, not run: an H100 SXM reads its HBM3 at 3.35 TB/s
# (NVIDIA's H100 datasheet). A decode step's GEMMs read every weight once for a few tokens, so
# reading the weights is their time; Llama 3 70B's block (hidden 8192, 64 query and 8 k/v heads
# of 128, SwiGLU 28672: its config.json) is the large model beside ours.
HBM_BYTES_PER_S = 3.35e12
LLAMA3_70B_BLOCK = dict(hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672)


def block_params(hidden, heads, kv_heads, head_dim, ffn):
    """Weights of one block with grouped-query attention and a SwiGLU MLP."""
    return (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
            + 3 * hidden * ffn)  # gate, up, down


def gpu_envelope(config, p, element_size=2):
    """Per block and decode token on one H100, in microseconds: reading the block's bf16
    weights, and the most each of TP p's two all-reduces may cost for TP p to still lower the
    latency (it saves (1 - 1/p) of the read); ours and Llama 3 70B's."""
    out = {}
    for name, shape in [("this model", dict(hidden=config.hidden_size, heads=config.num_heads,
                                            kv_heads=config.num_kv_heads,
                                            head_dim=config.head_dim,
                                            ffn=config.ffn_hidden_size)),
                        ("Llama 3 70B", LLAMA3_70B_BLOCK)]:
        read_us = block_params(**shape) * element_size / HBM_BYTES_PER_S * 1e6
        out[name] = {"read_us": read_us, "break_even_all_reduce_us": read_us * (1 - 1 / p) / 2}
    return out


def kv_cache_formula(config, batch, length, p, element_size=4):
    """Bytes of one rank's KV cache: keys and values, per layer, of its k/v heads."""
    heads_here = max(config.num_kv_heads // p, 1)
    return 2 * config.num_layers * batch * length * heads_here * config.head_dim * element_size


def summarize_rows(rows, tokens):
    """Per (mode, batch): the decode latency per token, throughput, prefill, and per token the
    transfers, their bytes and the time blocked in them."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for b in sorted({r["batch"] for r in rows}):
            one = [r for r in rows if (r["mode"], r["batch"], r["new"]) == (mode, b, 1)]
            many = [r for r in rows if (r["mode"], r["batch"], r["new"]) == (mode, b, tokens)]
            per = [(m["seconds"] - o["seconds"]) / (tokens - 1) for o, m in zip(one, many)]
            comm = [(m["comm_s"] - o["comm_s"]) / (tokens - 1) for o, m in zip(one, many)]
            latency = summarize(per)
            out[f"{mode}/b{b}"] = {
                "mode": mode, "batch": b, "latency_ms": {k: v * 1e3 if k != "n" else v
                                                         for k, v in latency.items()},
                "tokens_per_s": b / latency["median"],
                "prefill_ms": summarize([o["seconds"] for o in one])["median"] * 1e3,
                "comm_ms": summarize(comm)["median"] * 1e3,
                "transfers_per_token": (many[0]["transfers"] - one[0]["transfers"]) / (tokens - 1),
                "bytes_per_token": (many[0]["bytes"] - one[0]["bytes"]) / (tokens - 1)}
    for key, entry in out.items():  # beside TP 1 at the same batch size, for the post
        if entry["mode"] != "tp1":
            one = out[f"tp1/b{entry['batch']}"]
            entry["latency_vs_tp1"] = entry["latency_ms"]["median"] / one["latency_ms"]["median"]
            entry["prefill_vs_tp1"] = entry["prefill_ms"] / one["prefill_ms"]
            entry["ms_per_transfer"] = entry["comm_ms"] / max(entry["transfers_per_token"], 1)
    return out


def report(results):
    """The summary: one line per batch size, TP 1 beside TP p, then where TP pays."""
    p = results["tp"]
    wire = results.get("link")
    wire = (f"a shaped veth link of {wire['rate']} (measured "
            f"{wire['measured_bits_per_s'] / 1e9:.2f} Gbit/s)" if wire else "loopback")
    lines = [f"decode, {results['model']}: prompt {results['prompt']} tokens, "
             f"{results['tokens']} generated; TP 1 (one rank) vs TP {p} over {wire}, medians of "
             f"{results['repeats']} interleaved repeats, {results['threads_per_rank']} thread(s) "
             f"per rank",
             f"  {'batch':>5}  {'ms/token TP1':>12}  {f'TP{p}':>6}  {'ratio':>5}  "
             f"{f'TP{p} comm':>10}  {'tokens/s TP1':>12}  {f'TP{p}':>6}  "
             f"{'prefill ms TP1':>14}  {f'TP{p}':>6}"]
    modes = results["modes"]
    tps = {b: modes[f"tp/b{b}"] for b in results["batches"]}
    for b, tp in tps.items():
        one = modes[f"tp1/b{b}"]
        lines.append(
            f"  {b:>5}  {one['latency_ms']['median']:>12.2f}  {tp['latency_ms']['median']:>6.2f}"
            f"  {tp['latency_vs_tp1']:>5.2f}  {tp['comm_ms']:>7.2f} ms  "
            f"{one['tokens_per_s']:>12.0f}  {tp['tokens_per_s']:>6.0f}  "
            f"{one['prefill_ms']:>14.1f}  {tp['prefill_ms']:>6.1f}")
    b0 = results["batches"][0]
    cache, tp0 = results["kv_cache"][str(b0)], results["modes"][f"tp/b{b0}"]
    lines.append(f"  per token, TP {p} makes {tp0['transfers_per_token']:.0f} transfers "
                 f"({tp0['bytes_per_token'] / 1024:.1f} KiB from each rank at batch {b0}); KV "
                 f"cache per rank at batch {b0}: TP 1 {cache['tp1']} B, TP {p} {cache['tp']} B "
                 f"(the formula: {cache['formula_tp']} B)")
    pays = [str(b) for b, tp in tps.items() if tp["latency_vs_tp1"] < 1]
    costs = [str(b) for b, tp in tps.items() if tp["latency_vs_tp1"] >= 1]
    compute = [(tp["latency_ms"]["median"] - tp["comm_ms"])
               / modes[f"tp1/b{b}"]["latency_ms"]["median"] for b, tp in tps.items()]
    prefill = [tp["prefill_vs_tp1"] for tp in tps.values()]
    lines.append(f"  decode: TP {p} lowers the latency per token at batch "
                 f"{', '.join(pays) or 'none measured'}, only costs at batch "
                 f"{', '.join(costs) or 'none measured'}. Its compute is "
                 f"{min(compute):.2f}-{max(compute):.2f} of TP 1's latency; each transfer "
                 f"costs {tp0['ms_per_transfer']:.2f} ms at batch {b0} (latency, not bytes)")
    lines.append(f"  prefill (every prompt token at once): TP {p} takes "
                 f"{min(prefill):.2f}-{max(prefill):.2f} of TP 1's time")
    if f"hf_tp/b{b0}" in modes:
        hf = [modes[f"hf_tp/b{b}"] for b in results["batches"]]
        lines.append(f"  transformers' own TP {p} (tp_plan=\"auto\", no SP) on the same weights: "
                     + ", ".join(f"{h['latency_ms']['median']:.2f}" for h in hf)
                     + f" ms/token at batch {', '.join(map(str, results['batches']))}")
    gpu = results["gpu_envelope"]
    lines.append("  on an H100 (read, not run): a block's bf16 weights take "
                 + "; ".join(f"{v['read_us']:.1f} us to read for {name}, so TP {p} pays at "
                             f"decode if each of its two all-reduces per block costs under "
                             f"{v['break_even_all_reduce_us']:.1f} us" for name, v in gpu.items()))
    return "\n".join(lines)


def _run_on_link(args, argv):
    """One rank per network namespace, each the torchrun path of this same command; rank 0
    prints the summary and writes the files."""
    try:
        bps = link.parse_rate(args.link)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "tensor_parallel_toy.profiling.run.decode",
               *[a for a in link.argv_for_ranks(argv, args.threads) if a not in ("--device",
                                                                                 "cpu")]]

    def run():
        link.check_host()
        with link.EmulatedLink(args.tp, bps, args.link) as net:
            net.run_ranks(command)
    return link.exit_status(PROG, run)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2, before any rank starts
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv=None, pool=None):
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="TP size (ranks); default 2")
    p.add_argument("--batches", default="1,4,16", help="batch sizes, comma-separated")
    p.add_argument("--prompt", type=int, default=32, help="prompt length (tokens)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated (>= 2)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (after one warm-up)")
    p.add_argument("--hidden", type=int, default=DEFAULT_CONFIG["hidden_size"])
    p.add_argument("--layers", type=int, default=DEFAULT_CONFIG["num_layers"])
    p.add_argument("--out", default=os.path.join("results", "decode"),
                   help="folder for decode.json and summary.txt")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="run each rank in its own network namespace behind a shaped veth link "
                        "of RATE (e.g. 1gbit; root; profiling/wires/link.py)")
    p.add_argument("--hf", action="store_true",
                   help="also time transformers' own TP of the same weights (tp_plan=\"auto\"; "
                        "needs transformers and accelerate)")
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)  # the link's ranks
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: give positive integers, comma-separated")
    problems = [f"--batches {args.batches!r}: give positive integers" if min(batches) < 1 else "",
                f"--tokens {args.tokens}: must be 2 or more" if args.tokens < 2 else "",
                f"--repeats {args.repeats}: must be 1 or more" if args.repeats < 1 else "",
                f"--prompt {args.prompt}: must be 1 or more" if args.prompt < 1 else "",
                f"--tp {args.tp}: must be 2 or more" if args.tp < 2 else ""]
    fields = dict(DEFAULT_CONFIG, hidden_size=args.hidden, num_layers=args.layers,
                  max_seq_len=max(DEFAULT_CONFIG["max_seq_len"], args.prompt + args.tokens))
    try:
        if any(problems):
            raise ValueError(next(x for x in problems if x))
        config = ModelConfig(**fields)
        config.check_tp_size(args.tp)
    except ValueError as e:
        p.error(str(e))
    hf_folder = os.path.abspath(os.path.join(args.out, "hf-checkpoint")) if args.hf else None
    job = (fields, batches, args.prompt, args.tokens, args.repeats, 0, hf_folder)
    described = json.loads(os.environ.get(link.LINK_ENV, "null"))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # one rank of torchrun or the link
        init_from_env()
        torch.set_num_threads(args.threads)
        try:
            first = _on_rank(*job)
        finally:
            shutdown()
        if os.environ["RANK"] != "0":
            return 0
    elif args.link:
        return _run_on_link(args, sys.argv[1:] if argv is None else argv)
    else:
        owned = pool is None
        pool = pool or WorkerPool(args.tp)
        try:
            first = pool.run(_on_rank, *job)[0]
        finally:
            if owned:
                pool.close()
    element = 4  # fp32
    results = {
        "model": f"hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} "
                 f"heads ({config.num_kv_heads} k/v), SwiGLU {config.ffn_hidden_size}, vocab "
                 f"{config.vocab_size}, fp32",
        "tp": args.tp, "batches": batches, "prompt": args.prompt, "tokens": args.tokens,
        "repeats": args.repeats, "threads_per_rank": args.threads, "link": described,
        "modes": summarize_rows(first["rows"], args.tokens),
        "gpu_envelope": gpu_envelope(config, args.tp), "hbm_tb_per_s": HBM_BYTES_PER_S / 1e12,
        "kv_cache": {str(b): {**first["caches"][b],
                              "formula_tp": kv_cache_formula(config, b, args.prompt + args.tokens,
                                                             args.tp, element),
                              "formula_tp1": kv_cache_formula(config, b,
                                                              args.prompt + args.tokens, 1,
                                                              element)}
                     for b in batches},
    }
    if hf_folder:
        shutil.rmtree(hf_folder, ignore_errors=True)
    text = report(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
