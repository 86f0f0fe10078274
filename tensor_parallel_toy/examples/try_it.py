"""One column-parallel layer on 2 CPU ranks, checked against F.linear: run it with
`python -m tensor_parallel_toy.examples.try_it`."""
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tensor_parallel_toy import ColumnParallelLinear


def rank_main(rank, p, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p)
    torch.manual_seed(0)  # the same full tensors on every rank
    x = torch.randn(8, 2, 16, requires_grad=True)  # [s, b, in]: sequence first
    w = torch.randn(32, 16, requires_grad=True)  # the whole layer's weight [out, in]
    layer = ColumnParallelLinear(16, 32, tp_group=dist.group.WORLD)
    with torch.no_grad():
        layer.weight.copy_(w.chunk(p)[rank])  # this rank's output rows [out/p, in]
    x_local = x.detach().chunk(p)[rank].requires_grad_()  # this rank's tokens [s/p, b, in]
    y_local = layer(x_local)  # all-gather the sequence, then GEMM: [s, b, out/p]
    y = F.linear(x, w)  # the same layer on one device: [s, b, out]
    torch.testing.assert_close(y_local, y.chunk(p, dim=-1)[rank])
    y_local.pow(2).sum().backward()  # each rank's share of one loss, sum((x w^T)^2)
    y.pow(2).sum().backward()
    torch.testing.assert_close(x_local.grad, x.grad.chunk(p)[rank])  # reduce-scattered dX
    torch.testing.assert_close(layer.weight.grad, w.grad.chunk(p)[rank])
    for turn in range(p):  # one rank at a time: lines printed at once can interleave
        if turn == rank:
            print(f"rank {rank}: output, dX and dW equal F.linear's", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port), nprocs=2)
