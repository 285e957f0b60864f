"""User options: parsed once, validated with messages that name the option and what it accepts.

``torch.compile`` is lazy, so a bad option surfaces at the first call. The backend raises it as an
:class:`OptionError` that is also Dynamo's ``BackendCompilerFailed`` (``backend.OptionErrorInCompile``),
which Dynamo lets through unwrapped: ``except recompile_opt.OptionError`` catches it, and its message
opens with ours.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from fractions import Fraction

POLICIES = ("auto", "save-all", "full", "megatron-selective")
SOLVERS = ("cbc", "highs")
TARGET_DEVICES = ("cuda", "cpu")
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# Roofline constants per device type: fixed so plans are deterministic (override with `roofline`).
# A collective costs latency + the bytes one rank sends over the link (a ring): CPU ranks talk through
# gloo over loopback TCP; CUDA ranks of a tensor-parallel group sit on one NVLink island (H100: 450 GB/s
# per direction, ~0.3 of it reached by a ring all-gather of a few MiB). Only the ratio to the compute
# constants matters to a plan: it prices a re-gather in the backward against keeping the gathered value.
# host_bytes_per_s: the device-host link, each direction, for offloaded activations (option ``offload``):
# an H100/H200 on PCIe Gen5 x16 (64 GB/s raw) copies pinned memory at ~50 GB/s; half of it is assumed,
# as the copies share the link with the input pipeline and small copies reach less. A CPU device has no
# such link (host memory is its memory); its figure serves only the tests' ``offload_on_cpu``.
DEFAULT_ROOFLINE = {
    "cpu": {
        "flops_per_s": 1.0e11,
        "bytes_per_s": 2.0e10,
        "link_bytes_per_s": 2.0e9,
        "collective_latency_s": 5e-5,
        "host_bytes_per_s": 1.0e10,
    },
    "cuda": {
        "flops_per_s": 3.0e14,
        "bytes_per_s": 2.0e12,
        "link_bytes_per_s": 1.5e11,
        "collective_latency_s": 1e-5,
        "host_bytes_per_s": 2.5e10,
    },
    "meta": {
        "flops_per_s": 3.0e14,
        "bytes_per_s": 2.0e12,
        "link_bytes_per_s": 1.5e11,
        "collective_latency_s": 1e-5,
        "host_bytes_per_s": 2.5e10,
    },
}

# CUDA devices by a part of their name (``torch.cuda.get_device_name``; the longest part that matches as a
# whole word: "A100" is not "RTX A1000"): the datasheet's dense bf16 tensor-core FLOP/s and memory
# bandwidth, of which a step's kernels are assumed to reach the fractions in CUDA_REACHED (not measured
# here: cuBLAS's large bf16 GEMMs are reported at about 0.6-0.7 of the peak, streaming kernels at about
# 0.8 of the bandwidth). An unknown CUDA device (and the meta device planning for CUDA) keeps
# DEFAULT_ROOFLINE["cuda"]. Why per device: an H200's reached bandwidth is 1.9x the generic constant, and
# a plan's estimated step (its recompute's share, the chunk choice's comparisons) is mostly traffic.
CUDA_DEVICES = {
    "A100": (312e12, 2.0e12),
    "A100-SXM4-40GB": (312e12, 1.555e12),
    "A100-PCIE-40GB": (312e12, 1.555e12),
    "L40S": (362e12, 0.864e12),
    "H100": (989e12, 3.35e12),
    "H100 PCIe": (756e12, 2.0e12),
    "H100 NVL": (835e12, 3.9e12),
    "H200": (989e12, 4.8e12),
    "H200 NVL": (835e12, 4.8e12),
    "GH200": (989e12, 4.0e12),
    "B200": (2250e12, 8.0e12),
}
CUDA_REACHED = {"flops_per_s": 0.6, "bytes_per_s": 0.8}


def cuda_device_roofline(name: str) -> dict:
    """``flops_per_s`` and ``bytes_per_s`` of the CUDA device named ``name`` (:data:`CUDA_DEVICES`);
    empty for a device not in the table."""
    known = [
        part
        for part in CUDA_DEVICES
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(part)}(?![A-Za-z0-9])", name, re.IGNORECASE)
    ]
    if not known:
        return {}
    flops, bandwidth = CUDA_DEVICES[max(known, key=len)]
    return {
        "flops_per_s": flops * CUDA_REACHED["flops_per_s"],
        "bytes_per_s": bandwidth * CUDA_REACHED["bytes_per_s"],
    }


class OptionError(ValueError):
    """A recompile_opt option has a bad key or value; the message names both and what is accepted."""


@dataclass(frozen=True)
class Options:
    """Validated options of one compilation (README.md, "Options")."""

    memory_budget: int | float | None = None  # int: bytes; float in [0, 1]: fraction; None: no limit
    peak_memory: int | None = None  # bytes: hard limit on the predicted step peak
    strict: bool = False  # an unmeetable limit raises instead of warning
    policy: str = "auto"
    solver: str = "highs"
    time_limit_s: float = 30.0
    mip_gap: float = 0.01  # stop when proven within this relative gap of the optimum
    plan_dir: str | None = None
    roofline: dict = field(
        default_factory=dict
    )  # flops_per_s, bytes_per_s, link_bytes_per_s, collective_latency_s, host_bytes_per_s
    compiler: str = "inductor"  # "inductor" or "eager" (same joint passes and partition, no codegen)
    # planning on the meta device: the device whose attention kernels the plan assumes (meta has none)
    target_device: str = "cuda"
    # mini-sequence chunking (passes/chunking.py, chunk_mlp.py, chunk_attention.py): {"loss": k, "mlp": k,
    # "attention": k} forces k chunks on every LM head + loss / MLP / attention's queries ("loss_recompute":
    # the head recomputed in the backward instead of its gradients made in the forward); "auto" (the
    # default): the planner chooses where the goal is memory (planner/chunk_choice.py); False: none
    chunks: dict | str | bool = "auto"
    # approximate backward (passes/approximate.py), off by default: {"activations": bits (1-4) allowed for
    # GELU/SiLU codes, "linear": ratio in (0, 1] allowed for randomized linear backward}; the ILP chooses
    # per value where to use them. None (False): exact plans only
    approximate: dict | None = None
    # the chunked loss's body per chunk (passes/loss_body.py): "auto" (the default) compiled by Inductor
    # on CUDA with compiler "inductor", ATen's kernels elsewhere (no faster fused on the CPU; the eager
    # compiler generates no code); True / False: fused / ATen anywhere
    fused_loss: bool | str = "auto"
    # a model laid out by hand as tensor parallel (parallelize_module's Colwise/RowwiseParallel) made
    # tensor + sequence parallel in its graph (parallel/sequence_pass.py)
    sequence_parallel: bool = False
    # offload kept activations to host memory (planner/ilp.py, passes/partition.py): False (the default);
    # True: the ILP may offload over the roofline's host link (``host_bytes_per_s``); a number: that link
    # bandwidth in bytes/s. A CPU device has no separate memory to relieve: there the plan notes it and
    # plans without offload
    offload: bool | float = False
    # testing only: offload on a CPU device anyway (host to host: saves no memory, but the rewritten
    # graphs run, so the tests compare their gradients with eager)
    offload_on_cpu: bool = False
    # testing only: offload on a CUDA device anyway, where its one GPU check trained a NaN loss
    # (docs/gpu.md); for the GPU check that looks for the cause
    offload_unchecked: bool = False

    def key(self) -> str:
        """Stable hash of every option: enters the partitioner's ``uuid()`` and the plan cache."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def roofline_for(self, device_type: str, device_name: str = "") -> dict:
        """The roofline constants for a device: its type's, a known CUDA device's own
        (:func:`cuda_device_roofline`), then option ``roofline``'s."""
        base = dict(DEFAULT_ROOFLINE.get(device_type, DEFAULT_ROOFLINE["cuda"]))
        if device_type == "cuda":
            base.update(cuda_device_roofline(device_name))
        base.update(self.roofline)
        return base


