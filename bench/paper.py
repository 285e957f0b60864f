"""Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2
and the recompute-FLOPs overheads of Sec. 5 / Appendix A, reproduced with our planner on the meta device.

Usage::

    python bench/paper.py                        # 22B, 175B, 530B, 1T: markdown table + explanations
    python bench/paper.py --json --models 22B,1T # JSON list of rows
    python bench/paper.py --md paper_table.md    # also write the markdown, under a provenance line

One layer per model (s=2048, b=1, bf16, dropout 0.1, no tensor/sequence parallelism) is built by
``recompile_opt.models.paper_layer`` and planned four ways: ``save-all`` (the paper's "no recompute"),
``megatron-selective``, ``full``, and the ILP at the budget Megatron-selective keeps.

What the paper says, per layer (bytes, 16-bit activations; Table 2 with t=1):

    no recompute  sbh(34 + 5as/h)       selective  34sbh       full  2sbh

FLOPs (Appendix A, per layer, logits left out): a forward is 24bsh^2 + 4bs^2h (4bs^2h = QK^T and
attention-over-V), a training step 3x that, 72bsh^2(1 + s/(6h)) ("model FLOPs"). The overheads it
states use two different bases, and we compare each in its own:

* full recompute reruns the whole forward: hardware FLOPs 96bsh^2(1 + s/(6h)), i.e. 1/3 = 33.3% over
  the step's model FLOPs;
* selective recompute reruns the attention core; the 2.7% (GPT-3) and 1.6% (MT-NLG) of Sec. 5 are
  4bs^2h / (24bsh^2 + 4bs^2h) = s/(6h + s), the core over one *forward* (also what the paper's hardware
  FLOPs 72bsh^2(1 + s/(3h)) give over its model FLOPs). The core over the whole step would be 0.9%.

Our plan recomputes only what the backward reads, so its FLOPs can be lower than Megatron's rerun of
a whole region; the table shows both (Megatron's counted with the same FLOP counter as ours) and the
explanations below it say where each difference comes from, read off the plan's entries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import recompile_opt  # noqa: E402
from recompile_opt.models import paper_layer  # noqa: E402
from recompile_opt.provenance import header_line  # noqa: E402

S, B = 2048, 1
MODELS = {"22B": (6144, 64), "175B": (12288, 96), "530B": (20480, 128), "1T": (25600, 160)}
STRATEGIES = {
    "none": "save-all",
    "selective": "megatron-selective",
    "full": "full",
    "ilp-selective-budget": None,
}
# The overheads the paper states (fractions), and over what: "forward" or "step" (= 3 forwards).
PAPER_OVERHEAD = {("175B", "selective"): 0.027, ("530B", "selective"): 0.016}
PAPER_FULL_OVERHEAD = 1 / 3  # stated for full recompute in general
BASIS = {"none": "forward", "selective": "forward", "ilp-selective-budget": "forward", "full": "step"}


# -- the paper's formulas -----------------------------------------------------------------------


def formula_bytes(strategy: str, h: int, a: int, s: int = S, b: int = B) -> int:
    """Table 2 (t=1); the ILP is held to selective's 34sbh, the budget it is given."""
    sbh = s * b * h
    return {
        "none": 34 * sbh + 5 * a * s * s * b,
        "selective": 34 * sbh,
        "full": 2 * sbh,
        "ilp-selective-budget": 34 * sbh,
    }[strategy]


def formula_forward_flops(h: int, s: int = S, b: int = B) -> int:
    """Appendix A: 24bsh^2 + 4bs^2h per layer forward."""
    return 24 * b * s * h * h + 4 * b * s * s * h


def paper_overhead(model: str, strategy: str) -> float | None:
    if strategy == "full":
        return PAPER_FULL_OVERHEAD
    return PAPER_OVERHEAD.get((model, strategy))


# -- our side: FLOPs counted, plans made --------------------------------------------------------


def module_flops(model, x) -> dict[str, int]:
    """Forward FLOPs per module, inclusive of children, keyed like plan entries' ``module``
    ("block.attn"; "" for the whole layer). FlopCounterMode uses torch's FLOP registry, the one our
    cost model prices recompute with, and runs on the meta device."""
    with FlopCounterMode(display=False) as counter:
        model(x)
    out = {}
    for key, per_op in counter.get_flop_counts().items():
        if key == "Global":
            continue
        out[key.partition(".")[2]] = sum(per_op.values())  # drop the root class name
    return out


def megatron_recompute_flops(strategy: str, flops: dict[str, int]) -> int:
    """What Megatron reruns, counted by our FLOP counter: full reruns the layer's forward; selective
    the attention core, i.e. block.attn's FLOPs outside its two linears (QK^T and attention-over-V)."""
    if strategy == "full":
        return flops[""]
    if strategy in ("selective", "ilp-selective-budget"):  # the ILP row: Megatron at that budget
        return flops["block.attn"] - flops["block.attn.c_attn"] - flops["block.attn.c_proj"]
    return 0


