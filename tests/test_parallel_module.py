"""A layout applied to a model's parameters (recompile_opt.parallel.module, issue 22 step 4), on 2 gloo
ranks: every parameter a DTensor under its own name whose ``full_tensor()`` is the unsharded one, the
fused QKV weight holding this rank's heads of q, k and v, and a full state dict that loads into the
unparallelized model."""

from __future__ import annotations

import copy

import torch
from multiprocess import gloo_rank, progress, run_ranks

from recompile_opt import models

WORLD, SEQ, H = 2, 16, 32


def _gpt():
    torch.manual_seed(0)
    return models.GPT(models.GPTConfig(n_layer=1, n_head=4, n_embd=H, block_size=SEQ, vocab_size=64))


def _worker(rank: int, out: str):
    with gloo_rank(rank, WORLD, out):
        _check(rank, out)
        progress(out, rank, "checked")


def _check(rank: int, out: str):
    import warnings

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from recompile_opt.parallel.layout import find_layout
    from recompile_opt.parallel.module import distribute_parameters

    mesh = init_device_mesh("cpu", (WORLD,))
    plain, model = _gpt(), _gpt()
    tokens = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the LM head's "kept replicated"
        layout = find_layout(copy.deepcopy(model).to("meta"), (tokens, tokens), WORLD)
    distribute_parameters(model, layout, mesh)
    params = dict(model.named_parameters())
    assert params.keys() == dict(plain.named_parameters()).keys()
    for name, p in plain.named_parameters():
        assert isinstance(params[name], DTensor), name
        assert torch.equal(params[name].full_tensor(), p.detach()), name
    q, k, v = plain.blocks[0].attn.c_attn.weight.detach().split(H, 0)
    mine = torch.cat([t.chunk(WORLD)[rank] for t in (q, k, v)])
    assert torch.equal(params["blocks.0.attn.c_attn.weight"].to_local(), mine)
    assert torch.equal(
        params["blocks.0.attn.c_proj.weight"].to_local(),
        plain.blocks[0].attn.c_proj.weight.detach().chunk(WORLD, 1)[rank],
    )
    assert torch.equal(params["wte.weight"].to_local(), plain.wte.weight.detach().chunk(WORLD, 0)[rank])
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    fresh = models.GPT(plain.config)
    fresh.load_state_dict(state)
    for (name, a), b in zip(fresh.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    _check_dcp_round_trip(model, layout, mesh, f"{out}/dcp")


def _check_dcp_round_trip(model, layout, mesh, path: str):
    """DCP saves and loads the sharded model, the fused QKV weight (a strided shard, which DCP alone
    cannot save: "overlapping chunks") included, into a model distributed alike; and the unparallelized
    model's own state dict loads into it."""
    import torch.distributed.checkpoint as dcp

    from recompile_opt.parallel.module import distribute_parameters

    dcp.save(model.state_dict(), checkpoint_id=path)
    other = _gpt()
    for p in other.parameters():
        torch.nn.init.zeros_(p)
    distribute_parameters(other, layout, mesh)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    params = dict(other.named_parameters())
    for name, p in model.named_parameters():
        assert params[name].placements == p.placements, name
        assert torch.equal(params[name].to_local(), p.to_local()), name
    for p in other.parameters():
        torch.nn.init.zeros_(p.to_local())
    other.load_state_dict(_gpt().state_dict())  # full tensors, as a plain checkpoint holds them
    for name, p in model.named_parameters():
        assert torch.equal(params[name].to_local(), p.to_local()), name
    _check_optimizer_round_trip(model, other, f"{path}-optim")


def _check_optimizer_round_trip(model, other, path: str):
    """Adam's state of every parameter, the strided QKV's included, saved by DCP and loaded into another
    optimizer, as DCP's state-dict functions hand it over."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.5 + i)
    optimizer.step()
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    again = torch.optim.Adam(other.parameters(), lr=0.1)
    state = {"optim": get_optimizer_state_dict(other, again)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(other, again, state["optim"])
    mine = dict(zip((n for n, _ in other.named_parameters()), other.parameters()))
    for name, p in model.named_parameters():
        want, got = optimizer.state[p], again.state[mine[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[key].placements == want[key].placements, (name, key)
            assert torch.equal(got[key].to_local(), want[key].to_local()), (name, key)


def test_parameters_become_dtensors_under_their_names_with_their_global_layout(tmp_path):
    run_ranks(_worker, (str(tmp_path),), str(tmp_path), WORLD)
