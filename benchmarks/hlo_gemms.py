"""How a compiled step's GEMMs run, read from its HLO text: a cuBLASLt FP8 call, a Triton GEMM fusion (with f8
operands, or a bf16 dot with an f8 prologue), a plain cuBLAS call, or a dot XLA emits itself. `throughput.py`
records these counts for an FP8 run (`harness.gemm_kinds`)."""
from __future__ import annotations

import collections
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\s]+(?:,\s*%[^,}\s]+)*)\}?")
_TYPE = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+?|tf32)\[")


def _computations(hlo: str) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    """({computation: its instruction lines}, {computation: {value name: element type}})."""
    comps, types, name = {}, {}, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith((" ", "\t")):
            name = m.group(1)
            comps[name] = []
            types[name] = dict(re.findall(r"([\w.\-]+):\s*(\w+)\[", line.split("->")[0]))
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line)
            d = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?(\w+)\[", line)
            if d:
                types[name][d.group(1)] = d.group(2)
    return comps, types


def _callees(line: str) -> list[str]:
    out = []
    for m in _CALLS.finditer(line):
        out += [c.strip().lstrip("%").rstrip(",") for c in m.group(1).split(",")]
    return out


def _operand_types(line: str, op: str, types: dict[str, str]) -> list[str]:
    """The element types of `op`'s operands on `line`: printed with them, or looked up by name in `types`."""
    i = line.find(op + "(")
    depth, j = 0, i + len(op)
    for j in range(i + len(op), len(line)):
        depth += line[j] == "("
        depth -= line[j] == ")"
        if depth == 0:
            break
    inner = line[i + len(op) + 1:j]
    return _TYPE.findall(inner) or [types.get(n, "?") for n in re.findall(r"%([\w.\-]+)", inner)]


def _out_type(line: str) -> str:
    m = re.search(r"=\s*\(?\s*(\w+)\[", line)
    return m.group(1) if m else "?"


def gemm_lowering(hlo: str) -> collections.Counter:
    """How each GEMM of a compiled HLO module runs, counted by label: `custom-call <target> [operand types]`,
    `<fusion backend kind> dot[lhs,rhs->out]` (+ ` f8-in-fusion` when f8 values are inside that fusion), or
    `xla dot[...]` for a dot XLA emits itself (CPU, or a GPU's loop fusion)."""
    return collections.Counter(label for label, _ in gemm_details(hlo))


def gemm_details(hlo: str) -> list[tuple[str, str]]:
    """(label, the op_name XLA kept in its metadata: which einsum it came from) for each GEMM, as gemm_lowering."""
    comps, types = _computations(hlo)
    parent = {}  # callee -> (caller computation, caller line)
    for cname, lines in comps.items():
        for line in lines:
            for callee in _callees(line):
                parent.setdefault(callee, (cname, line))

    def closure(cname):
        seen, todo = set(), [cname]
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for line in comps[c]:
                todo += _callees(line)
        return seen

    def outer_fusion(cname):
        """The backend kind of the outermost fusion enclosing computation `cname`, and that fusion's callee."""
        kind, top = None, None
        while cname in parent:
            caller_comp, line = parent[cname]
            if " fusion(" in line:
                m = re.search(r'"kind":"([^"]+)"', line)
                fk = re.search(r"kind=(k\w+)", line)
                kind, top = (m.group(1) if m else (fk.group(1) if fk else "fusion")), cname
            cname = caller_comp
        return kind, top

    def where(line):  # "mlp/btd,df->btf" (forward) or "mlp/transpose(jvp(btd,df->btf))" (its backward)
        m = re.search(r'op_name="([^"]+)"', line)
        parts = [p for p in m.group(1).split("/") if p != "dot_general"] if m else ["?"]
        return "/".join(parts[-2:])

    out = []
    for cname, lines in comps.items():
        for line in lines:
            if "custom-call(" in line:
                m = re.search(r'custom_call_target="([^"]+)"', line)
                target = m.group(1) if m else "?"
                if any(k in target.lower() for k in ("cublas", "gemm", "matmul", "triton", "pallas", "mosaic")):
                    ops = _operand_types(line, "custom-call", types[cname])
                    out.append((f"custom-call {target} [{','.join(ops[:2])}->{_out_type(line)}]", where(line)))
                continue
            for op in ("scaled-dot", "dot"):
                if re.search(rf"\s{op}\(", line):
                    ops = _operand_types(line, op, types[cname])
                    kind, top = outer_fusion(cname)
                    label = f"{kind or 'xla'} {op}[{','.join(ops[:2])}->{_out_type(line)}]"
                    if top and any("f8e" in ln for c in closure(top) for ln in comps[c]) and not any(
                            t.startswith("f8") for t in ops[:2]):
                        label += " f8-in-fusion"
                    out.append((label, where(line)))
                    break
    return out
