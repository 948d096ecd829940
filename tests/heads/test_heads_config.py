"""`HeadsConfig`: defaults, validation errors that name the field, help for every field, round trips."""

from __future__ import annotations

import inspect
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specheads
from specheads.heads import FIELD_HELP, HEAD_TYPES, HeadsConfig
from specheads.heads.config import FORMAT_VERSION

POSITIVE_INT_FIELDS = (
    "hidden_size",
    "vocab_size",
    "num_heads",
    "num_layers",
    "tree_depth",
    "tree_top_k",
    "tree_num_nodes",
)
EAGLE_LAYER = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}


def test_defaults_are_valid():
    """`HeadsConfig()` is valid and records the current format and specheads versions."""
    config = HeadsConfig()
    assert config.head_type in HEAD_TYPES
    assert config.format_version == FORMAT_VERSION
    assert config.specheads_version == specheads.__version__
    assert config.model_type == "specheads"


def test_every_field_has_one_line_of_help():
    """Every constructor field has exactly one line of help in FIELD_HELP (and nothing else does)."""
    fields = {
        name
        for name, p in inspect.signature(HeadsConfig.__init__).parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    assert set(FIELD_HELP) == fields
    assert all(text.strip() and "\n" not in text for text in FIELD_HELP.values())


@pytest.mark.parametrize("field", POSITIVE_INT_FIELDS)
@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True])
def test_positive_int_fields_reject_bad_values(field, value):
    """0, -1, floats, strings and bools are rejected with a ValueError naming the field and the value."""
    with pytest.raises(ValueError, match=rf"HeadsConfig\.{field}={value!r}") as err:
        HeadsConfig(**{field: value})
    assert "positive integer" in str(err.value)


@settings(max_examples=25, deadline=None)
@given(field=st.sampled_from(POSITIVE_INT_FIELDS), value=st.integers(min_value=1, max_value=10**6))
def test_positive_int_fields_accept_positive_ints(field, value):
    """Any positive integer is accepted and stored as given."""
    assert getattr(HeadsConfig(**{field: value}), field) == value


def test_unknown_head_type_names_the_field_and_known_types():
    """An unknown head type names `head_type` and lists the registered types."""
    with pytest.raises(ValueError, match="head_type") as err:
        HeadsConfig(head_type="nope")
    for name in HEAD_TYPES:
        assert name in str(err.value)


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, "1", None])
def test_format_version_must_be_readable(version):
    """A format version from a newer specheads (or not an int) is rejected, naming `format_version`."""
    with pytest.raises(ValueError, match="format_version"):
        HeadsConfig(format_version=version)


@pytest.mark.parametrize("layers", [[-1], [0, -3], ["1"]])
def test_feature_layers_must_be_non_negative_indices(layers):
    """Negative or non-integer feature layers are rejected, naming `feature_layers`."""
    with pytest.raises(ValueError, match="feature_layers"):
        HeadsConfig(feature_layers=layers)


def test_eagle_needs_a_draft_layer_config():
    """EAGLE heads cannot be built without the target family's layer config."""
    with pytest.raises(ValueError, match="draft_layer_config"):
        HeadsConfig(head_type="eagle")
    assert HeadsConfig(head_type="eagle", draft_layer_config=EAGLE_LAYER).draft_layer_config == EAGLE_LAYER


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(parallel_depth=1), "parallel_depth=1 is invalid; expected 0 .off. or an integer >= 2"),
        (dict(parallel_depth=-2), "parallel_depth=-2 is invalid"),
        (dict(parallel_depth=True), "parallel_depth=True is invalid"),
        (dict(head_type="eagle", parallel_depth=3), "parallel_depth=3 is set for head_type='eagle'"),
        (dict(parallel_depth=3, parallel_slot_token=512), r"parallel_slot_token=512 is invalid; expected a token id in \[0, "
         "vocab_size=512\\)"),
    ],
)
def test_parallel_drafting_fields_name_the_bad_value(fields, message):
    with pytest.raises(ValueError, match=message):
        HeadsConfig(**{"head_type": "eagle3", "draft_layer_config": EAGLE_LAYER, "feature_layers": [1, 2], **fields})
    assert HeadsConfig(head_type="eagle3", draft_layer_config=EAGLE_LAYER, feature_layers=[1, 2],
                       parallel_depth=3, parallel_slot_token=511).parallel_depth == 3


def test_unknown_keys_are_dropped_with_a_warning(caplog):
    """Keys from a newer specheads are dropped (forward compatible) and the warning names them."""
    with caplog.at_level(logging.WARNING):
        config = HeadsConfig(future_option=3, hidden_size=32)
    assert "future_option" in caplog.text
    assert not hasattr(config, "future_option")
    assert "future_option" not in config.to_dict()
    assert config.hidden_size == 32


