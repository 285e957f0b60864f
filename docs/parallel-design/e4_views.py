# E4: nanoGPT's hard-coded views under export, and localizing a view through DTensor on a fake process group.
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, "/work/main")
from recompile_opt.models import CausalSelfAttention, GPTConfig

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (4,))
cfg = GPTConfig(n_head=8, n_embd=64, block_size=16)
with torch.device("meta"):
    m = CausalSelfAttention(cfg)
    x = torch.randn(2, 16, 64)
ep = torch.export.export(m, (x,), strict=False)
for n in ep.graph.nodes:
    if n.op == "call_function" and n.target in (
        torch.ops.aten.view.default,
        torch.ops.aten.split.Tensor,
        torch.ops.aten.linear.default,
        torch.ops.aten.dropout.default,
        torch.ops.aten.transpose.int,
    ):
        print(
            n.name,
            n.target,
            [a if not isinstance(a, torch.fx.Node) else a.name for a in n.args],
            n.meta.get("nn_module_stack", {}) and list(n.meta["nn_module_stack"].values())[-1][0],
        )
print("signature params:", [s.target for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER"])
# localize: rank-local q [2,16,64/4] as Shard(2) DTensor, then the global view
with torch.device("meta"):
    ql = torch.randn(2, 16, 16)
dq = DTensor.from_local(ql, mesh, [Shard(2)], run_check=False)
v = dq.view(2, 16, 8, 8)
print("view localized:", v.placements, tuple(v.to_local().shape))
y = v.transpose(1, 2).contiguous().transpose(1, 2).contiguous().view(2, 16, 64)
print("merge back:", y.placements, tuple(y.to_local().shape))
try:
    dq3 = DTensor.from_local(torch.randn(2, 16, 16, device="meta"), mesh, [Shard(2)], run_check=False).view(
        2, 16, 2, 32
    )
    print("2 heads on 4 ranks:", dq3.placements, tuple(dq3.to_local().shape))
except Exception as e:
    print("2 heads on 4 ranks raises:", type(e).__name__, str(e)[:200])
# split of the strided [q|k|v] output
qkv = DTensor.from_local(
    torch.randn(2, 16, 48, device="meta"), mesh, [_StridedShard(2, split_factor=3)], run_check=False
)
try:
    parts = qkv.split(64, dim=2)
    print(
        "split of _StridedShard:", [p.placements for p in parts], [tuple(p.to_local().shape) for p in parts]
    )
except Exception as e:
    print("split of _StridedShard raises:", type(e).__name__, str(e)[:300])
