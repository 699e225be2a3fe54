"""Re-measure the JAX/XLA behaviours the planner relies on (docs/jax-facts.md).

Everything is compiled on abstract shapes (nothing allocated) and read from XLA's
`memory_analysis()` and `cost_analysis()`. Run from the repository root:

    python scripts/jax_facts.py

1. On CPU, XLA removes rematerialization unless compiled with
   `xla_disable_hlo_passes=cse_barrier_expander` (memory.compiler_options).
2. One `jax.checkpoint` around the whole loss does not lower the peak; separate
   checkpoints (segments) do.
3. In a donated optax step, XLA applies each parameter's update once its gradient is
   complete, so gradients are not all live at once; an update that reads every
   gradient (clip_by_global_norm) holds them all (memory.per_parameter_update).
4. A scan iteration of g > 1 layers holds its parameter cotangent
   (scan.mixed_cotangent_bytes).
5. `prevent_cse` on a checkpoint inside a scan changes XLA's buffer assignment, so the
   scan replay uses what scanned layer stacks are written with (apply.run_segments).
6. In a donated step XLA copies the parameters the backward still reads after their
   update could run, and places the copies in donated parameter buffers: they cost
   about one parameter of temp, not their sum.
8. XLA's CPU scheduler generates every layer's dropout random bits at the start of the
   forward, so each layer's bits are live from there until the layer runs, even where the
   layer is checkpointed (memory.with_random_bits).
9. On CPU, XLA makes the index iotas of every max pooling's gradient at the start of the
   step, and holds them until the pooling's argmax (in the backward for a checkpointed
   pooling): four times its input's bytes for an image (memory.with_pooling_indices).
10. A stage's input, its cotangent and its output's cotangent are not all live at the
   peak of its backward compiled alone: the model charges the most bytes live at once
   in XLA's schedule, not XLA's temp plus all three (memory._xla_workspace).
11. A mask passed into every checkpointed block is one buffer, whatever the number of
   blocks: each block adds its own input to the step's peak, not the mask again
   (memory.carried_values).
16. A stored stage's forward holds what it keeps with its workspace: the forward
   compiled alone frees what the step keeps, so its temp and the kept bytes overlap
   (hlo.forward_peak_bytes).
17. A checkpoint keeps a bfloat16 dot's output at bfloat16 width across its
   optimization barrier, though XLA:CPU runs the dot in float32 (hlo.kept_bytes reads
   the barrier's tuple); the memory model still sizes it at float32 width
   (memory.narrow_dots_kept_wide).
18. In a step without remat, a residual convolution block's input, which its backward
   reads only in elementwise fusions (the weight gradients read a transposed copy), is
   recomputed from the block before's buffers, not held: one input less per block than
   the block compiled alone keeps; the memory model still charges it
   (tests/test_corpus.py, MODEL_ERROR_OUT's cnn_bn plans).
"""

from __future__ import annotations

import functools
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from xla_peak_breakdown import allocation_kinds  # noqa: E402  (the one reader of the dump)
from remat_planner import hlo  # noqa: E402

MIB = 2 ** 20
REMAT_OPTION = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def _compile(f, *args, options=None, donate=()):
    return jax.jit(f, donate_argnums=donate).lower(*args).compile(options or {})


