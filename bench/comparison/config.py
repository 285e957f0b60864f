"""What one comparison group is: a model at a size, and the flags each worker process is given.

A group is a plain dict (model, size, shape, vocab, dropout, steps, warmup, threads) so that it goes
into the JSON report as-is and onto a worker's command line flag by flag (:data:`WORKER_FLAGS`).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# Model sizes that run on one CPU thread in seconds per step (vocab 512, fp32).
SIZES: dict[str, dict] = {
    "small": {"layers": 2, "embd": 256, "heads": 4, "seq": 256, "batch": 4},
    "medium": {"layers": 4, "embd": 384, "heads": 6, "seq": 256, "batch": 4},
}
SHAPE_FLAGS = ["layers", "embd", "heads", "seq", "batch"]
# flags forwarded verbatim from the driver to each worker (after resolving the size preset)
WORKER_FLAGS = ["model", "size", *SHAPE_FLAGS, "vocab", "dropout", "steps", "warmup", "threads"]


def group_configs(args) -> list[dict]:
    """One config per (model, size): the size preset, overridden by explicit shape flags."""
    models = [m.strip() for m in str(args.model).split(",") if m.strip()]
    sizes = [s.strip() for s in str(args.size).split(",") if s.strip()]
    bad = [m for m in models if m not in ("gpt", "llama")] + [s for s in sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"unknown model/size {bad}; models: gpt, llama; sizes: {list(SIZES)}")
    groups = []
    for model in models:
        for size in sizes:
            cfg = {
                "model": model,
                "size": size,
                "vocab": args.vocab,
                "dropout": args.dropout if model == "gpt" else 0.0,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads": args.threads,
            }
            for flag in SHAPE_FLAGS:
                value = getattr(args, flag)
                cfg[flag] = SIZES[size][flag] if value is None else value
            groups.append(cfg)
    return groups


def group_title(cfg: dict) -> str:
    return (
        f"{cfg['model']} {cfg['size']}: {cfg['layers']} layers, h={cfg['embd']}, "
        f"{cfg['heads']} heads, s={cfg['seq']}, b={cfg['batch']}, vocab {cfg['vocab']}, fp32"
        + (f", dropout {cfg['dropout']}" if cfg["dropout"] else "")
    )
