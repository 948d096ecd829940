"""Run configs: YAML + dotted overrides, unknown keys and wrong types are errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from specheads.training.config import RunConfig, load_run_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "train"


def test_shipped_configs_load():
    """Every run config shipped under configs/train/ passes the schema (keys and types)."""
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert {"eagle_stories260k.yaml", "medusa_stories260k.yaml", "eagle_smollm2.yaml", "medusa_smollm2.yaml"} <= set(names)
    for name in names:
        config = load_run_config(CONFIGS / name)
        assert isinstance(config, RunConfig)
        assert config.global_batch_size % config.micro_batch_size == 0


def test_overrides_are_yaml_scalars():
    config = load_run_config(CONFIGS / "eagle_stories260k.yaml",
                             ["max_steps=7", "optim.learning_rate=1e-4", "trackers=[]", "stop_after_steps=null",
                              "head.options.tree_depth=4"])
    assert config.max_steps == 7
    assert config.optim.learning_rate == pytest.approx(1e-4)
    assert config.trackers == []
    assert config.stop_after_steps is None
    assert config.head.options == {"tree_depth": 4}


def test_unknown_key_names_key_and_valid_ones():
    with pytest.raises(ValueError, match=r"'optim\.learning_rat'.*learning_rate"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["optim.learning_rat=1e-3"])
    with pytest.raises(ValueError, match="'max_step'.*max_steps"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["max_step=3"])


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ValueError, match=r"'max_steps'.*'ten'.*int"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["max_steps=ten"])
    with pytest.raises(ValueError, match=r"'optim\.betas'"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["optim.betas=0.9"])
    with pytest.raises(ValueError, match="'data.bucket_by_length'"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["data.bucket_by_length=3"])


def test_bad_choices_and_sizes():
    with pytest.raises(ValueError, match="feature_mode='sometimes'"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["feature_mode=sometimes"])
    config = load_run_config(CONFIGS / "eagle_stories260k.yaml", ["global_batch_size=32", "micro_batch_size=16"])
    assert config.gradient_accumulation_steps(1) == 2
    assert config.gradient_accumulation_steps(2) == 1
    with pytest.raises(ValueError, match="not divisible"):
        config.gradient_accumulation_steps(3)
    with pytest.raises(ValueError, match="override 'max_steps'"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["max_steps"])


def test_argmax_label_weight_is_a_weight_on_the_target_labels():
    config = load_run_config(CONFIGS / "eagle_stories260k.yaml", ["loss.argmax_label_weight=0.5"])
    assert config.loss.argmax_label_weight == 0.5
    with pytest.raises(ValueError, match=r"loss\.argmax_label_weight=1\.5.*\[0, 1\]"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["loss.argmax_label_weight=1.5"])
    with pytest.raises(ValueError, match="needs loss.labels='target', got 'tokens'"):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", ["loss.argmax_label_weight=0.5", "loss.labels=tokens"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trackers=[tensorboard, mlflow]"], r"trackers contains 'mlflow'; expected 'tensorboard' and/or 'wandb'"),
        (["save_steps=0"], r"save_steps=0 is invalid; expected a positive integer"),
        (["data.max_length=-5"], r"data\.max_length=-5 is invalid; expected a positive integer"),
        (["eval_steps=-1"], r"eval_steps=-1 is invalid; expected steps >= 0"),
        (["early_stopping_patience=-1"], r"early_stopping_patience=-1 is invalid; expected evaluations >= 0"),
        (["early_stopping_patience=2"], r"needs eval_steps > 0 \(got 0\) and save_best=true"),
        (["early_stopping_patience=2", "eval_steps=5"], r"needs held-out data to evaluate: set data.eval_fraction"),
        (["data.eval_fraction=1.0"], r"data\.eval_fraction=1\.0 is invalid; expected a fraction in \[0, 1\)"),
        (["data.eval_fraction=0.1", "data.eval_source=held_out.jsonl"], r"both set; hold out a fraction OR name a file"),
        (["time_limit_minutes=0"], r"time_limit_minutes=0\.0 is invalid; expected minutes > 0"),
        (["global_batch_size=4", "micro_batch_size=8"], r"micro_batch_size=8 is larger than global_batch_size=4"),
        (["feature_mode=offline", "data.features_dir=null"], r"feature_mode=offline needs data\.features_dir"),
        (["data.source="], r"data\.source is empty"),
        (["joint.enabled=true"], r"joint\.enabled=true \(Medusa-2\) trains Medusa heads; head\.type='eagle'"),
        (["init_heads=[a, b]"], r"config key 'init_heads': value \['a', 'b'\] has type list; expected"),
        (["optim=3"], r"config section 'optim' must be a mapping, got 3"),
        (["max_steps.inner=3"], r"override 'max_steps\.inner=3': 'max_steps' is not a section"),
        (["trackers=tensorboard"], r"config key 'trackers': value 'tensorboard' has type str; expected list"),
    ],
)
def test_each_invalid_value_is_named_with_what_was_expected(overrides, message):
    """Every check of `RunConfig.validate` and of the schema raises a ValueError naming the value (no stack trace
    from deep inside training)."""
    with pytest.raises(ValueError, match=message):
        load_run_config(CONFIGS / "eagle_stories260k.yaml", overrides)


def test_a_missing_or_non_mapping_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="run config '.*nope.yaml' does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- max_steps: 3\n")
    with pytest.raises(ValueError, match="run config '.*list.yaml' must be a YAML mapping, got list"):
        load_run_config(listing)