def _temp_and_flops(compiled) -> tuple[float, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return compiled.memory_analysis().temp_size_in_bytes / MIB, float(cost.get("flops", 0.0))


def _mlp(n_layers: int, d: int, rows: int, residual: bool = True):
    """n_layers layers of `h + sin(tanh(h @ W) @ W.T)` (residual: each layer keeps several
    activations for its backward, so a checkpoint per layer saves memory) or `tanh(h @ W)`."""
    ws = [jax.ShapeDtypeStruct((d, d), jnp.float32)] * n_layers
    x = jax.ShapeDtypeStruct((rows, d), jnp.float32)

    def layer(w, h):
        return h + jnp.sin(jnp.tanh(h @ w) @ w.T) if residual else jnp.tanh(h @ w)

    return ws, x, layer


def fact_cpu_option() -> list[str]:
    ws, x, layer = _mlp(8, 1024, 2048)

    def loss(ws, x, remat):
        h = x
        for w in ws:
            h = jax.checkpoint(layer)(w, h) if remat else layer(w, h)
        return jnp.sum(h ** 2)

    rows = []
    for label, remat, options in (("no remat", False, None),
                                  ("jax.checkpoint per layer, default options", True, None),
                                  ("jax.checkpoint per layer, cse_barrier_expander off", True,
                                   REMAT_OPTION)):
        c = _compile(jax.grad(lambda ws, x, r=remat: loss(ws, x, r)), ws, x, options=options)
        temp, flops = _temp_and_flops(c)
        rows.append(f"| {label} | {temp:.1f} | {flops / 1e9:.2f} |")
    return ["| 8 layers h + sin(tanh(h @ W) @ W.T), d 1024, 2048 rows, jax.grad | temp MiB | "
            "GFLOP |",
            "|---|---|---|", *rows]


def fact_one_checkpoint() -> list[str]:
    ws, x, layer = _mlp(8, 1024, 2048)

    def plain(ws, x):
        h = x
        for w in ws:
            h = layer(w, h)
        return jnp.sum(h ** 2)

    def segmented(ws, x, k):
        h = x
        for i in range(0, len(ws), k):
            h = jax.checkpoint(lambda hs, h: plain_part(hs, h))(ws[i:i + k], h)
        return jnp.sum(h ** 2)

    def plain_part(ws, h):
        for w in ws:
            h = layer(w, h)
        return h

    rows = []
    for label, f in (("no remat", plain),
                     ("one checkpoint around the whole loss",
                      lambda ws, x: jax.checkpoint(plain)(ws, x)),
                     ("one checkpoint per 2 layers", lambda ws, x: segmented(ws, x, 2)),
                     ("one checkpoint per layer", lambda ws, x: segmented(ws, x, 1))):
        temp, _ = _temp_and_flops(_compile(jax.grad(f), ws, x, options=REMAT_OPTION))
        rows.append(f"| {label} | {temp:.1f} |")
    return ["| same MLP, cse_barrier_expander off | temp MiB |", "|---|---|", *rows]


def fact_gradient_lifetimes() -> list[str]:
    rows = []
    for batch in (64, 4096):
        ws, x, layer = _mlp(8, 1024, batch, residual=False)

        def loss(ws, x):
            h = x
            for w in ws:
                h = layer(w, h)
            return jnp.sum(h ** 2)

        cells = []
        for opt in (optax.adamw(1e-3), optax.sgd(1e-3),
                    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), None):
            if opt is None:
                c = _compile(jax.grad(loss), ws, x, options=REMAT_OPTION)
            else:
                state = jax.eval_shape(opt.init, ws)

                def step(ws, state, x, opt=opt):
                    g = jax.grad(loss)(ws, x)
                    updates, state = opt.update(g, state, ws)
                    return optax.apply_updates(ws, updates), state

                c = _compile(step, ws, state, x, options=REMAT_OPTION, donate=(0, 1))
            cells.append(f"{_temp_and_flops(c)[0]:.1f}")
        rows.append(f"| batch {batch} (activations {8 * batch * 1024 * 4 / MIB:.0f} MiB) | "
                    + " | ".join(cells) + " |")
    return ["| 8 layers tanh(h @ W) of 1024 x 1024 (32 MiB params, 32 MiB grads), temp MiB | "
            "AdamW | SGD | "
            "clip_by_global_norm + AdamW | jax.grad alone |", "|---|---|---|---|---|", *rows]


