"""Config loading, one-line config errors, and the GPT-2 workloads they build."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from remat_planner.config import RunConfig, build_workload, load_config, make_optimizer
from remat_planner.errors import ConfigError
from remat_planner.models import Workload, get_builder, known_model_types

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = CONFIGS / "gpt2-tiny.yaml"
SMALL = CONFIGS / "gpt2-small.yaml"


@pytest.fixture(scope="module")
def tiny() -> Workload:
    return build_workload(load_config(TINY))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def _config_error(path: Path | str, **overrides: object) -> str:
    with pytest.raises(ConfigError) as info:
        cfg = load_config(path, **overrides)  # type: ignore[arg-type]
        build_workload(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert info.value.exit_code == 2
    return message


VALID = """\
type: gpt2
model: {vocab_size: 64, n_layer: 1, n_head: 2, d_model: 16, max_seq_len: 32}
batch_size: 2
seq_len: 8
"""


def test_registry_knows_gpt2() -> None:
    assert "gpt2" in known_model_types()
    with pytest.raises(ConfigError, match=r"unknown model type 'nope'; known types: (\w+, )*gpt2"):
        get_builder("nope")


def test_small_config_is_gpt2_124m() -> None:
    cfg = load_config(SMALL)
    assert (cfg.batch_size, cfg.seq_len, cfg.optimizer.name) == (8, 1024, "adamw")
    workload = build_workload(cfg)
    assert workload.param_count == 124_439_808
    assert workload.abstract_batch == (jax.ShapeDtypeStruct((8, 1025), jnp.int32),)
    assert workload.abstract_params["wte"]["embedding"].shape == (50257, 768)
    assert workload.info["n_layer"] == 12


def test_tiny_workload_is_abstract(tiny: Workload) -> None:
    leaves = jax.tree.leaves(tiny.abstract_params)
    assert leaves and all(type(leaf) is jax.ShapeDtypeStruct for leaf in leaves)
    assert tiny.abstract_batch == (jax.ShapeDtypeStruct((4, 65), jnp.int32),)
    assert tiny.param_count == sum(math.prod(leaf.shape) for leaf in leaves)
    assert tiny.info | {"vocab_size": 512, "d_model": 128, "seq_len": 64} == tiny.info


def test_tiny_loss_is_near_uniform(tiny: Workload) -> None:
    params = tiny.init_params(jax.random.key(0))
    batch = tiny.synthetic_batch(jax.random.key(1))
    assert jax.tree.structure(params) == jax.tree.structure(tiny.abstract_params)
    assert [b.shape for b in batch] == [s.shape for s in tiny.abstract_batch]
    loss = jax.jit(tiny.loss_fn)(params, *batch)
    assert loss.shape == ()
    assert math.isfinite(float(loss))
    # Freshly initialised logits are small, so the loss sits near uniform cross-entropy.
    assert abs(float(loss) - math.log(512)) < 1.0


def test_overrides_and_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, VALID), batch_size=3, seq_len=4)
    assert (cfg.batch_size, cfg.seq_len, cfg.seed) == (3, 4, 0)
    assert cfg.model["dtype"] == "float32"  # settings defaults are filled in
    assert cfg.optimizer.learning_rate == 3e-4
    assert build_workload(cfg).abstract_batch[0].shape == (3, 5)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_make_optimizer(name: str, tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, VALID + f"optimizer: {{name: {name}}}\n"))
    optimizer = make_optimizer(cfg.optimizer)
    state = optimizer.init({"w": jnp.ones(3)})
    updates, _ = optimizer.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3)})
    assert updates["w"].shape == (3,)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("type: gpt2\nmodel: [\n", "bad.yaml: invalid YAML at line"),
        ("- 1\n- 2\n", "bad.yaml: expected a mapping at top level"),
        ("", "bad.yaml: expected a mapping at top level, got an empty file"),
        (VALID + "batchsize: 3\n", "bad.yaml: unknown field 'batchsize' (known: type, model, batch_size"),
        (VALID.replace("n_layer: 1", "n_layers: 1"), "unknown field 'model.n_layers' (known: vocab_size, n_layer"),
        (VALID + "optimizer: {lr: 1}\n", "unknown field 'optimizer.lr' (known: name, learning_rate"),
        (VALID.replace("type: gpt2", "type: gpt3"), "field 'type': unknown model type 'gpt3'; known types: bert, gpt2"),
        (VALID.replace("batch_size: 2", "batch_size: two"), "field 'batch_size': Input should be a valid integer"),
        (VALID.replace("batch_size: 2", "batch_size: 0"), "field 'batch_size': Input should be greater than 0"),
        (VALID.replace("n_layer: 1", "n_layer: 0"), "field 'model.n_layer': Input should be greater than 0"),
        (VALID.replace("n_head: 2", "n_head: 3"), "field 'model': d_model (16) must be divisible by n_head (3)"),
        (VALID.replace("}", ", dtype: float16}"), "field 'model.dtype': Input should be 'float32' or 'bfloat16'"),
        (VALID.replace("seq_len: 8", "seq_len: 33"), "field 'seq_len': 33 exceeds model.max_seq_len 32"),
        (VALID + "optimizer: {name: lion}\n", "field 'optimizer.name'"),
        (VALID.replace("seq_len: 8\n", ""), "missing required field 'seq_len'"),
    ],
)
def test_bad_config_is_one_line(tmp_path: Path, text: str, expected: str) -> None:
    message = _config_error(_write(tmp_path, text))
    assert expected in message
    assert message.startswith(str(tmp_path / "bad.yaml"))


def test_bad_override_names_field(tmp_path: Path) -> None:
    assert "field 'batch_size': Input should be greater than 0" in _config_error(_write(tmp_path, VALID), batch_size=0)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "x.yaml"
    assert _config_error(missing) == f"no such config file '{missing}'"


def test_run_config_rejects_unknown_type_directly() -> None:
    with pytest.raises(ValueError, match="unknown model type"):
        RunConfig(type="nope", batch_size=1, seq_len=1)