def _round_trip_dict(config: HeadsConfig) -> dict:
    """to_dict without the fields that legitimately differ between writers."""
    data = config.to_dict()
    data.pop("transformers_version", None)
    return data


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"head_type": "medusa", "num_heads": 3, "num_layers": 2, "static_tree": "medusa_small"},
        {
            "head_type": "eagle",
            "draft_layer_config": EAGLE_LAYER,
            "target_name_or_path": "org/target",
            "target_architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "vocab_size": 97,
            "feature_layers": [2],
            "tree_depth": 4,
            "tree_top_k": 3,
            "tree_num_nodes": 12,
        },
    ],
)
def test_to_dict_from_dict_round_trip(fields, tmp_path):
    """to_dict -> from_dict and save_pretrained -> from_pretrained reproduce the config exactly."""
    config = HeadsConfig(**fields)
    for key, value in fields.items():
        assert getattr(config, key) == value
    again = HeadsConfig.from_dict(config.to_dict())
    assert _round_trip_dict(again) == _round_trip_dict(config)
    config.save_pretrained(tmp_path)
    assert _round_trip_dict(HeadsConfig.from_pretrained(tmp_path)) == _round_trip_dict(config)


def test_from_dict_validates():
    """Loading a dict goes through the same validation as the constructor."""
    data = HeadsConfig().to_dict()
    data["num_heads"] = -2
    with pytest.raises(ValueError, match="num_heads"):
        HeadsConfig.from_dict(data)


@pytest.mark.parametrize("field", ["tree_stop_prob", "tree_min_prob"])
@pytest.mark.parametrize("value", [-0.1, 1.0, "0.5", True])
def test_tree_probabilities_must_be_in_0_1(field, value):
    with pytest.raises(ValueError, match=rf"HeadsConfig\.{field}={value!r}; expected a probability in \[0, 1\)"):
        HeadsConfig(**{field: value})
    assert getattr(HeadsConfig(**{field: 0.25}), field) == 0.25


def test_cpu_tree_replaces_the_tree_fields_on_cpus_only(tmp_path):
    """`cpu_tree` holds the fields of a CPU's default tree; `tree_defaults` gives them on "cpu" and the others
    elsewhere; the field survives a save and load."""
    small = {"tree_depth": 4, "tree_top_k": 4, "tree_num_nodes": 8, "tree_stop_prob": 0.2, "tree_min_prob": 0.03}
    config = HeadsConfig(tree_depth=5, tree_top_k=8, tree_num_nodes=24, cpu_tree=small)
    assert config.tree_defaults("cpu") == {**small, "static_tree": "medusa_default"}
    assert config.tree_defaults("cuda") == {"tree_depth": 5, "tree_top_k": 8, "tree_num_nodes": 24,
                                            "tree_stop_prob": 0.0, "tree_min_prob": 0.0, "static_tree": "medusa_default"}
    partial = HeadsConfig(tree_num_nodes=24, cpu_tree={"tree_num_nodes": 10})  # the rest from the tree_* fields
    assert partial.tree_defaults("cpu")["tree_num_nodes"] == 10 and partial.tree_defaults("cpu")["tree_depth"] == 6
    assert HeadsConfig().cpu_tree == {} and HeadsConfig().tree_defaults("cpu") == HeadsConfig().tree_defaults("cuda")
    config.save_pretrained(tmp_path)
    assert HeadsConfig.from_pretrained(tmp_path).cpu_tree == small


@pytest.mark.parametrize("cpu_tree, message", [
    ({"tree_width": 4}, r"HeadsConfig\.cpu_tree=\{'tree_width': 4\} is invalid \(unknown keys \['tree_width'\]\)"),
    ([4, 4, 8], r"HeadsConfig\.cpu_tree=\[4, 4, 8\] is invalid; expected a dict of some of tree_depth"),
    ({"tree_num_nodes": 0}, r"HeadsConfig\.cpu_tree\['tree_num_nodes'\]=0 is invalid; expected a positive integer"),
    ({"tree_min_prob": 1.5}, r"HeadsConfig\.cpu_tree\['tree_min_prob'\]=1\.5; expected a probability in \[0, 1\)"),
    ({"static_tree": ""}, r"HeadsConfig\.cpu_tree\['static_tree'\]='' is invalid; expected a tree name or path"),
])
def test_a_bad_cpu_tree_is_refused_by_name(cpu_tree, message):
    with pytest.raises(ValueError, match=message):
        HeadsConfig(cpu_tree=cpu_tree)