def fact_mixed_scan_iterations() -> list[str]:
    """12 layers as one lax.scan whose iterations run g layers each, every layer
    checkpointed and taking its weight slice inside its checkpoint (as the planner's
    replay of a mixed scheme does), in a donated AdamW step."""
    n, d, rows = 12, 256, 8
    layer_bytes = d * d * 4
    x = jax.ShapeDtypeStruct((rows, d), jnp.float32)
    stacked = jax.ShapeDtypeStruct((n, d, d), jnp.float32)
    _, _, layer = _mlp(1, d, rows)
    opt = optax.adamw(1e-3)
    state = jax.eval_shape(opt.init, stacked)
    temps = {}
    for g in (1, 2, 3, 4, 6):
        def loss(w, x, g=g):
            def body(h, wg):
                for j in range(g):
                    h = jax.checkpoint(lambda wg, h, j=j: layer(wg[j], h))(wg, h)
                return h, None
            h, _ = jax.lax.scan(body, x, w.reshape(n // g, g, d, d))
            return jnp.sum(h ** 2)

        def step(w, state, x, loss=loss):
            grads = jax.grad(loss)(w, x)
            updates, state = opt.update(grads, state, w)
            return optax.apply_updates(w, updates), state

        c = _compile(step, stacked, state, x, options=REMAT_OPTION, donate=(0, 1))
        temps[g] = c.memory_analysis().temp_size_in_bytes
    rows_out = [f"| {g} | {n // g} | {temps[g] / MIB:.2f} | "
                f"{(temps[g] - temps[1]) / layer_bytes:.1f} | {2 * g - 1 if g > 1 else 0} |"
                for g in temps]
    return ["| layers per iteration g | iterations | temp MiB | temp over g = 1, in layers' "
            "weights | 2 g - 1 |", "|---|---|---|---|---|", *rows_out]


def fact_prevent_cse_in_scan() -> list[str]:
    """A 6-layer attention-and-MLP stack as one lax.scan, the body checkpointed under each
    built-in policy with prevent_cse on (jax.checkpoint's default) and off (what a scanned
    layer stack is written with, and what the planner's scan replay uses)."""
    n, d = 6, 64
    policies = jax.checkpoint_policies

    def layer(w, h):
        w1, w2 = w
        a = jax.nn.softmax(jnp.einsum("bsd,btd->bst", h, h) / 8.0, axis=-1)
        h = h + jnp.einsum("bst,btd->bsd", a, h)
        return h + jnp.tanh(h @ w1) @ w2

    x = jax.ShapeDtypeStruct((2, 32, d), jnp.float32)
    w = (jax.ShapeDtypeStruct((n, d, 2 * d), jnp.float32),
         jax.ShapeDtypeStruct((n, 2 * d, d), jnp.float32))
    opt = optax.adamw(1e-3)
    state = jax.eval_shape(opt.init, w)
    rows = []
    for name in ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable"):
        temps = []
        for prevent_cse in (True, False):
            def loss(w, x, name=name, prevent_cse=prevent_cse):
                f = jax.checkpoint(layer, policy=getattr(policies, name),
                                   prevent_cse=prevent_cse)
                h, _ = jax.lax.scan(lambda h, wl: (f(wl, h), None), x, w)
                return jnp.sum(h ** 2)

            def step(w, state, x, loss=loss):
                updates, state = opt.update(jax.grad(loss)(w, x), state, w)
                return optax.apply_updates(w, updates), state

            c = _compile(step, w, state, x, options=REMAT_OPTION, donate=(0, 1))
            temps.append(c.memory_analysis().temp_size_in_bytes)
        rows.append(f"| {name} | {temps[0]:,} | {temps[1]:,} | "
                    f"{temps[1] / temps[0] - 1:+.1%} |")
    return ["| policy on the scan body | temp B, prevent_cse on | temp B, off | off vs on |",
            "|---|---|---|---|", *rows]


def fact_parameter_copies() -> list[str]:
    """The donated AdamW step of fact 3's MLP (and of the residual layers of fact 1): the
    `copy` instructions of entry parameters in the optimized HLO, and where XLA's buffer
    assignment put them; with `clip_by_global_norm` first, whose update waits for every
    gradient, so every read of a weight in the backward comes before its update."""
    rows = []
    for label, residual in (("tanh(h @ W)", False), ("h + sin(tanh(h @ W) @ W.T)", True)):
        for batch, clip in ((64, False), (4096, False), (64, True)):
            ws, x, layer = _mlp(8, 1024, batch, residual=residual)

            def loss(ws, x, layer=layer):
                h = x
                for w in ws:
                    h = layer(w, h)
                return jnp.sum(h ** 2)

            opt = (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)) if clip
                   else optax.adamw(1e-3))
            state = jax.eval_shape(opt.init, ws)

            def step(ws, state, x, loss=loss, opt=opt):
                updates, state = opt.update(jax.grad(loss)(ws, x), state, ws)
                return optax.apply_updates(ws, updates), state

            with tempfile.TemporaryDirectory() as tmp:
                c = _compile(step, ws, state, x, options={**REMAT_OPTION, "xla_dump_to": tmp},
                             donate=(0, 1))
                where = allocation_kinds(Path(tmp))
            text = c.as_text()
            entry = text[text.index("\nENTRY"):]
            params = {name for name, k in re.findall(r"%(\S+) = \S+ parameter\((\d+)\)", entry)
                      if int(k) < len(ws)}
            copies = [name for name, src in re.findall(r"%(\S+) = \S+ copy\(%([^)]+)\)", entry)
                      if src in params]
            in_temp = sum(where.get(name) == "temp" for name in copies)
            rows.append(f"| {label}, batch {batch}{', clip_by_global_norm' if clip else ''} | "
                        f"{len(copies)} | {in_temp} | "
                        f"{len(copies) - in_temp} | "
                        f"{c.memory_analysis().temp_size_in_bytes / MIB:.1f} |")
    return ["| 8 layers of 1024 x 1024, donated AdamW step | parameters copied | copies in temp "
            "| copies in donated parameter buffers | temp MiB |", "|---|---|---|---|---|", *rows]


def fact_dropout_bits_early() -> list[str]:
    """n layers of `tanh(h @ W)` with dropout (jax.random.bernoulli on a key folded per
    layer) or without, each layer checkpointed (nothing_saveable) or not; jax.grad of
    the sum of squares. Also where the optimized HLO's schedule puts the forward's
    random-bit loops (the CPU lowering of threefry is a `while`): before the second
    layer's matmul means generated ahead."""
    rows, d = 512, 512

    def layer(w, h, key, drop):
        h = jnp.tanh(h @ w)
        return jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0.0) if drop else h

    out = []
    for n in (2, 4, 8):
        temps, early, loops = {}, 0, 0
        for drop in (False, True):
            for ckpt in (False, True):
                def loss(ws, x, key, drop=drop, ckpt=ckpt):
                    h = x
                    for i, w in enumerate(ws):
                        f = functools.partial(layer, drop=drop)
                        if ckpt:
                            f = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
                        h = f(w, h, jax.random.fold_in(key, i))
                    return jnp.sum(h ** 2)

                ws = [jax.ShapeDtypeStruct((d, d), jnp.float32)] * n
                x = jax.ShapeDtypeStruct((rows, d), jnp.float32)
                key = jax.eval_shape(lambda: jax.random.key(0))
                c = _compile(jax.grad(loss), ws, x, key, options=REMAT_OPTION)
                temps[drop, ckpt] = c.memory_analysis().temp_size_in_bytes / MIB
                if drop and ckpt:
                    text = c.as_text()
                    entry = [line for line in text[text.index("\nENTRY"):].splitlines()
                             if " = " in line and "rematted" not in line]
                    bits = [i for i, line in enumerate(entry)
                            if " while(" in line and "_uniform" in line]
                    dots = [i for i, line in enumerate(entry)
                            if "dot_general" in line and "transpose" not in line]
                    early, loops = sum(i < dots[1] for i in bits), len(bits)
        out.append(f"| {n} | {temps[False, False]:.2f} | {temps[True, False]:.2f} | "
                   f"{temps[False, True]:.2f} | {temps[True, True]:.2f} | {early} of {loops} |")
    return [f"| layers of {rows} x {d} (1 MiB of activations each) | temp MiB, no dropout, "
            "no remat | dropout, no remat | no dropout, each layer checkpointed | dropout, "
            "each layer checkpointed | forward random-bit loops before the second layer's "
            "matmul |", "|---|---|---|---|---|---|", *out]


