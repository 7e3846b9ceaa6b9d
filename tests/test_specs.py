"""Specs, catalog and job file: validation, presets, round trips."""

import json

import pytest
import yaml
from pydantic import ValidationError

from orchestrator.errors import ConfigError
from orchestrator.job_spec import load_job, parse_job
from planner import PRESETS, ClusterSpec, ModelSpec, NodeSpec, TrainSpec
from planner.catalog import CATALOG, canonical_gpu_type

pytestmark = pytest.mark.unit


def test_catalog_covers_required_types_with_all_figures():
    required = {"H100-SXM", "H100-PCIe", "H200", "A100-40GB", "A100-80GB", "A10G", "L4", "L40S", "T4",
                "V100-16GB", "V100-32GB", "RTX4090", "MI250", "MI300X"}
    assert required <= set(CATALOG)
    for g in CATALOG.values():
        assert g.peak_tflops > 0 and g.mem_gib > 0 and g.mem_bw_gb_s > 0 and g.host_link_gb_s > 0
    assert {g.vendor for g in CATALOG.values()} == {"nvidia", "amd"}


def test_gpu_type_aliases_and_unknown():
    assert canonical_gpu_type("a100-80gb") == "A100-80GB"
    assert canonical_gpu_type("H100") == "H100-SXM"
    with pytest.raises(ValueError, match="known types"):
        canonical_gpu_type("B200X")


def test_specs_round_trip_json_and_yaml():
    cluster = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="L4", num_gpus=4, price_per_hour=1.2, zone="z")],
                          calibration={"L4": 0.4})
    for obj in [cluster, ModelSpec.preset("7b"), TrainSpec(global_batch=8)]:
        assert type(obj).model_validate_json(obj.model_dump_json()) == obj
        assert type(obj).model_validate(yaml.safe_load(yaml.safe_dump(json.loads(obj.model_dump_json())))) == obj


def test_presets_span_tiny_to_70b():
    assert PRESETS["tiny"].num_params < 1e6
    assert 6e9 < PRESETS["7b"].num_params < 7.5e9
    assert 12e9 < PRESETS["13b"].num_params < 14e9
    assert 65e9 < PRESETS["70b"].num_params < 72e9


def test_extra_fields_forbidden_and_bad_values():
    with pytest.raises(ValidationError, match="Extra inputs"):
        NodeSpec(name="a", gpu_type="L4", num_gpus=1, gpus=2)
    with pytest.raises(ValidationError, match="divisible"):
        ModelSpec(num_layers=2, hidden_size=30, num_heads=4, vocab_size=10, seq_len=8)
    with pytest.raises(ValidationError, match="duplicate node name"):
        ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="L4", num_gpus=1)] * 2)


GOOD = {"model": {"preset": "tiny"}, "train": {"global_batch": 8},
        "cluster": {"nodes": [{"name": "n0", "gpu_type": "T4", "num_gpus": 2}]}}


def test_job_file_typo_names_the_field():
    bad = json.loads(json.dumps(GOOD))
    bad["train"]["global_bach"] = 8
    with pytest.raises(ConfigError, match=r"train\.global_bach.*unknown field"):
        parse_job(bad, "job.yaml")


def test_job_file_unknown_gpu_type_lists_known():
    bad = json.loads(json.dumps(GOOD))
    bad["cluster"]["nodes"][0]["gpu_type"] = "Z100"
    with pytest.raises(ConfigError, match=r"cluster\.nodes\.0\.gpu_type.*unknown GPU type 'Z100'"):
        parse_job(bad, "job.yaml")


def test_job_file_preset_override_and_missing_file(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["model"]["num_layers"] = 6
    f = tmp_path / "j.yaml"
    f.write_text(yaml.safe_dump(data))
    assert load_job(f).model_spec.num_layers == 6
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "missing.yaml")
    f.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_job(f)


def test_a_copy_with_other_nodes_looks_up_its_own_nodes():
    one = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="L4", num_gpus=2, host_mem_gib=20)])
    assert one.node("a").host_mem == 20  # caches the lookup table
    other = one.model_copy(update={"nodes": [NodeSpec(name="a", gpu_type="L4", num_gpus=2, host_mem_gib=40)]})
    assert other.node("a").host_mem == 40 and one.node("a").host_mem == 20
