# E2/E3: a hand-written SP -> column -> row -> SP pair with functional collectives (autograd-registered),
# compiled with aot_eager; print the joint graph's collectives; then recompute the all_gather in the
# backward by tagging it (and its wait) MUST_RECOMPUTE and running torch's min-cut partitioner.
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import CheckpointPolicy


def run(rank, world, port, recompute):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = mesh.get_group()
    torch.manual_seed(0)
    b, s, h = 1, 8, 4
    W1 = torch.randn(4 * h, h)
    W2 = torch.randn(h, 4 * h)
    x_full = torch.randn(b, s, h, requires_grad=True)
    w1 = W1.chunk(world, 0)[rank].clone().requires_grad_()
    w2 = W2.chunk(world, 1)[rank].clone().requires_grad_()

    def f(xs, w1, w2):
        y = torch.nn.functional.layer_norm(xs, (h,))
        yg = funcol.all_gather_single(y.view(s // world, h), 0, g).view(
            b, s, h
        )  # gather on dim 0 of [s,h] view (b == 1)
        z = torch.nn.functional.gelu(yg @ w1.t()) @ w2.t()  # column then row: z is partial
        zs = funcol.reduce_scatter_single(z.view(s, h), "sum", 0, g).view(b, s // world, h)
        return (xs + zs).sum()

    joint_seen = {}

    def partition(joint, inputs, **kw):
        for n in joint.graph.nodes:
            if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional":
                joint_seen.setdefault("nodes", []).append((n.name, str(n.target), [str(a) for a in n.args]))
                if recompute and n.target in (torch.ops._c10d_functional.all_gather_into_tensor.default,):
                    for m in (n, next(iter(n.users))):
                        m.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                        m.meta["ac_graph_id"] = 100000
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        joint_seen["bw"] = [
            str(n.target) for n in bw.graph.nodes if getattr(n.target, "namespace", "") == "_c10d_functional"
        ]
        joint_seen["saved"] = [
            str(n.meta["val"].shape)
            for n in bw.graph.find_nodes(op="placeholder")
            if "tangent" not in n.name and hasattr(n.meta.get("val"), "shape")
        ]
        return fw, bw

    be = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition)
    xs = x_full.detach()[:, rank * s // world : (rank + 1) * s // world].clone().requires_grad_()
    loss = torch.compile(f, backend=be, fullgraph=True)(xs, w1, w2)
    loss.backward()
    # reference: single process
    xr = x_full.detach().clone().requires_grad_()
    W1r = W1.clone().requires_grad_()
    W2r = W2.clone().requires_grad_()
    ref = (xr + torch.nn.functional.gelu(torch.nn.functional.layer_norm(xr, (h,)) @ W1r.t()) @ W2r.t()).sum()
    ref.backward()
    tot = loss.detach().clone()
    dist.all_reduce(tot)
    ok = [
        torch.allclose(tot, ref, atol=1e-4),
        torch.allclose(xs.grad, xr.grad[:, rank * s // world : (rank + 1) * s // world], atol=1e-4),
        torch.allclose(w1.grad, W1r.grad.chunk(world, 0)[rank], atol=1e-4),
        torch.allclose(w2.grad, W2r.grad.chunk(world, 1)[rank], atol=1e-4),
    ]
    if rank == 0:
        print("recompute" if recompute else "default", "joint collectives:")
        [print("  ", t) for t in joint_seen["nodes"]]
        print("  bw collectives:", joint_seen["bw"])
        print("  saved shapes:", joint_seen["saved"])
        print("  loss/grads equal single-process:", ok)
    dist.destroy_process_group()


if __name__ == "__main__":
    for r, port in ((False, 29521), (True, 29522)):
        mp.spawn(run, args=(2, port, r), nprocs=2)