def fact_pooling_indices_early() -> list[str]:
    """n layers of `tanh(conv3x3(h))` followed by a 2 x 2 max pooling of stride 1 ("SAME",
    so every layer keeps the shape), or without the pooling, each layer checkpointed
    (nothing_saveable) or not; jax.grad of the sum of squares. Also what the optimized
    HLO's schedule does with the pooling's gradient: on CPU, XLA expands it into an
    argmax over one `s32` iota per dimension of the padded input, and the iotas, which
    depend on nothing, are scheduled before the first convolution."""
    b, hw, c = 4, 32, 16

    def layer(w, h, pool):
        h = jnp.tanh(jax.lax.conv_general_dilated(
            h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
        if pool:
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")
        return h

    out = []
    for n in (2, 4, 8):
        temps, early, iotas = {}, 0, 0
        for pool in (False, True):
            for ckpt in (False, True):
                def loss(ws, x, pool=pool, ckpt=ckpt):
                    h = x
                    for w in ws:
                        f = functools.partial(layer, pool=pool)
                        if ckpt:
                            f = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
                        h = f(w, h)
                    return jnp.sum(h ** 2)

                ws = [jax.ShapeDtypeStruct((3, 3, c, c), jnp.float32)] * n
                x = jax.ShapeDtypeStruct((b, hw, hw, c), jnp.float32)
                compiled = _compile(jax.grad(loss), ws, x, options=REMAT_OPTION)
                temps[pool, ckpt] = compiled.memory_analysis().temp_size_in_bytes / MIB
                if pool and ckpt:
                    text = compiled.as_text()
                    entry = [line for line in text[text.index("\nENTRY"):].splitlines()
                             if " = " in line]
                    found = [i for i, line in enumerate(entry) if "wrapped_iota" in line.split("=")[0]]
                    convs = [i for i, line in enumerate(entry) if "convolution(" in line
                             or "conv_general_dilated" in line.split("=")[0]]
                    early, iotas = sum(i < convs[0] for i in found), len(found)
        out.append(f"| {n} | {temps[False, False]:.2f} | {temps[True, False]:.2f} | "
                   f"{temps[False, True]:.2f} | {temps[True, True]:.2f} | {early} of {iotas} |")
    per_layer = 4 * 4 * b * (hw + 1) ** 2 * c / MIB
    return [f"| layers of {b} x {hw} x {hw} x {c} (0.25 MiB of activations each; the iotas "
            f"of one layer's pooling: 4 x s32[{b},{hw + 1},{hw + 1},{c}], {per_layer:.2f} MiB) | "
            "temp MiB, no pooling, no remat | pooling, no remat | no pooling, each layer "
            "checkpointed | pooling, each layer checkpointed | index iotas scheduled before "
            "the first convolution |", "|---|---|---|---|---|---|", *out]


def fact_boundaries_not_all_live() -> list[str]:
    """Stages compiled forward+backward alone, as the memory model profiles them (a function
    of the stage's inputs and its output's cotangent returning the input cotangents): XLA's
    temp, and the stage's boundaries (its activation input, that input's cotangent, the
    output's cotangent), which temp leaves out. Their sum is what the model charged for
    the stage's backward before; the most bytes live at once in the compiled schedule
    (hlo.live_peak_bytes: inputs until their last reader, the input cotangent from where
    it is made, weights and their gradients left out) is what it charges now."""
    from remat_planner import hlo
    from remat_planner.memory import vjp_wrt
    from remat_planner.trace import nbytes

    f32 = jnp.float32
    conv = functools.partial(jax.lax.conv_general_dilated, window_strides=(1, 1),
                             padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def up_block(x, skip, w1, w2):
        h = jnp.tanh(conv(jnp.concatenate([x, skip], axis=-1), w1))
        return [jnp.tanh(conv(h, w2))]

    cases = [
        ("the loss head `sum(x)`, x 16 x 32", lambda x: [jnp.sum(x)],
         [jax.ShapeDtypeStruct((16, 32), f32)], (0,)),
        ("`tanh(x @ W)`, x 16 x 32, W 32 x 32", lambda x, w: [jnp.tanh(x @ w)],
         [jax.ShapeDtypeStruct((16, 32), f32), jax.ShapeDtypeStruct((32, 32), f32)], (0,)),
        ("a U-Net up block: two 3 x 3 convolutions (tanh) over the concatenation of "
         "x and a skip, each 2 x 32 x 32 x 16", up_block,
         [jax.ShapeDtypeStruct((2, 32, 32, 16), f32)] * 2
         + [jax.ShapeDtypeStruct((3, 3, 32, 16), f32), jax.ShapeDtypeStruct((3, 3, 16, 16), f32)],
         (0, 1)),
    ]
    out = []
    for label, f, avals, acts in cases:
        wrt = tuple(range(len(avals)))
        ct = [jax.eval_shape(f, *avals)[0]]
        both = jax.jit(lambda a, c, f=f, wrt=wrt: vjp_wrt(f, a, wrt)[1](c), keep_unused=True)
        compiled = both.lower(avals, ct).compile(REMAT_OPTION)
        temp = compiled.memory_analysis().temp_size_in_bytes
        bounds = 2 * sum(nbytes(avals[i]) for i in acts) + nbytes(ct[0])
        n = len(avals)
        live = hlo.live_peak_bytes(compiled.as_text(), set(acts) | {n},
                                   {k for k in wrt if k not in acts})
        out.append(f"| {label} | {temp:,} | {bounds:,} | {temp + bounds:,} | {live:,} |")
    return ["| stage, float32 | XLA temp, B | boundaries, B | temp + boundaries (charged "
            "before), B | most live at once (charged now), B |", "|---|---|---|---|---|", *out]


def fact_mask_held_once() -> list[str]:
    """n blocks `x + tanh(((x @ x^T) * m) @ x @ W)` over x of 4 x 256 x 64 (256 KiB), each
    reading the same mask m of 4 x 256 x 256 (1 MiB) made from the batch (no gradient),
    each block checkpointed (nothing saved): XLA's temp of the donated step per number of
    blocks. Each block more adds about its input x (kept for its recomputation), not
    x and the mask: the checkpoints keep the one mask buffer."""
    f32 = jnp.float32
    bsz, t, d = 4, 256, 64
    x = jax.ShapeDtypeStruct((bsz, t, d), f32)
    tokens = jax.ShapeDtypeStruct((bsz, t), jnp.int32)

    def block(w, h, m):
        s = jnp.einsum("btd,bsd->bts", h, h) * m
        return h + jnp.tanh(jnp.einsum("bts,bsd->btd", s, h) @ w)

    rows = []
    for n in (2, 4, 8):
        ws = [jax.ShapeDtypeStruct((d, d), f32)] * n

        def loss(ws, x, tokens):
            m = (tokens[:, None, :] <= tokens[:, :, None]).astype(f32)
            h = x
            for w in ws:
                h = jax.checkpoint(block)(w, h, m)
            return jnp.sum(h)

        opt = optax.sgd(0.1)

        def step(ws, x, tokens):
            g = jax.grad(loss)(ws, x, tokens)
            updates, _ = opt.update(g, opt.init(ws), ws)
            return optax.apply_updates(ws, updates)

        temp, _ = _temp_and_flops(_compile(step, ws, x, tokens, options=REMAT_OPTION,
                                           donate=(0,)))
        rows.append((n, temp))
    out = [f"| {n} | {temp:.2f} |" for n, temp in rows]
    (n0, t0), (n1, t1) = rows[0], rows[-1]
    per_block = (t1 - t0) / (n1 - n0)
    return ["| blocks, each checkpointed | XLA temp, MiB |", "|---|---|", *out, "",
            f"Each block more: {per_block:.3f} MiB (its input x: 0.250 MiB; x and the mask: "
            f"1.250 MiB)."]


def fact_table_gradient_zeros() -> list[str]:
    """An embedding table of V x 256 read by a gather (`emb[tokens]`, 16 x 256 tokens),
    then 8 layers `h + tanh(h @ W)` (4 MiB of activations each), stored or each
    checkpointed; the donated AdamW step. Its gradient is a scatter-add into zeros of the
    table's shape: where the schedule puts those zeros and the scatter, and XLA's temp
    per table size."""
    b, t, d, n = 16, 256, 256, 8
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
    opt = optax.adamw(1e-3)
    rows, temps = [], {}
    for vocab in (1024, 4096):
        for ckpt in (False, True):
            params = {"emb": jax.ShapeDtypeStruct((vocab, d), jnp.float32),
                      "ws": [jax.ShapeDtypeStruct((d, d), jnp.float32)] * n}

            def loss(p, tokens, ckpt=ckpt):
                h = p["emb"][tokens]
                for w in p["ws"]:
                    f = lambda w, h: h + jnp.tanh(h @ w)
                    h = (jax.checkpoint(f) if ckpt else f)(w, h)
                return jnp.mean(h ** 2)

            def step(p, s, tokens, loss=loss):
                u, s = opt.update(jax.grad(loss)(p, tokens), s, p)
                return optax.apply_updates(p, u), s

            state = jax.eval_shape(opt.init, params)
            compiled = _compile(step, params, state, tokens, options=REMAT_OPTION,
                                donate=(0, 1))
            text = compiled.as_text()
            entry = [line for line in text[text.index("\nENTRY"):].splitlines()
                     if " = " in line]
            lhs = [line.split("=")[0] for line in entry]
            zeros = [i for i, line in enumerate(entry) if "broadcast" in lhs[i]
                     and f"f32[{vocab},{d}]" in line.split("=", 1)[1][:40]]
            dots = [i for i, line in enumerate(entry) if " dot(" in line or "ynn_fusion" in lhs[i]]
            scatters = [i for i, line in enumerate(entry) if "scatter" in lhs[i]]
            temps[vocab, ckpt] = compiled.memory_analysis().temp_size_in_bytes / MIB
            rows.append(f"| {vocab} x {d} ({vocab * d * 4 / MIB:.0f} MiB) | "
                        f"{'each checkpointed' if ckpt else 'stored'} | {temps[vocab, ckpt]:.3f} | "
                        f"{zeros[0] if zeros else '-'} | {dots[0]} | "
                        f"{scatters[-1] if scatters else '-'} of {len(entry)} |")
    grow = [temps[4096, c] - temps[1024, c] for c in (False, True)]
    return ["| table | layers | XLA temp, MiB | the zeros at | first matmul at | the scatter at |",
            "|---|---|---|---|---|---|", *rows, "",
            f"From the 1 MiB table to the 4 MiB one the temp grows by {grow[0]:.3f} MiB "
            f"(stored) and {grow[1]:.3f} MiB (checkpointed): the whole table's gradient is "
            "live at the peak, in the layers' backward, long before the gather's."]


def fact_pooling_zeros_early() -> list[str]:
    """n = 4 layers of `tanh(conv3x3(h))`, each followed by a max pooling (several windows,
    strides and paddings), stored or each checkpointed; jax.grad of the sum of squares.
    Where the schedule makes the zeros each pooling's gradient is scattered into (the
    scatter's first operand: a broadcast of a constant, or a copy of one), and where the
    scatter runs. Last, the pooling's input also read by a skip (`+ sum(h * h)`): what the
    scatter starts from then."""
    b, c, n = 2, 8, 4
    rows = []
    for win, stride, pad, skip in (((2, 2), (1, 1), "SAME", False), ((2, 2), (2, 2), "VALID", False),
                                   ((3, 3), (2, 2), "SAME", False), ((2, 2), (2, 2), "VALID", True)):
        hw = 16 * stride[0] ** n  # 16 x 16 after the last pooling
        for ckpt in (False, True):
            def layer(w, h):
                h = jnp.tanh(jax.lax.conv_general_dilated(
                    h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
                p = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, *win, 1), (1, *stride, 1), pad)
                return p, jnp.sum(h * h)

            def loss(ws, x, ckpt=ckpt):
                h, extra = x, 0.0
                for w in ws:
                    f = jax.checkpoint(layer) if ckpt else layer
                    h, s = f(w, h)
                    extra = extra + (s if skip else 0.0)
                return jnp.sum(h ** 2) + extra

            ws = [jax.ShapeDtypeStruct((3, 3, c, c), jnp.float32)] * n
            x = jax.ShapeDtypeStruct((b, hw, hw, c), jnp.float32)
            text = _compile(jax.grad(loss), ws, x, options=REMAT_OPTION).as_text()
            entry = [line for line in text[text.index("\nENTRY"):].splitlines() if " = " in line]
            where = {line.split("=")[0].strip().lstrip("%"): i for i, line in enumerate(entry)}
            convs = [i for i, line in enumerate(entry) if "convolution(" in line]
            made, used, sources = [], [], set()
            for i, line in enumerate(entry):
                if "scatter" not in line.split("=")[0]:
                    continue
                src = re.findall(r"%([\w.\-]+)", line.split("=", 1)[1].split("(", 1)[1])[0]
                src_line = entry[where[src]].split("=", 1)[1]
                zeros = "copy(%wrapped_broadcast" in src_line or "fusion(%constant" in src_line
                sources.add("zeros" if zeros else src_line.split("(")[0].split()[-1])
                made.append(where[src])
                used.append(i)
            rows.append(f"| {win[0]}x{win[1]} stride {stride[0]} {pad}{', input read by a skip' if skip else ''} | "
                        f"{'each checkpointed' if ckpt else 'stored'} | {convs[0]} | "
                        f"{', '.join(sorted(sources))} | {min(made)}-{max(made)} | "
                        f"{min(used)}-{max(used)} of {len(entry)} |")
    return ["| pooling | layers | first convolution at | the scatters start from | made at | "
            "the scatters at |", "|---|---|---|---|---|---|", *rows]


def fact_returned_loss_held() -> list[str]:
    """A loss head alone, `mean(-take_along_axis(log_softmax(h @ W), targets))` over h of
    4 x 256 x 64 and W of 64 x 4096 (logits 4 x 256 x 4096: 16 MiB), compiled as its
    forward and backward (the input cotangents), with the loss value returned too or
    not: XLA's temp, and the most bytes live at once (arguments and outputs included), in
    logits."""
    h = jax.ShapeDtypeStruct((4, 256, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
    targets = jax.ShapeDtypeStruct((4, 256), jnp.int32)
    ct = jax.ShapeDtypeStruct((), jnp.float32)
    logits = 4 * 256 * 4096 * 4

    def head(h, w, targets):
        logp = jax.nn.log_softmax(h @ w, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    rows = []
    for returned in (False, True):
        def fwd_bwd(h, w, targets, ct, returned=returned):
            loss, vjp = jax.vjp(lambda h, w: head(h, w, targets), h, w)
            return (*vjp(ct), loss) if returned else vjp(ct)

        compiled = _compile(fwd_bwd, h, w, targets, ct, options=REMAT_OPTION)
        live = hlo.live_peak_bytes(compiled.as_text(), set(range(4)), set())
        rows.append(f"| {'yes' if returned else 'no'} | "
                    f"{compiled.memory_analysis().temp_size_in_bytes / logits:.2f} | "
                    f"{live / logits:.2f} |")
    return ["| the loss returned | XLA temp, logits | live peak (hlo.live_peak_bytes), logits |",
            "|---|---|---|", *rows]


def fact_stored_forward_overlaps() -> list[str]:
    """One layer `tanh(tanh(x @ W1) @ W3) @ W2` (x: rows x 256, hidden 1024), compiled
    as its forward and backward: what XLA keeps for the backward (hlo.kept_bytes), the
    most bytes its forward holds at once keeping them (hlo.forward_peak_bytes), and the
    forward compiled alone's temp, in hidden activations (rows x 1024 float32)."""
    rows_out = []
    for rows in (256, 1024):
        x = jax.ShapeDtypeStruct((rows, 256), jnp.float32)
        w1 = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
        w3 = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
        w2 = jax.ShapeDtypeStruct((1024, 256), jnp.float32)

        def layer(x, w1, w3, w2):
            return jnp.tanh(jnp.tanh(x @ w1) @ w3) @ w2

        def fwd_bwd(x, w1, w3, w2, ct):
            return jax.vjp(layer, x, w1, w3, w2)[1](ct)

        text = _compile(fwd_bwd, x, w1, w3, w2, x, options=REMAT_OPTION).as_text()
        alone = _compile(layer, x, w1, w3, w2, options=REMAT_OPTION)
        hidden = rows * 1024 * 4
        kept = hlo.kept_bytes(text, {0}, {4})
        peak = hlo.forward_peak_bytes(text, {0}, {4})
        temp = alone.memory_analysis().temp_size_in_bytes
        rows_out.append(f"| {rows} | {kept / hidden:.2f} | {peak / hidden:.2f} | "
                        f"{temp / hidden:.2f} | {(kept + temp) / hidden:.2f} |")
    return ["| rows | kept | forward peak, kept held | forward alone, temp | "
            "kept + forward alone's temp |", "|---|---|---|---|---|", *rows_out]


def fact_checkpoint_keeps_narrow_dots() -> list[str]:
    """Layers `h + silu(h @ W1) @ W2` with bfloat16 dots on float32 activations and
    weights, each checkpointed under `dots_saveable`: what one layer's checkpoint keeps
    across XLA's optimization barrier (hlo.kept_bytes of its forward+backward), and what
    one more layer adds to the temp of the whole gradient (8 layers against 4), against
    the bytes of the bfloat16 dot output JAX names and of its float32 width."""
    rows_out = []
    d, f = 128, 512
    for rows in (1024, 4096):
        def layer(h, w1, w2):
            a = jnp.dot(h.astype(jnp.bfloat16), w1.astype(jnp.bfloat16))
            return h + jnp.dot(jax.nn.silu(a), w2.astype(jnp.bfloat16)).astype(jnp.float32)

        ck = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)
        x = jax.ShapeDtypeStruct((rows, d), jnp.float32)
        w1 = jax.ShapeDtypeStruct((d, f), jnp.float32)
        w2 = jax.ShapeDtypeStruct((f, d), jnp.float32)

        def fwd_bwd(x, w1, w2, ct):
            return jax.vjp(ck, x, w1, w2)[1](ct)

        text = _compile(fwd_bwd, x, w1, w2, x, options=REMAT_OPTION).as_text()
        kept = hlo.kept_bytes(text, {0}, {3}) - rows * d * 4  # less the layer's input

        def temp(n):
            def loss(ws, h):
                for a, b in ws:
                    h = ck(h, a, b)
                return jnp.sum(h * h)
            ws = [(w1, w2)] * n
            return _compile(jax.grad(loss), ws, x, options=REMAT_OPTION).memory_analysis().temp_size_in_bytes

        per_layer = (temp(8) - temp(4)) // 4 - rows * d * 4
        rows_out.append(f"| {rows} | {rows * f * 2:,} | {rows * f * 4:,} | {kept:,} | {per_layer:,} |")
    return ["| rows | dot output, bfloat16 | at float32 width | kept across the barrier, one "
            "layer | one more layer in the whole gradient |", "|---|---|---|---|---|", *rows_out]


def fact_stored_conv_input_recomputed() -> list[str]:
    """Residual blocks `relu(norm(conv(relu(norm(conv(x, W1))), W2)) + x)` (norm: a batch
    normalisation's centring and scaling, no weights), with 3 x 3 convolutions and, for
    comparison, the same blocks with the convolutions written as dots over the channels:
    what one block compiled alone (forward and backward) keeps for its backward, its
    input counted (hlo.kept_bytes), against what one more block adds to the temp of the
    whole gradient without remat (8 blocks against 4), in block inputs' bytes."""
    rows_out = []

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def norm(z):
        s = z - jnp.mean(z, axis=(0, 1, 2))
        return s * jax.lax.rsqrt(jnp.mean(s * s, axis=(0, 1, 2)) + 1e-5)

    def conv_block(x, w1, w2):
        return jax.nn.relu(norm(conv(jax.nn.relu(norm(conv(x, w1))), w2)) + x)

    def dot_block(x, w1, w2):
        return jax.nn.relu(norm(jax.nn.relu(norm(x @ w1)) @ w2) + x)

    for images, side, c in ((4, 32, 16), (8, 32, 32)):
        x = jax.ShapeDtypeStruct((images, side, side, c), jnp.float32)
        act = images * side * side * c * 4
        for name, block, wshape in (("3 x 3 convolutions", conv_block, (3, 3, c, c)),
                                    ("dots", dot_block, (c, c))):
            w = jax.ShapeDtypeStruct(wshape, jnp.float32)

            def fwd_bwd(x, w1, w2, ct, block=block):
                return jax.vjp(block, x, w1, w2)[1](ct)

            text = _compile(fwd_bwd, x, w, w, x, options=REMAT_OPTION).as_text()
            kept = hlo.kept_bytes(text, {0}, {3})

            def temp(n, block=block, w=w):
                def loss(ws, h):
                    for w1, w2 in ws:
                        h = block(h, w1, w2)
                    return jnp.sum(h * h)
                return _compile(jax.grad(loss), [(w, w)] * n, x,
                                options=REMAT_OPTION).memory_analysis().temp_size_in_bytes

            per_block = (temp(8) - temp(4)) / 4
            rows_out.append(f"| {images} x {side} x {side} x {c} | {name} | {kept / act:.3f} | "
                            f"{per_block / act:.3f} |")
    return ["| block input | block | kept by one block compiled alone | one more block in "
            "the whole gradient |", "|---|---|---|---|", *rows_out]


def main() -> None:
    print(f"jax {jax.__version__}, backend {jax.default_backend()}\n")
    for title, fact in (("1. The CPU compiler option", fact_cpu_option),
                        ("2. One checkpoint around everything", fact_one_checkpoint),
                        ("3. Gradient lifetimes in a donated optax step",
                         fact_gradient_lifetimes),
                        ("4. A scan iteration of g layers holds its parameter cotangent",
                         fact_mixed_scan_iterations),
                        ("5. prevent_cse inside a scan changes XLA's buffer assignment",
                         fact_prevent_cse_in_scan),
                        ("6. Parameter copies live in donated parameter buffers",
                         fact_parameter_copies),
                        ("8. Dropout's random bits are generated ahead in the forward",
                         fact_dropout_bits_early),
                        ("9. Max pooling's gradient indices are made at the start of the step",
                         fact_pooling_indices_early),
                        ("10. A stage's boundaries are not all live at its backward's peak",
                         fact_boundaries_not_all_live),
                        ("11. A mask passed into every checkpointed block is held once",
                         fact_mask_held_once),
                        ("12. An embedding table's gradient is made at the start of the step",
                         fact_table_gradient_zeros),
                        ("13. A returned loss is computed after its head's backward",
                         fact_returned_loss_held),
                        ("15. A max pooling's gradient is scattered into zeros made at the start",
                         fact_pooling_zeros_early),
                        ("16. A stored stage's forward holds what it keeps with its workspace",
                         fact_stored_forward_overlaps),
                        ("17. A checkpoint keeps a bfloat16 dot's output at bfloat16 width",
                         fact_checkpoint_keeps_narrow_dots),
                        ("18. A stored convolution block's input is recomputed, not held",
                         fact_stored_conv_input_recomputed)):
        print(f"## {title}\n")
        print("\n".join(fact()) + "\n", flush=True)


if __name__ == "__main__":
    main()
