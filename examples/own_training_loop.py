"""Plan your own Flax model and use the plan in your own training loop.

    python examples/own_training_loop.py

A small residual MLP of our own (not one of the shipped configs), an optax optimizer,
a budget between the smallest feasible step and the step without remat; plan on
abstract shapes, then train with real arrays.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import remat_planner as rp


class ResidualBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * self.width, name="up")(nn.LayerNorm(name="norm")(x))
        return x + nn.Dense(self.width, name="down")(nn.gelu(h))


class ResidualMLP(nn.Module):
    width: int = 256
    depth: int = 6
    # block index -> jax.checkpoint policy: block i becomes nn.remat(ResidualBlock, policy)
    remat_policies: tuple = ()

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width, name="embed")(x)
        policies = dict(self.remat_policies)
        for i in range(self.depth):
            block = ResidualBlock
            if i in policies:
                block = nn.remat(ResidualBlock, policy=policies[i])
            x = block(self.width, name=f"block_{i}")(x)
        return nn.Dense(1, name="head")(nn.LayerNorm(name="final_norm")(x))


def main(steps: int = 5) -> dict:
    model = ResidualMLP()

    def loss_fn(params, x, y):
        return jnp.mean((model.apply({"params": params}, x)[..., 0] - y) ** 2)

    x_shape = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    y_shape = jax.ShapeDtypeStruct((512,), jnp.float32)
    params_shape = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"])
    optimizer = optax.adamw(1e-4)

    # 1. Plan on abstract shapes: nothing is allocated.
    analysis = rp.analyze(loss_fn, params_shape, (x_shape, y_shape), optimizer)
    low, high = analysis.min_feasible_budget(), analysis.noremat.peak_bytes
    budget = (low + high) // 2
    plan = rp.plan(loss_fn, params_shape, (x_shape, y_shape), budget, optimizer,
                   analysis=analysis)
    print(f"budget {budget:,} B: XLA peak {plan.measured_peak_bytes:,} B "
          f"(no remat {high:,} B), recompute {100 * plan.recompute_overhead:.1f}%")

    # 2. Train with real arrays in your own loop; the step is jitted with the plan.
    key = jax.random.key(1)
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    opt_state = optimizer.init(params)
    step = rp.train_step(loss_fn, optimizer, plan)
    x = jax.random.normal(key, x_shape.shape)
    y = jnp.sin(x.sum(axis=1))
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, (x, y))
        losses.append(float(loss))
    print("losses:", ", ".join(f"{v:.4f}" for v in losses))

    # 3. Or write it in your model's source: which modules to wrap in nn.remat (none
    #    inside another, in program order), each with a policy: a predicate on primitive
    #    and shapes, so nothing inside the modules is tagged. The code to paste:
    exported = plan.to_flax(analysis, loss_fn, params_shape, (x_shape, y_shape))
    print(exported.to_python(), end="")
    # 4. Applied by hand: block i becomes nn.remat(ResidualBlock, policy=...), compiled.
    policies = tuple((i, exported.policy_for(f"block_{i}")) for i in range(model.depth)
                     if exported.policy_for(f"block_{i}") is not None)
    by_hand = ResidualMLP(remat_policies=policies)

    def hand_loss(params, x, y):
        return jnp.mean((by_hand.apply({"params": params}, x)[..., 0] - y) ** 2)

    m = rp.measure(hand_loss, params_shape, (x_shape, y_shape), optimizer)
    print(f"by hand: XLA peak {m.peak_bytes:,} B, {m.flops:,.0f} FLOPs "
          f"(replayed plan: {plan.measured_peak_bytes:,} B, {plan.measured_flops:,.0f} FLOPs)")
    # plan.as_flax_names(analysis), the per-segment description of the plan (module lists
    # that may overlap, keep rules as checkpoint names), is returned but not printed: the
    # exported form above is what to write.
    return {"plan": plan, "losses": losses, "budget": budget,
            "flax_names": plan.as_flax_names(analysis), "exported": exported, "by_hand": m}


if __name__ == "__main__":
    main()