def parse_bytes(name: str, value) -> int:
    """An int is bytes; a string has units: "512MiB" (2^20-based) or "2GB" (10^9-based)."""
    if isinstance(value, bool):
        raise OptionError(
            f"option {name!r}: got a bool ({value}); expected bytes as an int or a "
            "string with units such as '512MiB' or '2GB'"
        )
    if isinstance(value, int):
        if value < 0:
            raise OptionError(f"option {name!r}: got {value}; a byte count must be >= 0")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", value)
        if not m:
            raise OptionError(
                f"option {name!r}: cannot read {value!r}; write a number with units, "
                f"one of {sorted(_UNITS)} (e.g. '512MiB', '2GB')"
            )
        # exact: in floats 2.01 * 10**9 is 2009999999.9999998, and int() dropped a byte
        number, unit = Fraction(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise OptionError(
                f"option {name!r}: unknown unit {m.group(2)!r} in {value!r}; accepted units: {sorted(_UNITS)}"
            )
        return int(number * _UNITS[unit])
    raise OptionError(
        f"option {name!r}: got {type(value).__name__} {value!r}; expected an int of "
        "bytes or a string with units such as '512MiB'"
    )


def parse_budget(value) -> int | float | None:
    """``memory_budget``: int bytes, unit string, or a float fraction in [0, 1]; None = no limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        got = f"a bool ({value})" if isinstance(value, bool) else f"{type(value).__name__} {value!r}"
        raise OptionError(
            f"option 'memory_budget': got {got}; expected a float fraction in [0, 1] "
            "(0.0 the least-memory plan, 1.0 save-all), an int of bytes, or a string with "
            "units such as '512MiB' or '2GB'"
        )
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise OptionError(
                f"option 'memory_budget': the fraction {value} is outside [0, 1]; use a "
                "float in [0, 1], an int of bytes or a string such as '6GiB'"
            )
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", value):
        raise OptionError(
            f"option 'memory_budget': {value!r} has no units; write e.g. '{value}MiB', "
            f"'{value}GB', an int of bytes, or a float fraction in [0, 1]"
        )
    return parse_bytes("memory_budget", value)


def parse_options(raw: dict | Options | None) -> Options:
    if isinstance(raw, Options):
        return raw
    raw = dict(raw or {})
    known = {f for f in Options.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise OptionError(f"unknown recompile_opt option(s) {unknown}; accepted options: {sorted(known)}")
    out = {"memory_budget": parse_budget(raw.get("memory_budget"))}
    if raw.get("peak_memory") is not None:
        out["peak_memory"] = parse_bytes("peak_memory", raw["peak_memory"])
    for name, allowed in (
        ("policy", POLICIES),
        ("solver", SOLVERS),
        ("compiler", ("inductor", "eager")),
        ("target_device", TARGET_DEVICES),
    ):
        if name in raw and raw[name] not in allowed:
            raise OptionError(f"option {name!r}: got {raw[name]!r}; accepted values: {list(allowed)}")
        if name in raw:
            out[name] = raw[name]
    limits = [n for n in ("memory_budget", "peak_memory") if raw.get(n) is not None]
    if out.get("policy", "auto") != "auto" and limits:
        raise OptionError(
            f"option 'policy': {out['policy']!r} is a fixed baseline and takes no "
            f"{' or '.join(limits)}; accepted with a limit: 'auto' (the default, the ILP)"
        )
    for name in ("strict", "sequence_parallel", "offload_on_cpu", "offload_unchecked"):
        if name in raw:
            if not isinstance(raw[name], bool):
                raise OptionError(f"option {name!r}: got {raw[name]!r}; accepted values: True, False")
            out[name] = raw[name]
    if "time_limit_s" in raw:
        t = raw["time_limit_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise OptionError(f"option 'time_limit_s': got {t!r}; expected a positive number of seconds")
        out["time_limit_s"] = float(t)
    if "mip_gap" in raw:
        g = raw["mip_gap"]
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < 1:
            raise OptionError(f"option 'mip_gap': got {g!r}; expected a relative gap in [0, 1)")
        out["mip_gap"] = float(g)
    if raw.get("plan_dir") is not None:
        out["plan_dir"] = str(raw["plan_dir"])
    if "roofline" in raw:
        out["roofline"] = _parse_roofline(raw["roofline"])
    if raw.get("chunks") is not None:
        c = raw["chunks"]
        out["chunks"] = c if c is False or c == "auto" else _parse_chunks(c)
    if raw.get("fused_loss") is not None:
        value = raw["fused_loss"]
        if not (value == "auto" or isinstance(value, bool)):
            raise OptionError(f"option 'fused_loss': got {value!r}; accepted values: 'auto', True, False")
        out["fused_loss"] = value
    if raw.get("approximate") not in (None, False):
        out["approximate"] = _parse_approximate(raw["approximate"])
    if "offload" in raw:
        out["offload"] = parse_offload(raw["offload"])
    if out.get("offload_on_cpu") and not out.get("offload"):
        raise OptionError(
            "option 'offload_on_cpu': True needs option 'offload' (True or a link bandwidth) to offload"
        )
    return Options(**out)


_BANDWIDTH = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*/\s*s\s*")


def parse_offload(value) -> bool | float:
    """``offload``: False, True (the roofline's host link), or the link's bandwidth in bytes/s: a
    positive number, or a string with units per second ("25GB/s", "24GiB/s")."""
    accepted = (
        "accepted values: False (the default), True (the roofline's host_bytes_per_s), or the host "
        "link's bandwidth per direction: a positive number of bytes/s or a string such as '25GB/s'"
    )
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, (int, float)):
        if not value > 0 or value == float("inf"):
            raise OptionError(f"option 'offload': got {value!r}; {accepted}")
        return float(value)
    if isinstance(value, str):
        m = _BANDWIDTH.fullmatch(value)
        unit = m.group(2).lower() if m else ""
        if m and (unit in _UNITS or unit == "") and float(m.group(1)) > 0:
            return float(Fraction(m.group(1)) * _UNITS.get(unit, 1))
    raise OptionError(f"option 'offload': got {value!r}; {accepted}")


APPROXIMATE_KEYS = ("activations", "linear")


def _parse_approximate(value) -> dict | None:
    accepted = (
        "accepted values: False, None, or a dict with 'activations': a bit width 1-4 (or False) and "
        "'linear': a projection ratio in (0, 1] (or False), e.g. {'activations': 3, 'linear': 0.5}"
    )
    if not isinstance(value, dict) or not value or set(value) - set(APPROXIMATE_KEYS):
        raise OptionError(f"option 'approximate': got {value!r}; {accepted}")
    bits, ratio = value.get("activations", False), value.get("linear", False)
    if bits is not False and (
        not isinstance(bits, int) or isinstance(bits, bool) or bits not in (1, 2, 3, 4)
    ):
        raise OptionError(
            f"option 'approximate': activations={bits!r}; accepted: a bit width 1, 2, 3 or 4, or False"
        )
    if ratio is not False and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1
    ):
        raise OptionError(f"option 'approximate': linear={ratio!r}; accepted: a ratio in (0, 1], or False")
    out = {
        k: v
        for k, v in (("activations", bits), ("linear", float(ratio) if ratio is not False else False))
        if v
    }
    return out or None


# loss_recompute: the head recomputed in the backward; attention: the query chunks (passes/chunk_attention.py)
CHUNK_REGIONS = ("loss", "loss_recompute", "mlp", "attention")


def _parse_chunks(value) -> dict:
    if not isinstance(value, dict) or not value or set(value) - set(CHUNK_REGIONS):
        raise OptionError(
            f"option 'chunks': got {value!r}; accepted values: 'auto' (the default), False, or a dict from "
            f"{list(CHUNK_REGIONS)} to a number of chunks (e.g. {{'loss': 8}})"
        )
    for region, k in value.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise OptionError(f"option 'chunks': {region}={k!r}; the number of chunks must be an int >= 1")
    if {"loss", "loss_recompute"} <= set(value):
        raise OptionError(
            "option 'chunks': 'loss' and 'loss_recompute' are two ways to chunk the same regions; give one"
        )
    return dict(value)


def _parse_roofline(value) -> dict:
    keys = ("flops_per_s", "bytes_per_s", "link_bytes_per_s", "collective_latency_s", "host_bytes_per_s")
    if not isinstance(value, dict) or set(value) - set(keys):
        raise OptionError(f"option 'roofline': got {value!r}; expected a dict with keys from {list(keys)}")
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise OptionError(f"option 'roofline': {k}={v!r} must be a positive number")
    return {k: float(v) for k, v in value.items()}
