"""The GPU node kinds hetspot knows how to ask a cloud for: per GPU type its default instance (EC2, and GKE's machine
of the same GPU count), and the EC2 GPU instance sizes. Plain data, read by the capacity loop (Ray's name for a GPU
type) and by the deploy renderer (orchestrator/deploy/)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeKind:
    gpu_type: str  # the catalog's name
    instance_type: str  # EC2 (AWS, EKS)
    num_gpus: int
    num_cpus: int
    ray_accelerator: str  # what Ray itself detects: the accelerator_type:<T> resource
    gke_accelerator: str | None  # cloud.google.com/gke-accelerator, None where GKE has no such GPU
    memory_gib: int  # host memory of the instance
    gke_machine: tuple[str, int, int] | None = None  # GKE machine type of the same GPU count: (name, vCPUs, GB)

    @property
    def slug(self) -> str:
        return self.gpu_type.lower().replace("-", "")


# EC2 instance families per GPU type (AWS instance type pages: p5, p4d/p4de, g5, g6, g6e, g4dn, p3).
# GKE machine types (Compute Engine's GPU machine pages: A3 High, A2 Ultra, A2 High, G2; N1 with attached
# T4 and V100): the pod of a group is sized from these, not from the EC2 instance.
NODE_KINDS: dict[str, NodeKind] = {k.gpu_type: k for k in [
    NodeKind("H100-SXM", "p5.48xlarge", 8, 192, "H100", "nvidia-h100-80gb", 2048, ("a3-highgpu-8g", 208, 1872)),
    NodeKind("A100-80GB", "p4de.24xlarge", 8, 96, "A100", "nvidia-a100-80gb", 1152, ("a2-ultragpu-8g", 96, 1360)),
    NodeKind("A100-40GB", "p4d.24xlarge", 8, 96, "A100", "nvidia-tesla-a100", 1152, ("a2-highgpu-8g", 96, 680)),
    NodeKind("L40S", "g6e.12xlarge", 4, 48, "L40S", None, 384),
    NodeKind("A10G", "g5.12xlarge", 4, 48, "A10G", None, 192),
    NodeKind("L4", "g6.12xlarge", 4, 48, "L4", "nvidia-l4", 192, ("g2-standard-48", 48, 192)),
    NodeKind("T4", "g4dn.12xlarge", 4, 48, "T4", "nvidia-tesla-t4", 192, ("n1-standard-48", 48, 180)),
    NodeKind("V100-16GB", "p3.8xlarge", 4, 32, "V100", "nvidia-tesla-v100", 244, ("n1-standard-32", 32, 120)),
]}

# EC2 GPU instance sizes (AWS's instance type pages): name -> (GPU type, GPUs, vCPUs, GiB). A fleet chosen from a
# catalog, or a job's fleet types, render to exactly these instance types (`kinds_for_fleet`).
EC2_SIZES: dict[str, tuple[str, int, int, int]] = {
    "g4dn.xlarge": ("T4", 1, 4, 16), "g4dn.2xlarge": ("T4", 1, 8, 32), "g4dn.12xlarge": ("T4", 4, 48, 192),
    "g4dn.metal": ("T4", 8, 96, 384),
    "g5.xlarge": ("A10G", 1, 4, 16), "g5.2xlarge": ("A10G", 1, 8, 32), "g5.12xlarge": ("A10G", 4, 48, 192),
    "g5.48xlarge": ("A10G", 8, 192, 768),
    "g6.xlarge": ("L4", 1, 4, 16), "g6.2xlarge": ("L4", 1, 8, 32), "g6.12xlarge": ("L4", 4, 48, 192),
    "g6.48xlarge": ("L4", 8, 192, 768),
    "g6e.xlarge": ("L40S", 1, 4, 32), "g6e.12xlarge": ("L40S", 4, 48, 384), "g6e.48xlarge": ("L40S", 8, 192, 1536),
    "p3.2xlarge": ("V100-16GB", 1, 8, 61), "p3.8xlarge": ("V100-16GB", 4, 32, 244),
    "p3.16xlarge": ("V100-16GB", 8, 64, 488),
    "p4d.24xlarge": ("A100-40GB", 8, 96, 1152), "p4de.24xlarge": ("A100-80GB", 8, 96, 1152),
    "p5.48xlarge": ("H100-SXM", 8, 192, 2048),
}
