"""Static SASS instruction count of the grad_stats pass-1 loop (no GPU needed).

Disassembles every ``grad_stats_kernel<GT, kCountZeros>`` instantiation in the extension (or in a cubin),
finds its steady-state vectorized loop, and prints the instructions one thread issues per loop
iteration and per 32 grad elements against the budget of 154 per 32 elements (bf16 grads, no zero
counting) from the GitHub issue on pass 1 being ALU-bound:

    python tools/sass_budget.py                         # the installed megatron_opt._C
    python tools/sass_budget.py build/grad_stats.cubin --disassembler /path/to/nvdisasm --json out.json

Disassemblers: ``nvdisasm`` (cubin input) or ``cuobjdump`` (cubin or fat-binary .so input). Neither is
in the minimal toolkit; ``pip install --target /tmp/sasstools nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump``
provides both (``nvidia/cu13/bin``). Auto-detection looks on PATH, in $CUDA_HOME/bin, /usr/local/cuda/bin,
the ``nvidia/*/bin`` dirs of this interpreter's site-packages and /tmp/sasstools.

Loop heuristic (the count depends on it):
  * a loop is a backward branch ``BRA`` at address B whose target T <= B; its body is every instruction
    in [T, B], in address order;
  * candidates are innermost loops (no other loop nested strictly inside) holding at least one 128-bit
    global load (``LDG...128``); the steady-state loop is the candidate with the most such loads (first
    on a tie). In grad_stats_kernel that is the ``kStatsUnroll`` x ``load_pack`` loop;
  * in the steady state every guard ``if (v < nvec)`` holds, so its forward branch falls through and
    each instruction in [T, B] issues once: the count is all of them, NOPs excluded (guard branches,
    BSSY/BSYNC and the backward branch included). A forward branch from the body to outside [T, B]
    (out-of-line code the straight-line count would miss) is reported as a warning;
  * elements per thread per iteration = 16 bytes per 128-bit load / sizeof(grad element).

Exit status: 0 when every kCountZeros=false instantiation is within the budget (the issue's budget is
for that path; kCountZeros=true rows are reported against it too, for information), 1 when one is over
or no kernel was found, 2 when no usable disassembler was found.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

BUDGET_PER_32 = 154
KERNEL_RE = re.compile(r"grad_stats_kernelINS_\d+(F32|BF16|F16)ELb([01])E")
ELEM_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
GRAD_NAME = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
SEARCH_HINT = ("install one with `python3 -m pip install --target /tmp/sasstools nvidia-cuda-nvdisasm "
               "nvidia-cuda-cuobjdump` (auto-detected there) or pass --disassembler PATH")

_FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)|^\.text\.(\S+):\s*$")
_LABEL_RE = re.compile(r"^\s*(\.L\w+):")
_INSTR_RE = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
_PRED_RE = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET_RE = re.compile(r"`\((\.L\w+)\)|\b(0x[0-9a-fA-F]+)\s*$")


class DisassemblerNotFound(RuntimeError):
    """No nvdisasm/cuobjdump usable for the input."""


@dataclass
class Instr:
    addr: int
    opcode: str  # e.g. "LDG.E.EF.128", predicate stripped
    text: str
    target: Optional[int] = None  # branch target address (BRA only)


@dataclass
class LoopCount:
    kernel: str
    grad: str
    count_zeros: Optional[bool]
    loop_start: int
    loop_end: int
    instructions: int
    elements: int
    per_32: float
    budget: int = BUDGET_PER_32
    passed: bool = False
    top_opcodes: Dict[str, int] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)


def parse_functions(sass: str) -> Dict[str, List[Instr]]:
    """Split an nvdisasm (``-c``) or ``cuobjdump -sass`` listing into {mangled name: instructions}, with
    branch targets resolved to addresses (nvdisasm labels or cuobjdump absolute addresses)."""
    funcs: Dict[str, List[Instr]] = {}
    labels: Dict[str, Dict[str, int]] = {}
    pending: List[str] = []
    name: Optional[str] = None
    for line in sass.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            name = m.group(1) or m.group(2)
            funcs.setdefault(name, [])
            labels.setdefault(name, {})
            pending = []
            continue
        if name is None:
            continue
        m = _LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        addr, text = int(m.group(1), 16), m.group(2).strip()
        for lab in pending:
            labels[name][lab] = addr
        pending = []
        funcs[name].append(Instr(addr, _PRED_RE.sub("", text).split()[0], text))
    for fname, instrs in funcs.items():
        for ins in instrs:
            if ins.opcode.split(".")[0] != "BRA":
                continue
            t = _TARGET_RE.search(ins.text)
            if t and t.group(1):
                ins.target = labels[fname].get(t.group(1))
            elif t:
                ins.target = int(t.group(2), 16)
    return funcs


def _is_wide_load(ins: Instr) -> bool:
    return ins.opcode.startswith("LDG") and ".128" in ins.opcode


def find_steady_loop(instrs: Sequence[Instr]) -> Tuple[int, int]:
    """(index of the loop's first instruction, index of its backward branch); see the module docstring."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    loops = [(index[ins.target], i) for i, ins in enumerate(instrs)
             if ins.target is not None and ins.target <= ins.addr and ins.target in index]
    inner = [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
    scored = [(sum(_is_wide_load(x) for x in instrs[s:e + 1]), s, e) for s, e in inner]
    scored = [t for t in scored if t[0] > 0]
    if not scored:
        raise ValueError("no innermost loop with a 128-bit global load (LDG...128) found")
    best = max(scored, key=lambda t: (t[0], -t[1]))
    return best[1], best[2]


def count_loop(name: str, instrs: Sequence[Instr], elem_bytes: int, grad: str = "?",
               count_zeros: Optional[bool] = None) -> LoopCount:
    """Count the steady-state loop of one function (NOPs excluded) and scale to 32 elements."""
    s, e = find_steady_loop(instrs)
    body = [x for x in instrs[s:e + 1] if x.opcode != "NOP"]
    lo, hi = instrs[s].addr, instrs[e].addr
    warnings = [f"branch at 0x{x.addr:x} leaves the loop to 0x{x.target:x}" for x in body[:-1]
                if x.target is not None and not lo <= x.target <= hi + 16]
    elements = sum(16 // elem_bytes for x in body if _is_wide_load(x))
    per_32 = len(body) * 32 / elements
    ops = collections.Counter(x.opcode.split(".")[0] for x in body)
    return LoopCount(name, grad, count_zeros, lo, hi, len(body), elements, per_32,
                     passed=per_32 <= BUDGET_PER_32, top_opcodes=dict(ops.most_common(6)), warnings=warnings)


def find_disassembler(explicit: Optional[str] = None, search_dirs: Optional[Sequence[str]] = None,
                      use_path: bool = True) -> Dict[str, str]:
    """{"nvdisasm": path, "cuobjdump": path} for the tools found (siblings of an explicit one count).
    Raises DisassemblerNotFound, naming the fix, when there is none."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise DisassemblerNotFound(f"--disassembler {explicit}: not an executable file; {SEARCH_HINT}")
        dirs = [os.path.dirname(os.path.abspath(explicit))]
    else:
        dirs = list(search_dirs) if search_dirs is not None else _default_dirs()
    found: Dict[str, str] = {}
    for tool in ("nvdisasm", "cuobjdump"):
        if explicit and os.path.basename(explicit).startswith(tool):
            found[tool] = explicit
            continue
        cands = ([shutil.which(tool)] if use_path and not explicit else []) + [os.path.join(d, tool) for d in dirs]
        path = next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
        if path:
            found[tool] = path
    if not found:
        raise DisassemblerNotFound(f"no SASS disassembler (nvdisasm or cuobjdump) found; {SEARCH_HINT}")
    return found


def _default_dirs() -> List[str]:
    import site
    dirs = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin"), "/usr/local/cuda/bin"]
    for sp in site.getsitepackages() + [site.getusersitepackages()]:
        dirs += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "bin")))
    return dirs + sorted(glob.glob("/tmp/sasstools/**/bin", recursive=True))


def disassemble(binary: str, tools: Dict[str, str], arch: str) -> Tuple[str, str]:
    """(SASS listing, tool version line). A cubin goes to nvdisasm when present; a .so needs cuobjdump."""
    if binary.endswith(".cubin") and "nvdisasm" in tools:
        cmd = [tools["nvdisasm"], "-c", binary]
    elif "cuobjdump" in tools:
        cmd = [tools["cuobjdump"], "-sass", "-arch", arch, binary]
    else:
        raise DisassemblerNotFound(f"{binary} is not a .cubin, so cuobjdump is needed to read its fat binary; "
                                   f"{SEARCH_HINT} (the nvidia-cuda-cuobjdump wheel), or pass a cubin")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    ver = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return out, f"{os.path.basename(cmd[0])} {ver[-2] if len(ver) >= 2 else '?'}"


def default_extension() -> str:
    import importlib.util
    spec = importlib.util.find_spec("megatron_opt")  # the package dir, without importing torch
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("megatron_opt is not installed; pass the extension .so or a cubin")
    hits = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so")))
    if not hits:
        raise SystemExit("megatron_opt._C (the CUDA extension) is not built; pass a .so or a cubin")
    return hits[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", nargs="?", help="extension .so or a .cubin (default: installed megatron_opt._C)")
    ap.add_argument("--disassembler", help="path to nvdisasm or cuobjdump (default: auto-detect)")
    ap.add_argument("--arch", default="sm_90", help="SASS arch to read from a fat binary (default sm_90)")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    binary = args.binary or default_extension()
    if not os.path.isfile(binary):
        ap.error(f"{binary}: no such file")
    try:
        tools = find_disassembler(args.disassembler)
        sass, version = disassemble(binary, tools, args.arch)
    except DisassemblerNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows: List[LoopCount] = []
    for name, instrs in parse_functions(sass).items():
        m = KERNEL_RE.search(name)
        if m:
            rows.append(count_loop(name, instrs, ELEM_BYTES[m.group(1)], GRAD_NAME[m.group(1)], m.group(2) == "1"))
    if not rows:
        print(f"error: no grad_stats_kernel instantiation in {binary} ({args.arch})", file=sys.stderr)
        return 1
    rows.sort(key=lambda r: (r.grad, r.count_zeros))
    print(f"{binary} ({args.arch}), {version}, budget {BUDGET_PER_32} instructions per 32 elements")
    print(f"{'kernel':<44} {'loop':<13} {'instr/iter':>10} {'elem/iter':>9} {'instr/32':>8}  {'budget':<6}  "
          f"top opcodes")
    for r in rows:
        label = f"grad_stats_kernel<{r.grad}, kCountZeros={str(r.count_zeros).lower()}>"
        ops = ", ".join(f"{k} {v}" for k, v in r.top_opcodes.items())
        loop = f"{r.loop_start:#x}-{r.loop_end:#x}"
        print(f"{label:<44} {loop:<13} {r.instructions:>10} {r.elements:>9} {r.per_32:>8.1f}  "
              f"{'pass' if r.passed else 'over':<6}  {ops}")
        for w in r.warnings:
            print(f"  warning: {w} (the straight-line count may miss out-of-line code)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"binary": binary, "arch": args.arch, "disassembler": version,
                       "budget_per_32": BUDGET_PER_32, "kernels": [asdict(r) for r in rows]}, f, indent=2)
    return 0 if all(r.passed for r in rows if r.count_zeros is False) else 1


if __name__ == "__main__":
    sys.exit(main())
