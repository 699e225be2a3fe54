"""What XLA keeps from a stage's forward for its backward, and what its backward holds at
once, read from optimized HLO.

JAX's autodiff names the residuals a stage's backward needs (memory.residuals); XLA's
fusion then keeps fewer or other buffers: it recomputes cheap elementwise chains inside
the backward's fusions, keeps a fused producer's result instead of its inputs, and keeps
buffers JAX does not list as such (random bits of dropout, index tensors). Measured on
configs/gpt2-tiny.yaml: the attention-and-MLP stages' JAX residuals are 1,913,348 B and
3,674,624 B, XLA keeps 1,585,152 B and 2,101,248 B of their forward for the backward
(docs/jax-facts.md, fact 7).

`kept_bytes` reads that from the text of a compiled forward+backward: the buffers
computed without the cotangent (or activation inputs) that an instruction depending on
the cotangent reads. `live_peak_bytes` reads the most bytes live at once along its
schedule: the stage's input and cotangents are not all live at its backward's peak
(docs/jax-facts.md, fact 10). Only the entry computation is read: a fusion or a loop is
one instruction there, its result one buffer (or one per element of a tuple).
"""

from __future__ import annotations

import re

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# Instructions that name (part of) another instruction's buffer instead of their own.
_ALIASES = frozenset({"bitcast", "get-tuple-element", "tuple"})


def array_bytes(shape: str) -> int:
    """Bytes of an HLO array shape such as `f32[4,64,128]{2,1,0}` (0 for a tuple)."""
    m = _ARRAY.match(shape.strip())
    if m is None or shape.lstrip().startswith("("):
        return 0
    n = _ITEMSIZE.get(m.group(1), 4)
    for d in m.group(2).split(","):
        if d:
            n *= int(d)
    return n


def _entry(text: str) -> list[tuple[str, str, str, list[str], str, str]]:
    """(name, shape, opcode, operand names, operand text, attributes) of each instruction
    of the entry computation, in schedule order."""
    start = text.index("\nENTRY")
    body = text[text.index("{", start) + 1:]
    out = []
    for line in body.splitlines():
        if line.strip() == "}":
            break
        m = _INSTRUCTION.match(line)
        if m:
            name, shape, op, args, attrs = m.groups()
            out.append((name, shape, op, re.findall(r"%([\w.\-]+)", args), args, attrs))
    return out


def _buffers(insts) -> tuple[dict[str, object], dict[object, int]]:
    """What each instruction's name refers to, and each buffer's bytes. A name refers to
    its own buffer (the name), to an element of another instruction's tuple result
    ((that name, index): a get-tuple-element, through bitcasts), or, for a tuple, to
    the list of its elements' buffers."""
    buffer: dict[str, object] = {}
    size: dict[object, int] = {}
    for name, shape, op, operands, args, attrs in insts:
        if op == "bitcast" and operands:
            buffer[name] = buffer.get(operands[0], operands[0])
        elif op == "get-tuple-element" and operands:
            index = re.search(r"index=(\d+)", attrs)
            i = int(index.group(1)) if index else 0
            base = buffer.get(operands[0], operands[0])
            if isinstance(base, list):
                buffer[name] = base[i] if i < len(base) else None
            else:
                buffer[name] = (base, i)
                size[(base, i)] = array_bytes(shape)
        elif op == "tuple":
            buffer[name] = [buffer.get(o, o) for o in operands]
        else:
            buffer[name] = name
            size[name] = array_bytes(shape)
    return buffer, size


def _flat(key) -> list:
    """The buffers a name refers to (_buffers), a tuple's flattened."""
    if isinstance(key, list):
        return [b for k in key for b in _flat(k)]
    return [] if key is None else [key]


def live_peak_bytes(text: str, counted_params: set[int], uncounted_outputs: set[int]) -> int:
    """The most bytes live at once in a compiled function (`text`: its optimized HLO),
    following its schedule: an instruction's result is live from the instruction to its
    last reader, an entry parameter from the start to its last reader, an output from
    the instruction that makes it to the end. Every result counts (XLA's temporaries),
    constants do not, a parameter only if it is in `counted_params` (entry parameter
    numbers), an output unless it is in `uncounted_outputs` (positions in the result
    tuple) and not a parameter.

    A stage's forward+backward compiled alone as one function: its activation inputs
    and output cotangents die at their last use and its input cotangents are made late,
    where XLA's `temp_size_in_bytes` leaves all three out and a sum over them and the
    temp counts them live together (docs/jax-facts.md, fact 10). The instruction where
    several buffers are read and one is made counts them all, as XLA's live ranges do.
    """
    insts = _entry(text)
    opcode = {name: op for name, _, op, *_ in insts}
    buffer, size = _buffers(insts)
    born: dict[object, int] = {}
    last: dict[object, int] = {}
    for t, (name, shape, op, operands, args, attrs) in enumerate(insts):
        for o in operands:
            for key in _flat(buffer.get(o, o)):
                last[key] = t
    for t, (name, shape, op, operands, args, attrs) in enumerate(insts):
        if op == "parameter":
            born[name] = 0
            if int(args) not in counted_params:
                size[name] = 0
        elif op == "constant":
            size[name] = 0
        born.setdefault(name, t)
    end = len(insts)
    root = insts[-1][0] if insts else None
    outs = buffer.get(root, root)
    for i, out in enumerate(outs if isinstance(outs, list) else [outs]):
        for key in _flat(out):
            base = key[0] if isinstance(key, tuple) else key
            if i in uncounted_outputs and opcode.get(base) != "parameter":
                size[key] = 0
            else:
                last[key] = end
    spans = []
    for key, nbytes in size.items():
        if not nbytes:
            continue
        base = key[0] if isinstance(key, tuple) else key
        start = born.get(base, 0)
        spans.append((start, last.get(key, start), nbytes))
    return _most_live(spans, end)


