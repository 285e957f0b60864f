# E6: Megatron's f (identity forward, all-reduce backward) as an autograd.Function over functional
# collectives, applied to a Replicate DTensor parameter's local tensor in an SP region; traced by
# torch.compile (aot_eager).
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return funcol.wait_tensor(
            torch.ops._c10d_functional.all_reduce(g.contiguous(), "sum", ctx.group_name)
        ), None


def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    gname = mesh.get_group().group_name
    torch.manual_seed(0)
    h, s = 4, 8
    w_full = torch.randn(h)
    x = torch.randn(1, s, h)
    p = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Replicate()]))

    def step(xs, p):
        w = F.apply(p.to_local(), gname)
        return (torch.nn.functional.layer_norm(xs, (h,), w) ** 2).sum()

    xs = x[:, rank * s // world : (rank + 1) * s // world]
    torch.compile(step, backend="aot_eager", fullgraph=True)(xs, p).backward()
    wr = w_full.clone().requires_grad_()
    (torch.nn.functional.layer_norm(x, (h,), wr) ** 2).sum().backward()
    print(
        rank,
        "grad placements",
        p.grad.placements,
        "equal single-process:",
        torch.allclose(p.grad.to_local(), wr.grad, atol=1e-5),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, 29531), nprocs=2)
