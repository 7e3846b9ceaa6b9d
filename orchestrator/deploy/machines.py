"""Will a pod fit its machine: each platform's allocatable capacity of a machine type, and the machines the docs
name for each pool (the head's here; the workers' in orchestrator/cluster/node_kinds.py).

A pod is scheduled only where its requests fit what the kubelet leaves after its own reservations
("allocatable"), less what the node's DaemonSets request. GKE reserves, of CPU, 6% of the first core, 1% of the
second, 0.5% of the next two and 0.25% of every core above four; of memory, 25% of the first 4 GiB, 20% of the
next 4, 10% of the next 8, 6% of the next 112 and 2% above 128 GiB, plus a 100 MiB eviction threshold (GKE's
"Standard cluster architecture: node allocatable resources"). EKS's AMIs reserve the same CPU, and of memory
255 MiB plus 11 MiB per pod the node may run (110 here: the kubelet's default, which Karpenter and prefix
delegation use) plus the 100 MiB threshold; the kubelet also sees about 3% less memory than the instance's
nominal size (firmware and kernel). `DAEMONSETS` is what the platforms' node agents request (logging, metrics,
kube-proxy, the CNI, the CSI driver, NVIDIA's device plugin), rounded up.
"""

from __future__ import annotations

GIB = 2**30
DAEMONSETS = (0.5, 1.0)  # (CPUs, GiB) the node agents request on every node
KUBERAY_SIDECAR = (0.5, 0.5)  # the autoscaler container the operator adds to the head pod (autoscalerOptions)
# The head pool's machine per platform: on demand, no GPU, 8 vCPUs and 32 GiB (name, vCPUs, GiB).
HEAD_MACHINE = {"gke": ("e2-standard-8", 8, 32), "eks": ("m5.2xlarge", 8, 32), "eks-karpenter": ("m5.2xlarge", 8, 32)}


def _tiers(amount: float, tiers: list[tuple[float, float]], rest: float) -> float:
    """Reserved of `amount` where the first tiers' sizes are reserved at their rates and the rest at `rest`."""
    out, left = 0.0, amount
    for size, rate in tiers:
        take = min(left, size)
        out, left = out + take * rate, left - take
    return out + left * rest


def allocatable(platform: str, vcpus: int, memory_gib: float) -> tuple[float, float]:
    """(CPUs, GiB) a platform's kubelet leaves for pods on a machine of `vcpus` and `memory_gib`."""
    cpu = vcpus - _tiers(vcpus, [(1, 0.06), (1, 0.01), (2, 0.005)], 0.0025)
    if platform == "gke":
        mem = memory_gib - _tiers(memory_gib, [(4, 0.25), (4, 0.2), (8, 0.1), (112, 0.06)], 0.02) - 100 / 1024
    else:  # eks, eks-karpenter: the EKS AMIs' bootstrap
        mem = memory_gib * 0.97 - (255 + 11 * 110 + 100) / 1024
    return cpu, mem


def pod_fits(platform: str, vcpus: int, memory_gib: float, cpu: float, mem_gib: float) -> str | None:
    """None where a pod requesting `cpu` and `mem_gib` (its every container) fits the machine beside the node
    agents; else one line saying by how much it does not."""
    free_cpu, free_mem = allocatable(platform, vcpus, memory_gib)
    free_cpu, free_mem = free_cpu - DAEMONSETS[0], free_mem - DAEMONSETS[1]
    if cpu <= free_cpu and mem_gib <= free_mem:
        return None
    return (f"requests {cpu:g} CPUs and {mem_gib:g} GiB, and the machine leaves {free_cpu:.2f} CPUs and "
            f"{free_mem:.1f} GiB for pods beside the node agents")
