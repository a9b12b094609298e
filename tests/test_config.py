"""Config validation: every bad value is refused with a message naming it."""

import math

import pytest

from shared.config import Config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0}, "world_size must be a positive integer"),
        ({"layers": -1}, "layers must be a positive integer"),
        ({"dim": 2.5}, "dim must be a positive integer"),
        ({"batch": True}, "batch must be a positive integer"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"dtype": "float8"}, "dtype must be one of float32, float64, bfloat16, float16, got 'float8'"),
        ({"dtype": "float16"}, "float16 trains only under --precision mixed"),
        ({"lr": 0.0}, "lr must be a finite number > 0"),
        ({"precision": "half"}, "precision must be one of pure, mixed, got 'half'"),
        ({"precision": "mixed"}, "16-bit dtype: give --dtype bfloat16 or float16 (got float64"),
        ({"precision": "mixed", "dtype": "float32"}, "precision mixed computes in a 16-bit dtype"),
        ({"beta2": 1.0}, "beta2 must be in [0, 1)"),
        ({"eps": 0.0}, "eps must be a finite number > 0"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
        ({"weight_decay": float("nan")}, "weight_decay must be a finite number >= 0"),
        ({"lr": float("nan")}, "lr must be a finite number > 0"),
        ({"lr": float("inf")}, "lr must be a finite number > 0"),  # held-out: --lr inf trained and FAILed
        ({"weight_decay": float("inf")}, "weight_decay must be a finite number >= 0"),
        ({"seed": -1}, "seed must be a non-negative integer, got -1"),
        ({"bucket_mb": 0}, "bucket_mb must be > 0"),
        ({"model": "gpt"}, "model must be one of mlp, transformer, got 'gpt'"),
        ({"heads": 0}, "heads must be a positive integer"),
        ({"vocab": 1.5}, "vocab must be a positive integer"),
        ({"model": "transformer", "dim": 10, "heads": 4}, "transformer: dim=10 is not divisible by heads=4"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Config(**kwargs)


@pytest.mark.parametrize(
    "kwargs, pattern, message",
    [
        ({"world_size": 3, "batch": 16}, "dp", "dp: batch=16 is not divisible by world_size=3"),
        ({"world_size": 3, "dim": 16, "batch": 12}, "fsdp", "fsdp: dim=16 is not divisible by world_size=3"),
        ({"world_size": 4, "dim": 18}, "tp", "tp: dim=18 is not divisible by world_size=4"),
        ({"world_size": 3, "layers": 4}, "pp", "pp: layers=4 is not divisible by world_size=3"),
        ({"world_size": 2, "layers": 4, "batch": 10, "microbatches": 4}, "pp",
         "pp: batch=10 is not divisible by microbatches=4"),
        ({}, "moe", "unknown pattern 'moe'"),
        ({"model": "transformer", "world_size": 4, "heads": 2, "dim": 16}, "tp",
         r"tp \(transformer\): heads=2 is not divisible by world_size=4"),
        ({"model": "transformer", "world_size": 4, "heads": 4, "dim": 16, "vocab": 30}, "tp",
         r"tp \(transformer\): vocab=30 is not divisible by world_size=4"),
        ({"model": "transformer", "world_size": 3, "batch": 16}, "dp",
         r"dp \(transformer\): batch=16 is not divisible by world_size=3"),
        ({"model": "transformer", "world_size": 3, "layers": 4}, "pp",
         r"pp \(transformer\): layers=4 is not divisible by world_size=3"),
    ],
)
def test_pattern_checks(kwargs, pattern, message):
    with pytest.raises(ValueError, match=message):
        Config(**kwargs).check(pattern)


def test_valid_config_passes_every_pattern():
    cfg = Config()
    for pattern in ("collectives", "dp", "fsdp", "tp", "pp"):
        assert cfg.check(pattern) is cfg
    assert cfg.n_params == cfg.layers * cfg.dim**2


def test_transformer_n_params_counts_every_parameter():
    from shared.problem import param_shapes

    cfg = Config(model="transformer", layers=3, dim=12, heads=3, seq=7, vocab=20)
    assert cfg.n_params == sum(math.prod(s) for s in param_shapes(cfg).values())
    assert cfg.head_dim == 4


def test_frozen():
    with pytest.raises(AttributeError):
        Config().dim = 8  # type: ignore[misc]


@pytest.mark.parametrize("pattern", ["ep"])
def test_mixed_precision_is_refused_where_not_built(pattern):
    """Per framework (shared.config.MIXED_PATTERNS): both build bf16 under dp, fsdp, tp, pp, cp, ep and the
    mesh; float16 (FLOAT16_PATTERNS) not under ep (one line, naming the framework when the check has one)."""
    cfg = Config(model="transformer", world_size=2, heads=2, dim=8, seq=4, vocab=8, batch=4, layers=2,
                 dtype="bfloat16", precision="mixed")
    for built in ("tp", "pp", "cp"):
        assert cfg.check(built) is cfg.check(built, "torch") is cfg.check(built, "jax") is cfg
    moe = cfg.replace(experts=2)
    assert moe.check(pattern) is moe.check(pattern, "torch") is moe.check(pattern, "jax") is moe
    odd = moe.replace(dtype="float16")
    for fw in (None, "torch", "jax"):
        where = f" in {fw}" if fw else ""
        with pytest.raises(ValueError, match=f"{pattern}: --precision mixed --dtype float16 is built{where} for dp, "
                                             f"fsdp, .* only \\(ep's loss scaling .* is not built\\); use --dtype "
                                             f"bfloat16 for {pattern}"):
            odd.check(pattern, fw)


def test_mixed_precision_stores_float32_and_reduces_in_it():
    cfg = Config(dtype="bfloat16", precision="mixed")
    assert (cfg.param_dtype, cfg.bytes_per_element, cfg.compute_bytes) == ("float32", 4, 2)
    pure = Config(dtype="bfloat16")
    assert (pure.param_dtype, pure.bytes_per_element, pure.compute_bytes) == ("bfloat16", 2, 2)
    assert cfg.check("dp") is cfg and cfg.check("fsdp") is cfg
