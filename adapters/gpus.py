"""Canonical GPU model names and the mapping of each cloud's names onto them.

A canonical name says the model and, where a model ships in several memory sizes, the
memory: `A100-40GB`, `A100-80GB`. Names the table does not know are kept as the cloud
spells them and flagged (`Offer.gpu_known = False`), never dropped.
"""

from __future__ import annotations

import re
from types import MappingProxyType

from broker.model import GPU_MODELS, GpuModel

__all__ = ["MODELS", "GpuModel", "canonical", "memory_gb"]


MODELS = GPU_MODELS
"""Every canonical model, by name (defined with the vocabulary in `broker.model`)."""

# Model families whose canonical name depends on memory: (family, [(max GB, name)...]).
_BY_MEMORY: MappingProxyType[str, tuple[tuple[float, str], ...]] = MappingProxyType({
    "V100": ((20, "V100-16GB"), (1e9, "V100-32GB")),
    "A100": ((48, "A100-40GB"), (1e9, "A100-80GB")),
    "H100": ((1e9, "H100-80GB"),),
    "H200": ((1e9, "H200-141GB"),),
})

_SUFFIX = re.compile(r"\s(\d+)\s?GI?B$")


_VARIANTS = frozenset({"MEGA", "SXM", "SXM4", "SXM5", "PCIE", "NVL", "HGX"})


def _split(name: str) -> tuple[str, float | None]:
    """`nvidia-a100-80gb` -> (`A100`, 80.0); `NVIDIA Tesla T4` -> (`T4`, None)."""
    n = " ".join(name.strip().upper().replace("_", " ").replace("-", " ").split())
    for prefix in ("NVIDIA ", "TESLA ", "AMD ", "INSTINCT "):
        while n.startswith(prefix):
            n = n[len(prefix):]
    size: float | None = None
    m = _SUFFIX.search(n)
    if m:
        size = float(m.group(1))
        n = n[: m.start()]
    # Form-factor and platform variants are the same GPU (GCP's a3-megagpu is
    # `nvidia-h100-mega-80gb`).
    words = [w for w in n.split() if w not in _VARIANTS]
    return "".join(words), size


def canonical(name: str, memory_gb: float | None = None) -> tuple[str, bool]:
    """Map a cloud's GPU name (and, if known, its memory per GPU) onto a canonical name.

    Returns `(name, known)`; unknown models come back as given, with `known=False`.
    `memory_gb` decides between memory variants; without it the smallest variant is
    assumed unless the name carries the size (`A100-80GB`, `nvidia-a100-80gb`).
    """
    if name in MODELS:
        return name, True
    fam, size = _split(name)
    mem = memory_gb if memory_gb is not None else size
    if fam in _BY_MEMORY:
        for limit, canon in _BY_MEMORY[fam]:
            if (mem or 0.0) <= limit:
                return canon, True
    for model in MODELS.values():
        if _split(model.name)[0] == fam:
            return model.name, True
    return name, False


def memory_gb(name: str) -> float | None:
    """GPU memory of a canonical model, or None for a name the table does not know."""
    model = MODELS.get(name)
    return model.memory_gb if model else None
