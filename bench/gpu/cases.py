"""What the GPU check runs: models, backend options, strategies, and the cases made of them.

A case is a plain dict (it goes to a worker as JSON on its command line and comes back in the report):
``part`` (reference | correctness | performance | profile), the model or strategy, the dtype, the
backend ``options``, and ``needs``: the name of an earlier case whose result fills in an option (the
``peak_memory`` limits). Nothing here imports torch.
"""

from __future__ import annotations

PARTS = ("correctness", "fidelity", "performance", "profile")
DTYPES = ("fp32", "bf16")
MODELS = ("gpt", "llama", "hf-llama")

# option name -> the backend options; "peak" is filled in from the 0.0 case's predicted peak (x PEAK_SLACK)
OPTIONS: dict[str, dict] = {
    "0.0": {"memory_budget": 0.0},
    "0.5": {"memory_budget": 0.5},
    "bytes": {},  # the model's BYTE_BUDGET
    "peak": {},  # PEAK_SLACK x the 0.0 plan's predicted peak, same model and dtype
    "full": {"policy": "full"},
    "megatron-selective": {"policy": "megatron-selective"},
    "chunks": {"chunks": {"loss": 4, "mlp": 4}},
    "approximate": {"approximate": {"activations": 2}},
}
PEAK_SLACK = 1.2
# a byte budget about a quarter of what save-all keeps for each model at its size
BYTE_BUDGET = {
    False: {"gpt": "4MiB", "llama": "4MiB", "hf-llama": "2MiB"},
    True: {"gpt": "48KiB", "llama": "48KiB", "hf-llama": "64KiB"},
}

# the performance strategies, in the order they run; "ours-peak" takes compile-ckpt's measured peak
STRATEGIES: dict[str, dict] = {
    "eager": {"kind": "eager"},
    "compile": {"kind": "compile"},
    **{
        f"compile-amb-{b}": {"kind": "compile", "functorch": {"activation_memory_budget": b}}
        for b in (0.5, 0.2, 0.0)
    },
    "compile-ckpt": {"kind": "compile", "ckpt": True},
    "ours-none": {"kind": "ours", "options": {}},
    "ours-0.5": {"kind": "ours", "options": {"memory_budget": 0.5}},
    "ours-0.0": {"kind": "ours", "options": {"memory_budget": 0.0}},
    "ours-peak": {"kind": "ours", "options": {}, "needs": "compile-ckpt"},
    # issue "Offload": the ILP may also copy kept activations to host memory
    # (offload_unchecked: it is not offered on CUDA until a check there trains eager's loss; the first, on
    # torch 2.11 before its copies held their buffers, trained a NaN loss)
    "ours-0.5+offload": {
        "kind": "ours",
        "options": {"memory_budget": 0.5, "offload": True, "offload_unchecked": True},
    },
    "ours-peak+offload": {
        "kind": "ours",
        "options": {"offload": True, "offload_unchecked": True},
        "needs": "compile-ckpt",
    },
}
PROFILES: dict[str, dict] = {
    "ours-0.0+chunks": {"kind": "ours", "options": {"memory_budget": 0.0, "chunks": "auto"}},
    "ours-0.0+nochunks": {"kind": "ours", "options": {"memory_budget": 0.0, "chunks": False}},
}


def pick(given: str | None, every: tuple | list, what: str) -> list[str]:
    """The comma-separated names in ``given`` (all of ``every`` when empty), in ``every``'s order;
    SystemExit naming the accepted ones on an unknown name."""
    if not given:
        return list(every)
    names = [n.strip() for n in given.split(",") if n.strip()]
    bad = [n for n in names if n not in every]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {list(every)}")
    return [n for n in every if n in names]


def case_name(case: dict) -> str:
    """A case's unique name: its part and what distinguishes it there."""
    if case["part"] == "environment":
        return "environment"
    if case["part"] in ("performance", "profile"):
        return f"{case['part']}:{case['strategy']}"
    tail = f":{case['option']}" if case["part"] == "correctness" else ""
    return f"{case['part']}:{case['model']}:{case['dtype']}{tail}"


def numeric_cases(models: list[str], dtypes: list[str], options: list[str], *, tiny: bool) -> list[dict]:
    """One reference case (plain ``torch.compile``) per model and dtype, and one correctness case per
    model, dtype and option (each also measures the fidelity figures)."""
    cases = []
    for model in models:
        for dtype in dtypes:
            cases.append({"part": "reference", "model": model, "dtype": dtype})
            for option in options:
                case = {
                    "part": "correctness",
                    "model": model,
                    "dtype": dtype,
                    "option": option,
                    "options": dict(OPTIONS[option]),
                }
                if option == "bytes":
                    case["options"] = {"memory_budget": BYTE_BUDGET[tiny][model]}
                if option == "peak":
                    case["needs"] = case_name({**case, "option": "0.0"})
                cases.append(case)
    return cases


def strategy_cases(names: list[str], table: dict, part: str) -> list[dict]:
    """One case per strategy of ``table`` named in ``names``; ``ours-peak`` needs compile-ckpt's case."""
    cases = []
    for name in names:
        spec = table[name]
        case = {"part": part, "strategy": name, **{k: v for k, v in spec.items() if k != "needs"}}
        if "needs" in spec:
            case["needs"] = f"{part}:{spec['needs']}"
        cases.append(case)
    return cases


def fill_needs(case: dict, results: dict[str, dict]) -> dict | str:
    """The case with its dependent option set from the result it needs, or why it cannot run."""
    need = case.get("needs")
    if not need:
        return case
    got = results.get(need)
    if got is None or "error" in got:
        return f"needs {need}, which " + ("did not run" if got is None else "failed")
    if case["part"] == "correctness":
        peak = got.get("predicted_peak_bytes")
        if not peak:
            return f"needs {need}'s predicted peak, which it did not report"
        return {**case, "options": {"peak_memory": int(peak * PEAK_SLACK)}}
    return {**case, "options": {**case.get("options", {}), "peak_memory": int(got["peak_bytes"])}}
