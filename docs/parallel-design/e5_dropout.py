# E5: rank r's dropout mask = slice of a full-shape native_dropout mask drawn from the same generator state.
import torch

x = torch.randn(2, 8, 6)
torch.manual_seed(1)
ref = torch.nn.functional.dropout(x, 0.3, True)
ok = []
for r in range(2):
    torch.manual_seed(1)
    _, mask = torch.ops.aten.native_dropout(torch.zeros(2, 8, 6), 0.3, True)
    ok.append(
        torch.allclose(
            x[:, r * 4 : (r + 1) * 4] * mask[:, r * 4 : (r + 1) * 4] / 0.7, ref[:, r * 4 : (r + 1) * 4]
        )
    )
print("eager: slice of a full-shape native_dropout mask == single-process dropout slice:", ok)


def single(x):
    return torch.nn.functional.dropout(x, 0.3, True)


def sharded(x, r):
    _, m = torch.ops.aten.native_dropout(torch.zeros(2, 8, 6), 0.3, True)
    return x[:, r * 4 : (r + 1) * 4] * m[:, r * 4 : (r + 1) * 4] * (1 / 0.7)


cs = torch.compile(single)
ch = torch.compile(sharded)
torch.manual_seed(1)
a = cs(x)
res = []
for r in range(2):
    torch.manual_seed(1)
    res.append(torch.allclose(ch(x, r), a[:, r * 4 : (r + 1) * 4]))
print("inductor: equal:", res)
