"""Tests of canonical GPU names (`adapters/gpus.py`)."""

from __future__ import annotations

import pytest

from adapters.gpus import MODELS, canonical, memory_gb

SPEC_NAMES = ["T4", "L4", "A10", "A10G", "L40S", "V100-16GB", "V100-32GB", "A100-40GB",
              "A100-80GB", "H100-80GB", "H200-141GB", "B200", "MI300X"]


@pytest.mark.parametrize(("name", "memory", "want"), [
    # A100: GCP names, memory from the name or given, the 40 GB default
    ("nvidia-tesla-a100", None, "A100-40GB"),
    ("nvidia-tesla-a100", 40, "A100-40GB"),
    ("nvidia-a100-80gb", None, "A100-80GB"),
    ("A100", 80, "A100-80GB"),
    ("A100", 80.0, "A100-80GB"),
    ("A100", 40, "A100-40GB"),
    ("A100", None, "A100-40GB"),
    ("NVIDIA A100", 80, "A100-80GB"),
    ("A100 80GiB", None, "A100-80GB"),
    ("a100_80gb", None, "A100-80GB"),
    # A10 (Alibaba) and A10G (AWS) are different models
    ("NVIDIA A10", None, "A10"),
    ("A10", None, "A10"),
    ("A10G", None, "A10G"),
    ("NVIDIA A10G", None, "A10G"),
    ("nvidia-a10g", None, "A10G"),
    # T4 as each cloud spells it
    ("T4", None, "T4"),
    ("nvidia-tesla-t4", None, "T4"),
    ("Tesla T4", None, "T4"),
    ("NVIDIA Tesla T4", None, "T4"),
    ("NVIDIA T4", None, "T4"),
    ("nvidia-t4", None, "T4"),
    ("  t4 ", None, "T4"),
    # V100 in both sizes
    ("nvidia-tesla-v100", None, "V100-16GB"),
    ("V100", 16, "V100-16GB"),
    ("V100", 32, "V100-32GB"),
    ("Tesla V100", 32, "V100-32GB"),
    ("nvidia-tesla-v100", 32, "V100-32GB"),
    ("V100 32GB", None, "V100-32GB"),
    # H100, H200 and the rest
    ("H100", None, "H100-80GB"),
    ("H100", 80, "H100-80GB"),
    ("nvidia-h100-80gb", None, "H100-80GB"),
    ("NVIDIA H100", None, "H100-80GB"),
    ("nvidia-h200-141gb", None, "H200-141GB"),
    ("H200", 141, "H200-141GB"),
    ("nvidia-l4", None, "L4"),
    ("NVIDIA L40S", None, "L40S"),
    ("nvidia-b200", None, "B200"),
    ("AMD Instinct MI300X", None, "MI300X"),
])
def test_cloud_names_map_onto_canonical_ones(name: str, memory: float | None,
                                             want: str) -> None:
    assert canonical(name, memory) == (want, True)


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_canonical_names_map_onto_themselves(name: str) -> None:
    assert canonical(name) == (name, True)
    assert name in MODELS


@pytest.mark.parametrize("name", ["PPU", "nvidia-b300", "Radeon Pro V520", "K80",
                                  "Gaudi2", ""])
def test_unknown_models_are_kept_as_given_and_flagged(name: str) -> None:
    assert canonical(name) == (name, False)
    assert canonical(name, 96) == (name, False)


def test_memory_of_canonical_models() -> None:
    assert memory_gb("A100-80GB") == 80
    assert memory_gb("V100-16GB") == 16
    assert memory_gb("MI300X") == 192
    assert memory_gb("PPU") is None
    assert memory_gb("nvidia-tesla-t4") is None  # only canonical names


def test_model_names_match_their_memory() -> None:
    for name, model in MODELS.items():
        assert model.name == name
        if name.endswith("GB"):
            assert name.endswith(f"-{model.memory_gb:g}GB")


def test_gcp_h100_mega_is_h100_80gb() -> None:
    assert canonical("nvidia-h100-mega-80gb") == ("H100-80GB", True)
