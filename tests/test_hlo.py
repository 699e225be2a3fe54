"""hlo.kept_bytes: what XLA keeps from a forward for its backward, read from optimized HLO
text (docs/jax-facts.md, fact 7). A hand-written entry computation pins the reading rules;
a compiled stage pins it against XLA's own output."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from remat_planner import hlo
from remat_planner.memory import measure_compiler_options, vjp_wrt

# x (an activation), w (a weight), ct (the cotangent). The forward's dot and the tuple
# fusion are read by the backward; the constant, the weight, the fused elementwise
# value read only in the forward and the zeros made from a constant alone are not kept.
TEXT = """HloModule m

%fused (p: f32[4,8]) -> f32[4,8] {
  ROOT %p = f32[4,8]{1,0} parameter(0)
}

ENTRY %main (x: f32[4,8], w: f32[8,8], ct: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %ct = f32[4,8]{1,0} parameter(2)
  %c = f32[] constant(2)
  %zeros = f32[4,8]{1,0} broadcast(%c), dimensions={}
  %dot = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %pair = (f32[4,8]{1,0}, f32[4]{0}) fusion(%dot), kind=kLoop, calls=%fused
  %first = f32[4,8]{1,0} get-tuple-element(%pair), index=0
  %second = f32[4]{0} get-tuple-element(%pair), index=1
  %unused = f32[4,8]{1,0} fusion(%dot), kind=kLoop, calls=%fused
  %flat = f32[32]{0} bitcast(%first)
  %g = f32[4,8]{1,0} fusion(%ct, %flat, %second, %c, %w, %zeros), kind=kLoop, calls=%fused
  ROOT %dx = f32[4,8]{1,0} dot(%g, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}
"""


def test_array_bytes():
    assert hlo.array_bytes("f32[4,64,128]{2,1,0}") == 4 * 64 * 128 * 4
    assert hlo.array_bytes("bf16[3]{0}") == 6
    assert hlo.array_bytes("u32[2,2]") == 16
    assert hlo.array_bytes("f32[]") == 4
    assert hlo.array_bytes("(f32[4], f32[4])") == 0


def test_reading_rules_on_a_hand_written_entry():
    # the tuple's two elements (through a bitcast and a get-tuple-element), and x, an
    # activation read by the backward's dot; not the weight, the constant, the zeros
    # broadcast from it, the unused fusion nor the dot itself (read only through the tuple)
    assert hlo.kept_bytes(TEXT, activation_params={0}, cotangent_params={2}) \
        == 4 * 8 * 4 + 4 * 4 + 4 * 8 * 4
    # x as a weight-like input (the batch): live anyway, not counted
    assert hlo.kept_bytes(TEXT, activation_params=set(), cotangent_params={2}) \
        == 4 * 8 * 4 + 4 * 4


def test_a_compiled_layer_keeps_its_matmul_output_not_the_tanh():
    """tanh(x @ w) compiled with its backward: XLA keeps the matmul's output (recomputing
    the tanh inside the backward's fusion) and the input x, which the weight's gradient
    reads. JAX's residual list has the tanh and its derivative besides x."""
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    f = lambda x, w: [jnp.tanh(x @ w)]  # noqa: E731
    both = jax.jit(lambda a, ct: vjp_wrt(f, a, (0, 1))[1](ct), keep_unused=True)
    text = both.lower([x, w], [x]).compile(measure_compiler_options()).as_text()
    act = 16 * 32 * 4
    assert hlo.kept_bytes(text, activation_params={0}, cotangent_params={2}) == 2 * act
    assert hlo.kept_bytes(text, activation_params=set(), cotangent_params={2}) == act



def test_a_compiled_checkpoint_keeps_what_its_policy_names_at_its_own_width():
    """A checkpoint's residuals reach its backward through one optimization barrier over
    a tuple (with the cotangent in it): read element by element, XLA keeps the named dot
    output and the input. A bfloat16 dot, which XLA:CPU runs in float32, is kept at
    bfloat16 width across the barrier (docs/jax-facts.md, fact 17); the float32 one at
    its own. Before the tuple was read, the kept bytes of a checkpoint read as 0."""
    def layer(x, w1, w2):
        a = jnp.dot(x.astype(w1.dtype), w1)
        return jnp.dot(jax.nn.silu(a), w2).astype(jnp.float32)

    f = jax.checkpoint(lambda x, w1, w2: [layer(x, w1, w2)],
                       policy=jax.checkpoint_policies.dots_saveable)
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
        w1 = jax.ShapeDtypeStruct((32, 128), dtype)
        w2 = jax.ShapeDtypeStruct((128, 32), dtype)
        both = jax.jit(lambda a, ct: vjp_wrt(f, a, (0, 1, 2))[1](ct), keep_unused=True)
        text = both.lower([x, w1, w2], [x]).compile(measure_compiler_options()).as_text()
        assert "opt-barrier" in text
        kept = hlo.kept_bytes(text, activation_params={0}, cotangent_params={3})
        assert kept == 64 * 32 * 4 + 64 * 128 * jnp.dtype(dtype).itemsize, (dtype, kept)

def test_a_compiled_embedding_keeps_nothing_of_its_scatter_s_zeros():
    """An embedding lookup's backward scatter-adds into zeros that XLA broadcasts from a
    constant and, compiled with the forward, reads from outside the backward: they are
    not kept from the forward (measured: the corpus plain-JAX transformer's embedding
    stage, 65,920 B counted with them, 384 B without; its loss head's zeros, 98,304 B).
    What is counted is what the token ids become (an s32 index column, from the batch)."""
    table = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    ids = jax.ShapeDtypeStruct((2, 48), jnp.int32)
    f = lambda table, ids: [jnp.take(table, ids, axis=0)]  # noqa: E731
    both = jax.jit(lambda a, ct: vjp_wrt(f, a, (0,))[1](ct), keep_unused=True)
    ct = jax.ShapeDtypeStruct((2, 48, 64), jnp.float32)
    text = both.lower([table, ids], [ct]).compile(measure_compiler_options()).as_text()
    assert hlo.kept_bytes(text, activation_params=set(), cotangent_params={2}) < 256 * 64 * 4


# x (an activation), w (a weight), ct (the cotangent): the backward of y = x @ w read
# with ct; dw is the weight's gradient, dx the input's. A = 4 x 8 x 4 bytes.
LIVE = """HloModule m

ENTRY %main (x: f32[4,8], w: f32[8,16], ct: f32[4,16]) -> (f32[8,16], f32[4,8]) {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,16]{1,0} parameter(1)
  %ct = f32[4,16]{1,0} parameter(2)
  %c = f32[] constant(2)
  %y = f32[4,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %g = f32[4,16]{1,0} multiply(%ct, %y)
  %flat = f32[64]{0} bitcast(%g)
  %dw = f32[8,16]{1,0} dot(%x, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %dx = f32[4,8]{1,0} dot(%flat, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %out = (f32[8,16]{1,0}, f32[4,8]{1,0}) tuple(%dw, %dx)
}
"""


def test_live_peak_follows_the_schedule():
    """Each buffer is live from the instruction that makes it (a parameter: the start) to
    its last reader (through a bitcast), an output to the end; the instruction that reads
    the last of some and makes another counts them all. Constants never count, the
    weight (not counted) nor its gradient (an uncounted output) here."""
    a = 4 * 8 * 4
    # at %g: x (A), ct (2A), y (2A), g (2A); ct and y die there, x at %dw
    assert hlo.live_peak_bytes(LIVE, counted_params={0, 2}, uncounted_outputs={0}) == 7 * a
    # without the parameters: y and g at %g (4A); where the gradient counts, at %dx:
    # g (2A, read there through its bitcast), dx (A) and dw (4A, an output: to the end)
    assert hlo.live_peak_bytes(LIVE, counted_params=set(), uncounted_outputs={0}) == 4 * a
    assert hlo.live_peak_bytes(LIVE, counted_params=set(), uncounted_outputs=set()) == 7 * a


def test_a_compiled_head_does_not_hold_its_input_in_its_backward():
    """The backward of a sum broadcasts the cotangent and never reads the input: compiled,
    the most live at once is the scalar cotangent and the input's gradient, not the input
    too (the sum of XLA's temp and the three boundaries, as the model counted before,
    is one activation more)."""
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    f = lambda x: [jnp.sum(x)]  # noqa: E731
    both = jax.jit(lambda a, ct: vjp_wrt(f, a, (0,))[1](ct), keep_unused=True)
    compiled = both.lower([x], [jax.ShapeDtypeStruct((), jnp.float32)]).compile(
        measure_compiler_options())
    act = 16 * 32 * 4
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    assert hlo.live_peak_bytes(compiled.as_text(), counted_params={0, 1},
                               uncounted_outputs=set()) == act + 4


# x (an activation), w (a weight), ct (the cotangent). The forward: h = x @ w, read by
# the backward (kept); t = tanh(h), read only by the forward's y = t @ w. The backward
# reads h and ct. A = 4 x 8 x 4 bytes.
FORWARD = """HloModule m

ENTRY %main (x: f32[4,8], w: f32[8,8], ct: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %ct = f32[4,8]{1,0} parameter(2)
  %h = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %t = f32[4,8]{1,0} tanh(%h)
  %y = f32[4,8]{1,0} dot(%t, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %g = f32[4,8]{1,0} multiply(%ct, %h)
  ROOT %dx = f32[4,8]{1,0} dot(%g, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""


def test_forward_peak_holds_what_is_kept():
    """In the forward (the instructions not depending on ct), x lives to its last reader
    h; h, kept for the backward, to the forward's end; t to y. At y: h, t and y (3A),
    where kept_bytes is h alone (A). Without x counted as an activation, the same."""
    a = 4 * 8 * 4
    assert hlo.kept_bytes(FORWARD, activation_params={0}, cotangent_params={2}) == a
    assert hlo.forward_peak_bytes(FORWARD, activation_params={0}, cotangent_params={2}) == 3 * a
    assert hlo.forward_peak_bytes(FORWARD, activation_params=set(), cotangent_params={2}) == 3 * a


def test_a_compiled_stored_forward_is_less_than_its_temp_beside_what_it_keeps():
    """tanh(tanh(x @ w1) @ w3) @ w2 compiled with its backward keeps x and both tanhs
    (the matmuls' outputs are read only by the tanhs, each made in place). Its forward
    holds at most x, the first tanh, the second matmul's output and the second tanh at
    once. The forward compiled alone has two wide values in temp, one of them a tanh
    kept for the backward: the memory model once added that temp to what is kept,
    counting a kept value twice (docs/jax-facts.md, fact 16)."""
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w1 = jax.ShapeDtypeStruct((32, 256), jnp.float32)
    w3 = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    w2 = jax.ShapeDtypeStruct((256, 32), jnp.float32)
    f = lambda x, w1, w3, w2: [jnp.tanh(jnp.tanh(x @ w1) @ w3) @ w2]  # noqa: E731
    both = jax.jit(lambda a, ct: vjp_wrt(f, a, (0, 1, 2, 3))[1](ct), keep_unused=True)
    text = both.lower([x, w1, w3, w2], [x]).compile(measure_compiler_options()).as_text()
    alone = jax.jit(f).lower(x, w1, w3, w2).compile(measure_compiler_options())
    act, wide = 64 * 32 * 4, 64 * 256 * 4
    kept = hlo.kept_bytes(text, activation_params={0}, cotangent_params={4})
    peak = hlo.forward_peak_bytes(text, activation_params={0}, cotangent_params={4})
    assert kept == act + 2 * wide
    assert peak == act + 3 * wide
    assert alone.memory_analysis().temp_size_in_bytes + kept == peak + wide