def _most_live(spans, end: int) -> int:
    """The most bytes live at once of buffers live over [start, stop] (instruction
    positions up to `end`), each given as (start, stop, bytes)."""
    change = [0] * (end + 2)
    for start, stop, nbytes in spans:
        change[start] += nbytes
        change[max(stop, start) + 1] -= nbytes
    peak = live = 0
    for delta in change:
        live += delta
        peak = max(peak, live)
    return peak


def kept_bytes(text: str, activation_params: set[int], cotangent_params: set[int]) -> int:
    """Bytes of the buffers a compiled forward+backward (`text`: its optimized HLO) holds
    from its forward for its backward.

    Args:
      text: `compiled.as_text()` of a function of (inputs..., cotangents...), with every
        argument kept (jax.jit(..., keep_unused=True)) so that entry parameter k is
        argument k.
      activation_params: entry parameter numbers of activation inputs (counted when the
        backward reads them: the stage's input kept for it); other inputs (weights,
        batch, constants) are live anyway and not counted.
      cotangent_params: entry parameter numbers of the cotangents.
    Returns:
      The bytes of every buffer defined without the cotangents (an instruction's result,
      or an activation input) that an instruction depending on the cotangents reads.
      A buffer computed from constants alone (the zeros a scatter-add of the backward
      starts from, an iota) is not the forward's: XLA makes it wherever its schedule
      puts it, so it is not counted.
    """
    insts = _entry(text)
    ops = {name: op for name, _, op, *_ in insts}
    buffer, size = _buffers(insts)
    param_no, depends, reads_input = _dependence(insts, cotangent_params)
    kept = set()
    for name, _, op, operands, _, _ in insts:
        if name not in depends or op in _ALIASES:
            continue
        for o in operands:
            # a tuple operand (a checkpoint's optimization barrier over its residuals and
            # the cotangents) is read element by element
            for key in _flat(buffer.get(o, o)):
                base = key[0] if isinstance(key, tuple) else key
                if base in depends or ops.get(base) == "constant" or base not in reads_input:
                    continue
                if ops.get(base) == "parameter" and param_no.get(base) not in activation_params:
                    continue
                kept.add(key)
    return int(sum(size.get(k, 0) for k in kept))


def _dependence(insts, cotangent_params: set[int]):
    """Entry parameter numbers by name, the instructions that depend on the cotangents
    (through any path), and those that read an entry parameter (through any path: the
    rest are made from constants alone)."""
    param_no: dict[str, int] = {}
    depends: set[str] = set()
    reads_input: set[str] = set()
    for name, shape, op, operands, args, attrs in insts:
        if op == "parameter":
            param_no[name] = int(args)
            reads_input.add(name)
            if int(args) in cotangent_params:
                depends.add(name)
        elif any(o in depends for o in operands):
            depends.add(name)
        if any(o in reads_input for o in operands):
            reads_input.add(name)
    return param_no, depends, reads_input


def forward_peak_bytes(text: str, activation_params: set[int], cotangent_params: set[int]) -> int:
    """The most bytes live at once in the forward of a compiled forward+backward (`text`),
    run as a stored stage runs in the step: what it keeps for its backward stays.

    The forward is the instructions that do not depend on the cotangents, in schedule
    order. A result is live from its instruction to its last forward reader, or to the
    forward's end when the backward reads it (kept_bytes's buffers: they live on to the
    backward); an activation input from the start. Weights, constants and buffers made
    from constants alone are not counted (kept_bytes). The stage's forward compiled alone
    frees every intermediate after its last use, so its temp plus what is kept counts
    the kept buffers twice at its peak: on the corpus ViT's MLP stage, forward alone
    2,929,600 B of temp, kept 3,469,440 B (docs/jax-facts.md, fact 16).
    """
    insts = _entry(text)
    ops = {name: op for name, _, op, *_ in insts}
    buffer, size = _buffers(insts)
    param_no, depends, reads_input = _dependence(insts, cotangent_params)
    forward = [inst for inst in insts if inst[0] not in depends]
    position = {inst[0]: k for k, inst in enumerate(forward)}
    end = len(forward)
    last: dict[object, int] = {}
    for name, shape, op, operands, args, attrs in insts:
        at = end if name in depends else position[name]
        for o in operands:
            for key in _flat(buffer.get(o, o)):
                base = key[0] if isinstance(key, tuple) else key
                if base not in depends:
                    last[key] = max(last.get(key, 0), at)
    spans = []
    for key, nbytes in size.items():
        base = key[0] if isinstance(key, tuple) else key
        if not nbytes or base in depends or base not in reads_input or ops.get(base) == "constant":
            continue
        if ops.get(base) == "parameter" and param_no.get(base) not in activation_params:
            continue
        start = position.get(base, 0)
        spans.append((start, last.get(key, start), nbytes))
    return _most_live(spans, end)
