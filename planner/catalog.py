"""Hardware catalog: peak figures for the GPU types hetspot plans over.

Each row gives peak dense bf16/fp16 tensor TFLOPS (no sparsity), memory, memory
bandwidth, the host link (PCIe) bandwidth per direction, and the intra-node
GPU-to-GPU bandwidth. Figures are vendor datasheet numbers; the comment on each
row names the datasheet. Calibrated efficiency factors (measured by the
orchestrator's profiling pass) override `default_efficiency` through
`ClusterSpec.calibration`.

Units: TFLOPS, GiB (vendor "GB" taken as GiB; the difference is inside the
memory reserve), GB/s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUInfo:
    name: str
    vendor: str
    peak_tflops: float  # dense bf16 (fp16 where the GPU has no bf16 tensor cores)
    mem_gib: float
    mem_bw_gb_s: float
    host_link_gb_s: float  # PCIe per direction
    intra_node_bw_gb_s: float  # NVLink / Infinity Fabric if present, else PCIe
    bf16: bool = True
    default_efficiency: float = 0.55  # fraction of peak a large GEMM-bound layer reaches


_PCIE3, _PCIE4, _PCIE5 = 16.0, 32.0, 64.0  # x16 per direction, PCI-SIG spec rates

# Fraction of peak a large GEMM-bound layer reaches: one set, used by the planner (`evaluate`, `plan`, the fleet
# choice, the simulator) and by the published-layout model (planner/at_scale.py) alike. H100 and A100 are fitted
# by bench/calibration.py on a training split of published runs priced in their own layouts (the efficiency that
# minimises the squared log error; tests/test_cost_at_scale.py fails if the fit moves off these by more than
# 0.005): H100 on the nine rows of Megatron-LM's H100 weak-scaling table (GPT 1.7B-462B, 48 to 6,144 GPUs; fit
# 0.5815), A100 on the six smallest rows of Megatron-LM's April 2021 A100 table (Narayanan et al. 2021, GPT
# 1.7B-76B, 32 to 1,024 GPUs; fit 0.5676). Held out and priced with them: Megatron-LM's GPT-3 175B strong scaling
# on 96 and 4,608 H100, Llama 3 405B on 8,192 and 16,384 H100, the 2021 table's four largest A100 runs (1,536 to
# 3,072 GPUs), and hetspot's own engine on one H200 (docs/benchmarks.md, "The cost model"). The H200 is the H100's
# chip with more memory bandwidth: it takes the H100's figure (its measured 54.2% MFU is a held-out check of it).
# V100s reach about 30% of peak (Megatron-LM 2019's single-GPU baseline, 39 TFLOPS; ZeRO-Offload's 10B at 40
# TFLOPS). Other types keep 0.55 (no published run checked); a profiling pass on a real cluster replaces any of
# these (ClusterSpec.calibration).
_EFF_H100, _EFF_A100, _EFF_V100 = 0.58, 0.57, 0.35
_EFF_H200 = _EFF_H100

CATALOG: dict[str, GPUInfo] = {
    g.name: g
    for g in [
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TF bf16 dense, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s
        GPUInfo("H100-SXM", "nvidia", 989.0, 80, 3350, _PCIE5, 900, default_efficiency=_EFF_H100),
        # same datasheet (PCIe): 756 TF bf16 dense, 80 GB HBM2e, 2.0 TB/s, NVLink bridge 600 GB/s
        GPUInfo("H100-PCIe", "nvidia", 756.0, 80, 2000, _PCIE5, 600, default_efficiency=_EFF_H100),
        # NVIDIA H200 datasheet (SXM): 989 TF bf16 dense, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s
        GPUInfo("H200", "nvidia", 989.0, 141, 4800, _PCIE5, 900, default_efficiency=_EFF_H200),
        # NVIDIA A100 datasheet (SXM4 40GB): 312 TF bf16 dense, 1.555 TB/s, NVLink 600 GB/s
        GPUInfo("A100-40GB", "nvidia", 312.0, 40, 1555, _PCIE4, 600, default_efficiency=_EFF_A100),
        # NVIDIA A100 datasheet (SXM4 80GB): 312 TF bf16 dense, 2.039 TB/s, NVLink 600 GB/s
        GPUInfo("A100-80GB", "nvidia", 312.0, 80, 2039, _PCIE4, 600, default_efficiency=_EFF_A100),
        # NVIDIA A10 datasheet: 125 TF bf16 dense, 24 GB GDDR6, 600 GB/s. A10G (AWS g5) is the
        # A10 at lower clocks; profiling calibrates it down.
        GPUInfo("A10G", "nvidia", 125.0, 24, 600, _PCIE4, _PCIE4),
        # NVIDIA L4 datasheet: 121 TF bf16 dense (242 sparse), 24 GB, 300 GB/s
        GPUInfo("L4", "nvidia", 121.0, 24, 300, _PCIE4, _PCIE4),
        # NVIDIA L40S datasheet: 362 TF bf16 dense (733 sparse), 48 GB, 864 GB/s
        GPUInfo("L40S", "nvidia", 362.0, 48, 864, _PCIE4, _PCIE4),
        # NVIDIA T4 datasheet: 65 TF fp16 mixed precision, 16 GB, 320 GB/s, PCIe Gen3; no bf16
        GPUInfo("T4", "nvidia", 65.0, 16, 320, _PCIE3, _PCIE3, bf16=False),
        # NVIDIA V100 datasheet (SXM2 16GB): 125 TF fp16 tensor, 900 GB/s, NVLink 300 GB/s; no bf16
        GPUInfo("V100-16GB", "nvidia", 125.0, 16, 900, _PCIE3, 300, bf16=False, default_efficiency=_EFF_V100),
        # NVIDIA V100 datasheet (SXM2 32GB): as above with 32 GB
        GPUInfo("V100-32GB", "nvidia", 125.0, 32, 900, _PCIE3, 300, bf16=False, default_efficiency=_EFF_V100),
        # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 165 TF bf16 dense with fp32
        # accumulate, 24 GB GDDR6X, 1008 GB/s, no NVLink
        GPUInfo("RTX4090", "nvidia", 165.0, 24, 1008, _PCIE4, _PCIE4),
        # AMD Instinct MI250 datasheet (OAM): 362 TF bf16, 128 GB HBM2e, 3.2 TB/s, Infinity Fabric
        GPUInfo("MI250", "amd", 362.0, 128, 3277, _PCIE4, 400),
        # AMD Instinct MI300X datasheet: 1307 TF bf16 dense, 192 GB HBM3, 5.3 TB/s, IF 896 GB/s
        GPUInfo("MI300X", "amd", 1307.0, 192, 5300, _PCIE5, 896),
    ]
}

# Aliases people type (and that EC2 / Ray report) mapped to catalog rows.
ALIASES: dict[str, str] = {
    "H100": "H100-SXM",
    "A100": "A100-40GB",
    "A100-40G": "A100-40GB",
    "A100-80G": "A100-80GB",
    "V100": "V100-16GB",
    "4090": "RTX4090",
    "RTX-4090": "RTX4090",
}


@functools.cache
def canonical_gpu_type(name: str) -> str:
    """Return the catalog key for `name` (case-insensitive, aliases allowed).

    Raises ValueError naming the known types when `name` is not in the catalog.
    """
    upper = {k.upper(): k for k in CATALOG}
    key = name.strip().upper()
    if key in upper:
        return upper[key]
    for alias, target in ALIASES.items():
        if alias.upper() == key:
            return target
    raise ValueError(
        f"unknown GPU type {name!r}; known types: {', '.join(sorted(CATALOG))}"
    )


def gpu_info(name: str) -> GPUInfo:
    return CATALOG[canonical_gpu_type(name)]


# Host memory per GPU when a node does not say (NodeSpec.host_mem_gib): the GPU's usual cloud instance,
# its memory over its GPUs (AWS instance-type pages): p5.48xlarge 2048 GiB / 8 H100, p4de/p4d 1152 / 8 A100,
# g5.12xlarge 192 / 4 A10G, g6.12xlarge 192 / 4 L4, g6e.12xlarge 384 / 4 L40S, g4dn.12xlarge 192 / 4 T4,
# p3.8xlarge 244 / 4 V100. Other types: 64 GiB per GPU.
HOST_MEM_GIB_PER_GPU = {"H100-SXM": 256.0, "H100-PCIe": 256.0, "H200": 256.0, "A100-40GB": 144.0,
                        "A100-80GB": 144.0, "A10G": 48.0, "L4": 48.0, "L40S": 96.0, "T4": 48.0,
                        "V100-16GB": 61.0, "V100-32GB": 61.0}


def default_host_mem_gib(gpu_type: str, num_gpus: int) -> float:
    return HOST_MEM_GIB_PER_GPU.get(gpu_type, 64.0) * num_gpus