def make_plans(model, x) -> dict:
    """The four plans of one layer; the ILP gets exactly the bytes Megatron-selective keeps."""
    plans = {name: _plan(model, x, policy=policy) for name, policy in STRATEGIES.items() if policy}
    plans["ilp-selective-budget"] = _plan(model, x, memory_budget=plans["selective"].saved_bytes)
    return plans


def _plan(model, x, **options):
    return recompile_opt.plan(model, (x,), **options)


# -- explaining plan vs formula -----------------------------------------------------------------


def byte_differences(plan, strategy: str, h: int, a: int, s: int = S, b: int = B) -> list[tuple[str, int]]:
    """Itemise plan bytes minus formula bytes from the plan's own entries: what it keeps that the
    paper does not count (+), what the paper counts that it replays instead of keeping (-)."""
    items: dict[str, int] = {}

    def add(what, n):
        items[what] = items.get(what, 0) + n

    for e in plan.saved:
        if e.reason == "rng":
            add("RNG states kept to replay dropout in the backward (one per replayed random op)", e.bytes)
        elif e.dtype == "float32" and e.shape and e.shape[-1] == 1:
            kind = "LayerNorm mean and 1/std" if ".ln_" in e.module else "softmax row max and sum"
            add(f"{kind} (fp32, one per row; the paper does not count them)", e.bytes)
        elif e.dtype == "bool" and list(e.shape) == [1, 1, s, s]:
            add(
                "causal mask (bool s x s, kept for masked_fill's backward; not counted by the paper, "
                "whose fused causal softmax needs no mask tensor)",
                e.bytes,
            )
    if strategy in ("selective", "ilp-selective-budget"):  # the paper keeps both h-wide masks
        for e in plan.recomputed:
            if e.dtype == "bool" and list(e.shape) == [b, s, h]:
                add(f"{e.module} mask (bool sbh) the paper keeps, this plan replays from RNG", -b * s * h)
    residual = plan.saved_bytes - formula_bytes(strategy, h, a, s, b) - sum(items.values())
    if residual:
        add("not explained by the items above", residual)
    return sorted(((w, n) for w, n in items.items() if n), key=lambda kv: -abs(kv[1]))


def flop_differences(plan, strategy: str, flops: dict[str, int]) -> list[str]:
    """Per module: forward FLOPs (own, not children's) that Megatron reruns and this plan does not,
    with the plan's recomputed matmuls there. Empty when the plan reruns what Megatron reruns."""
    core = ["block.attn"]
    region = {"full": list(flops), "selective": core, "ilp-selective-budget": core}.get(strategy, [])
    lines = []
    for mod in region:
        own = flops[mod] - sum(v for k, v in flops.items() if _is_child(k, mod))
        if region is core:  # Megatron reruns the core only, not block.attn's linears
            own = megatron_recompute_flops(strategy, flops)
        ours = [e for e in plan.recomputed if e.module == mod and e.flops]
        done = sum(e.flops for e in ours)
        if own > done:
            what = ", ".join(f"{e.name} ({e.op}, {e.flops / 1e9:.1f} GFLOP)" for e in ours) or "nothing"
            lines.append(
                f"{mod or '(layer)'}: Megatron reruns {own / 1e9:.1f} GFLOP, this plan "
                f"{done / 1e9:.1f} ({what})"
            )
    return lines


def _is_child(key: str, parent: str) -> bool:
    rest = key[len(parent) + 1 :] if parent else key
    return key != parent and key.startswith(parent + "." if parent else "") and "." not in rest


# -- rows and printing --------------------------------------------------------------------------


def model_rows(name: str) -> list[dict]:
    """All strategies' rows for one model of the paper."""
    h, a = MODELS[name]
    model, x = paper_layer(h, a, s=S, b=B)
    flops = module_flops(model, x)
    plans = make_plans(model, x)
    return [row(name, strategy, plan, flops, h, a) for strategy, plan in plans.items()]


