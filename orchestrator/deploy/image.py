"""What the node image can run and where it is pulled from: pure data, read by the renderer.

**GPUs the image runs on.** A CUDA kernel image runs on a GPU whose compute capability has the same major
version as one the build carries and a minor version at least as high (NVIDIA's binary compatibility rule: the
CUDA C++ Programming Guide, "Binary Compatibility"); torch's wheels carry no PTX for the oldest ones, so a GPU
older than every architecture in the build fails at its first kernel with "no kernel image is available for
execution on the device". The image (deploy/image/Dockerfile) installs `IMAGE_TORCH`; a test holds these
constants to the Dockerfile's pins, so the table cannot drift from the image.

**Where the image comes from.** A private ECR repository needs a login on every node before Ray's launcher runs
its bare `docker pull` (Ray's `DockerCommandRunner.run_init`; nothing in Ray logs in): `ecr_login` is the
launcher's `initialization_commands` step for that, its registry taken from the image's name. Any other image
(Docker Hub, ECR Public, GHCR) is pulled with no login.
"""

from __future__ import annotations

import re

# torch's own support matrix (pytorch/pytorch#172352, "Deprecate sm70 ... for CUDA 12.8 build in PyTorch 2.11",
# and RELEASE.md's "PyTorch CUDA support matrix"): the architectures of its Linux x86 wheels per CUDA build.
TORCH_ARCHES: dict[str, tuple[tuple[int, int], ...]] = {
    "cu126": ((5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (9, 0)),
    "cu128": ((7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0)),
    "cu130": ((7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0)),
}
IMAGE_TORCH = ("2.13.0", "cu128")  # deploy/image/Dockerfile: torch==2.13.0 from download.pytorch.org/whl/cu128

# Compute capability per catalog GPU type (NVIDIA's CUDA GPUs table, developer.nvidia.com/cuda-gpus); AMD's
# Instinct parts run ROCm builds, not this image.
COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "H100-SXM": (9, 0), "H100-PCIe": (9, 0), "H200": (9, 0), "A100-40GB": (8, 0), "A100-80GB": (8, 0),
    "A10G": (8, 6), "L4": (8, 9), "L40S": (8, 9), "RTX4090": (8, 9), "T4": (7, 5), "V100-16GB": (7, 0),
    "V100-32GB": (7, 0),
}


def runs_on(gpu_type: str, build: str = IMAGE_TORCH[1]) -> bool:
    """Whether torch's `build` wheels carry a kernel image this GPU type can run."""
    cc = COMPUTE_CAPABILITY.get(gpu_type)
    if cc is None:
        return False
    return any(major == cc[0] and minor <= cc[1] for major, minor in TORCH_ARCHES[build])


def image_problem(gpu_type: str, build: str = IMAGE_TORCH[1]) -> str | None:
    """One line naming why the image cannot run on this GPU type and the fix, or None where it can."""
    if runs_on(gpu_type, build):
        return None
    arches = ", ".join(f"sm_{a}{b}" for a, b in TORCH_ARCHES[build])
    cc = COMPUTE_CAPABILITY.get(gpu_type)
    if cc is None:
        return (f"{gpu_type} is not a CUDA GPU the node image runs on (its torch is a CUDA build): leave it out of "
                "the mix")
    fits = [b for b in TORCH_ARCHES if runs_on(gpu_type, b)]
    fix = (f"or build the image with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/{fits[0]} and render "
           f"with --torch-build {fits[0]}" if fits else "no torch build hetspot knows carries it")
    return (f"the node image's torch {IMAGE_TORCH[0]} ({build} wheels: {arches}) has no kernels for {gpu_type} "
            f"(sm_{cc[0]}{cc[1]}): its first CUDA call would fail with 'no kernel image is available'. Leave "
            f"{gpu_type.split('-')[0].lower()} out of the mix, {fix}")


_ECR = re.compile(r"(?P<registry>(?P<account>\d{12})\.dkr\.ecr(-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?)"
                  r"/[^\s]+")


def ecr_registry(image: str) -> tuple[str, str] | None:
    """(registry host, its region) for a private ECR image; None for any other (public) image."""
    m = _ECR.fullmatch(image)
    return (m.group("registry"), m.group("region")) if m else None


def ecr_login(image: str) -> list[str]:
    """The host commands that log Docker in to the image's private ECR registry before Ray pulls it (the node
    role may call ecr:GetAuthorizationToken and read the repository: deploy/aws/iam/); none for a public image.
    The AMI's AWS CLI takes the token with the instance profile's credentials (a token lasts 12 hours, and
    every new node runs this before its first pull)."""
    found = ecr_registry(image)
    if found is None:
        return []
    registry, region = found
    return [f"aws ecr get-login-password --region {region} | docker login --username AWS --password-stdin {registry}"]