def row(name: str, strategy: str, plan, flops: dict[str, int], h: int, a: int) -> dict:
    fwd = flops[""]
    basis = fwd if BASIS[strategy] == "forward" else 3 * fwd
    megatron = megatron_recompute_flops(strategy, flops)
    formula = formula_bytes(strategy, h, a)
    return {
        "model": name,
        "strategy": strategy,
        "h": h,
        "heads": a,
        "s": S,
        "b": B,
        "formula_bytes": formula,
        "plan_bytes": plan.saved_bytes,
        "ratio": plan.saved_bytes / formula,
        "recompute_flops": plan.recompute_flops,
        "forward_flops": fwd,
        "forward_flops_formula": formula_forward_flops(h),
        "overhead_basis": BASIS[strategy],
        "overhead": plan.recompute_flops / basis,
        "overhead_forward": plan.recompute_flops / fwd,
        "overhead_step": plan.recompute_flops / (3 * fwd),
        "megatron_recompute_flops": megatron,
        "megatron_overhead": megatron / basis,
        "paper_overhead": paper_overhead(name, strategy),
        "plan_step_s": plan.step_s,
        "plan_recompute_s": plan.recompute_s,
        "byte_differences": [{"what": w, "bytes": n} for w, n in byte_differences(plan, strategy, h, a)],
        "flop_differences": flop_differences(plan, strategy, flops),
    }


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}%"


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| model | strategy | formula MiB (×sbh) | plan MiB (×sbh) | plan/formula | recompute GFLOP "
        "| forward GFLOP (counted = formula?) | ours % | Megatron's rerun % | paper % | basis |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        sbh = r["s"] * r["b"] * r["h"]
        same = "yes" if r["forward_flops"] == r["forward_flops_formula"] else "NO"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['formula_bytes'] / 2**20:.1f}"
            f" ({r['formula_bytes'] / sbh:.2f})"
            f" | {r['plan_bytes'] / 2**20:.1f} ({r['plan_bytes'] / sbh:.3f}) | {r['ratio']:.4f}"
            f" | {r['recompute_flops'] / 1e9:.1f} | {r['forward_flops'] / 1e9:.1f} ({same})"
            f" | {_pct(r['overhead'])} | {_pct(r['megatron_overhead'])} | {_pct(r['paper_overhead'])}"
            f" | {r['overhead_basis']} |"
        )
    return "\n".join(lines)


def explanations(rows: list[dict]) -> str:
    out = ["", "Where the plan differs from the formula (bytes, from the plan's kept/recomputed entries):"]
    for r in rows:
        items = "; ".join(f"{d['what']}: {d['bytes'] / 2**20:+.3f} MiB" for d in r["byte_differences"])
        out.append(
            f"- {r['model']} {r['strategy']}: {r['plan_bytes'] - r['formula_bytes']:+d} B"
            + (f" = {items}" if items else "")
        )
    out += ["", "Where our recompute FLOPs differ from Megatron's rerun (per module):"]
    for r in rows:
        out += [f"- {r['model']} {r['strategy']}: {line}" for line in r["flop_differences"]]
    out += ["", NOTES]
    return "\n".join(out)


NOTES = """Notes.
* ours % = plan.recompute_flops over the basis the paper uses for that strategy ("forward": one
  forward, 24bsh^2 + 4bs^2h; "step": forward + backward, 72bsh^2(1 + s/(6h))). Megatron's rerun % is
  what Megatron re-executes (selective: the attention core, 4bs^2h; full: the whole forward), counted
  with the same FLOP counter: it reproduces the paper's 2.7% / 1.6% / 33.3%.
* selective: the plan recomputes only QK^T (2bs^2h). The attention-over-V output is the out-projection's
  input, kept anyway (it is in the 34sbh), and that matmul's backward reads only the dropped-out
  probabilities and V, so rerunning it, as Megatron's checkpointed core does, is wasted work.
* full: the plan does not recompute the MLP's second linear (8bsh^2): its output only feeds the
  dropout and the residual sum that leave the layer, which no backward op reads.
* ilp-selective-budget (its Megatron column: selective's core at the same bytes): the ILP keeps about
  one sbh less than its budget; it replays the MLP's dropout mask from an RNG state instead of keeping
  it (1 byte per element), and keeps the softmax's fp32 row max and sum so that the recomputed softmax
  needs no reduction. It recomputes the same QK^T matmul as selective.
* Forward FLOPs count matmuls only (torch's FLOP registry), as the paper does."""


# -- tensor and sequence parallelism (--tp T) ---------------------------------------------------

TP_STRATEGIES = {
    "none": dict(policy="save-all"),
    "selective": dict(policy="megatron-selective"),
    "full": dict(policy="full"),
}
ILP_SLACK = 1.01  # the ILP row's budget: TP+SP+selective's 34sbh/t, 1% over


def formula_bytes_tp(strategy: str, h: int, a: int, t: int, sp: bool, s: int = S, b: int = B) -> float:
    """Table 2 per rank: TP sbh(10 + 24/t + 5as/(ht)), TP+SP sbh(34/t + 5as/(ht)); with selective
    recompute the 5as/(ht) term goes; full recompute keeps the layer's input (2sbh, 2sbh/t sharded)."""
    sbh = s * b * h
    replicated = 0 if sp else 10 * sbh  # the norms' inputs, the QKV and fc1 inputs, two h-wide masks
    core = 5 * a * s * s * b / t
    return {
        "none": replicated + 24 * sbh / t + (10 * sbh / t if sp else 0) + core,
        "selective": replicated + 24 * sbh / t + (10 * sbh / t if sp else 0),
        "full": 2 * sbh / (t if sp else 1),
        "ilp": 34 * sbh / t,
    }[strategy]


def model_rows_tp(name: str, t: int) -> list[dict]:
    """One layer over ``t`` ranks (rank 0 of a fake process group, on the meta device), tensor parallel
    and tensor + sequence parallel: each Table 2 strategy, and the ILP at ILP_SLACK x 34sbh/t."""
    from recompile_opt.parallel import parallelize

    h, a = MODELS[name]
    mesh = _fake_mesh(t)
    rows = []
    for sp in (False, True):
        model, x = paper_layer(h, a, s=S, b=B)
        parallelize(model, mesh, (x,), sequence_parallel=sp)
        plans = {k: _plan(model, x, **kw) for k, kw in TP_STRATEGIES.items()}
        if sp:
            plans["ilp"] = _plan(
                model, x, memory_budget=int(ILP_SLACK * formula_bytes_tp("ilp", h, a, t, sp))
            )
        for strategy, plan in plans.items():
            formula = formula_bytes_tp(strategy, h, a, t, sp)
            rows.append(
                {
                    "model": name,
                    "t": t,
                    "sp": sp,
                    "strategy": strategy,
                    "h": h,
                    "heads": a,
                    "s": S,
                    "b": B,
                    "formula_bytes": formula,
                    "plan_bytes": plan.saved_bytes,
                    "ratio": plan.saved_bytes / formula,
                    "sent_bytes": plan.communication_bytes(),
                    "regathered": sum(1 for c in plan.collectives if c.get("regathered")),
                    "s2_kept_bytes": sum(e.bytes for e in plan.saved if list(e.shape[-2:]) == [S, S]),
                    "recompute_flops": plan.recompute_flops,
                    "recomputed_modules": sorted({e.module for e in plan.recomputed if e.flops}),
                }
            )
    return rows


def _fake_mesh(t: int):
    """A 1-D mesh of ``t`` ranks in this one process: torch's fake process group (collectives traced,
    never run), which is what planning on the meta device needs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)
    return init_device_mesh("cpu", (t,))


def markdown_tp(rows: list[dict]) -> str:
    t = rows[0]["t"]
    head = (
        "| model | layout | strategy | formula MiB | plan MiB | plan/formula | sent MiB | re-gathers "
        "| s x s kept MiB | recompute GFLOP | recomputed matmuls in |"
    )
    lines = [
        f"Korthikanti et al. 2022, Table 2 per rank and layer at t={t}: s={S}, b={B}, bf16, dropout 0.1; "
        "rank 0 of a fake process group on the meta device",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {'TP+SP' if r['sp'] else 'TP'} | {r['strategy']}"
            f" | {r['formula_bytes'] / 2**20:.1f}"
            f" | {r['plan_bytes'] / 2**20:.1f} | {r['ratio']:.4f} | {r['sent_bytes'] / 2**20:.1f}"
            f" | {r['regathered']}"
            f" | {r['s2_kept_bytes'] / 2**20:.1f} | {r['recompute_flops'] / 1e9:.1f}"
            f" | {', '.join(r['recomputed_modules']) or '-'} |"
        )
    lines += [
        "",
        "ilp: the ILP at 1.01 x 34sbh/t (TP+SP+selective's bytes). sent: bytes one rank sends per step "
        "(the layer's own collectives, each re-gather again, and the transitions into and out of the bare "
        "layer: its input split, its output gathered).",
    ]
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS)
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of rows instead")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: plan rank 0's layer tensor "
        "parallel and tensor + sequence parallel (a fake process group, the meta device)",
    )
    p.add_argument(
        "--md",
        metavar="FILE",
        help="also write the markdown (table and explanations) here, "
        "opening with recompile_opt.provenance.header_line() (versions, machine, load, date)",
    )
    return p.parse_args(argv)


def markdown(rows: list[dict]) -> str:
    """The printed report: a title line, the table and the explanations."""
    title = (
        f"Korthikanti et al. 2022, Table 2 per layer: s={S}, b={B}, bf16, dropout 0.1, t=1; "
        "planned on the meta device"
    )
    return f"{title}\n\n{markdown_table(rows)}\n{explanations(rows)}"


def markdown_document(rows: list[dict]) -> str:
    """What ``--md`` writes: the provenance line, then :func:`markdown`."""
    return f"{header_line()}\n\n{markdown(rows)}\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.tp > 1:
        rows = [r for name in names for r in model_rows_tp(name, args.tp)]
        text = markdown_tp(rows)
    else:
        rows = [r for name in names for r in model_rows(name)]
        text = markdown(rows)
    print(json.dumps(rows, indent=1) if args.json else text)
    if args.md:
        Path(args.md).write_text(f"{header_line()}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
