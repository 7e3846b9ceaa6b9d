"""What the nodes run and where it runs: the rendered AWS config driven through Ray's own `DockerCommandRunner`
(a recording process runner in place of ssh) logs in to a private ECR registry before Ray's `docker pull` and
hands the workers' GPUs to the container itself; every GPU type the renderer offers can run the torch build the
image pins (read from deploy/image/Dockerfile), or is refused naming the fix; and every rendered pod, with what
the operator adds, fits the machine the docs name for its pool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli.deploy import render_text
from orchestrator.cli.main import app
from orchestrator.deploy.fleet import NODE_KINDS

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
ECR_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/hetspot-node:0.1.0"


class Recorder:
    """Ray's process runner (subprocess's check_call / check_output), recording the commands instead of running
    them over ssh; answers what run_init asks of a fresh GPU host."""

    def __init__(self):
        self.calls: list[str] = []

    def _inner(self, cmd) -> str:
        text = " ".join(cmd) if isinstance(cmd, list) else cmd
        m = re.search(r"PYTHONWARNINGS=ignore && \((.*)\)'$", text)  # the command inside ssh and bash -c
        self.calls.append(m.group(1) if m else text)
        return self.calls[-1]

    def check_call(self, cmd, *args, **kwargs):
        self._inner(cmd)
        return 0

    def check_output(self, cmd, *args, **kwargs):
        inner = self._inner(cmd)
        if inner.startswith("command -v docker"):
            return b"/usr/bin/docker"
        if ".Config.Env" in inner:
            return b'["HOME=/home/ray"]'
        return b""


class Host:
    def external_ip(self, node_id):
        return "10.0.0.7"

    internal_ip = external_ip

    def is_terminated(self, node_id):
        return False


def node_start(config: dict, as_head: bool) -> list[str]:
    """What Ray's updater runs on a new node before `ray start`: the initialization commands on the host, then the
    docker runner's run_init (pull, then run the container), through Ray's own DockerCommandRunner."""
    from ray.autoscaler._private.command_runner import DockerCommandRunner

    rec = Recorder()
    runner = DockerCommandRunner(config["docker"], log_prefix="", node_id="i-0123", provider=Host(),
                                 auth_config=config["auth"], cluster_name=config["cluster_name"], process_runner=rec,
                                 use_internal_ip=True)
    for cmd in config.get("initialization_commands", []):
        runner.run(cmd, run_env="host")
    runner.run_init(as_head=as_head, file_mounts={}, sync_run_yet=True)
    return rec.calls


def _aws(**kw) -> dict:
    return next(yaml.safe_load_all(render_text("aws", **kw)))


def test_a_private_ecr_image_is_logged_in_to_before_rays_pull_and_a_public_one_is_pulled_as_it_is():
    calls = node_start(_aws(mix="l4:1", region="us-west-2", image=ECR_IMAGE), as_head=False)
    pull = next(i for i, c in enumerate(calls) if c == f"docker pull {ECR_IMAGE}")
    login = next(i for i, c in enumerate(calls) if "docker login" in c)
    assert login < pull, calls
    assert calls[login] == ("aws ecr get-login-password --region us-west-2 | docker login --username AWS "
                            "--password-stdin 123456789012.dkr.ecr.us-west-2.amazonaws.com")
    run = next(c for c in calls if c.startswith("docker run"))
    assert "--gpus all" in run and "--runtime=nvidia" not in run  # not left to Ray's reading of `docker info`
    head_run = next(c for c in node_start(_aws(mix="l4:1", image=ECR_IMAGE), as_head=True)
                    if c.startswith("docker run"))
    assert "--gpus" not in head_run  # the head has no GPU
    for public in ("rayproject/ray:2.60.0-py311-cu128", "public.ecr.aws/acme/hetspot-node:0.1.0",
                   "ghcr.io/acme/hetspot-node:0.1.0"):
        calls = node_start(_aws(mix="l4:1", image=public), as_head=False)
        assert not any("login" in c for c in calls) and f"docker pull {public}" in calls, calls


def test_the_image_runs_every_gpu_type_the_renderer_offers_or_the_type_is_refused_naming_the_fix():
    from orchestrator.deploy.image import COMPUTE_CAPABILITY, IMAGE_TORCH, TORCH_ARCHES, runs_on

    dockerfile = (ROOT / "deploy" / "image" / "Dockerfile").read_text()
    torch = re.search(r'"torch==([0-9.]+)"', dockerfile).group(1)
    build = re.search(r"ARG TORCH_INDEX=https://download\.pytorch\.org/whl/(cu\d+)", dockerfile).group(1)
    assert (torch, build) == IMAGE_TORCH, "deploy/image/Dockerfile's pins moved: update IMAGE_TORCH"
    assert build in TORCH_ARCHES
    runner = CliRunner()
    for gpu, kind in NODE_KINDS.items():
        assert gpu in COMPUTE_CAPABILITY, gpu
        mix = f"{gpu.lower()}:1"
        for cloud in ("aws", "kuberay"):
            if cloud == "kuberay" and kind.gke_accelerator is None:
                continue
            res = runner.invoke(app, ["deploy", "render", "--cloud", cloud, "--mix", mix])
            if runs_on(gpu):
                assert res.exit_code == 0, (gpu, cloud, res.output)
            else:
                text = " ".join(res.output.split())
                assert res.exit_code == 2 and "--torch-build cu126" in text and "Traceback" not in text, text
                again = runner.invoke(app, ["deploy", "render", "--cloud", cloud, "--mix", mix,
                                            "--torch-build", "cu126"])
                assert again.exit_code == 0, again.output
    assert not runs_on("V100-16GB") and runs_on("V100-16GB", "cu126")  # sm_70 left cu128 in torch 2.11
    assert runs_on("L4") and runs_on("L40S") and runs_on("T4")  # sm_89 runs sm_86 code; sm_75 is in the build


def _pod_requests(pod: dict, sidecar: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    def cpu(q: str) -> float:
        return float(q[:-1]) / 1000 if q.endswith("m") else float(q)

    def gib(q: str) -> float:
        return float(q[:-2]) / 1024 if q.endswith("Mi") else float(q[:-2])

    reqs = [c["resources"]["requests"] for c in pod["containers"]]
    return (sum(cpu(r["cpu"]) for r in reqs) + sidecar[0], sum(gib(r["memory"]) for r in reqs) + sidecar[1])


def test_every_rendered_pod_fits_the_machine_the_docs_name_for_its_pool():
    """The head with the operator's autoscaler sidecar fits the head pool's 8-vCPU machine, each worker its GPU
    machine, on every platform, beside the node agents; docs/deploy.md names the head's machine per platform."""
    from orchestrator.deploy.machines import HEAD_MACHINE, KUBERAY_SIDECAR, pod_fits

    clusters = [(p.name, d) for p in sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))
                for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "RayCluster"]
    everything = ",".join(f"{g.lower()}:1" for g, k in NODE_KINDS.items() if k.gke_accelerator)
    clusters += [(f"{p}-all", next(yaml.safe_load_all(render_text(
        "kuberay", mix=everything if p == "gke" else None, platform=p, torch_build="cu126"))))
        for p in ("gke", "eks", "eks-karpenter")]
    docs = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    for name, cluster in clusters:
        platform = "gke" if "gke" in name else "eks-karpenter" if "karpenter" in name else "eks"
        spec = cluster["spec"]
        sidecar = KUBERAY_SIDECAR if spec["enableInTreeAutoscaling"] else (0.0, 0.0)
        assert spec["autoscalerOptions"]["resources"]["requests"] == {"cpu": f"{int(KUBERAY_SIDECAR[0] * 1000)}m",
                                                                        "memory": f"{int(KUBERAY_SIDECAR[1] * 1024)}Mi"}
        machine, vcpus, gib = HEAD_MACHINE[platform]
        cpu, mem = _pod_requests(spec["headGroupSpec"]["template"]["spec"], sidecar)
        assert pod_fits(platform, vcpus, gib, cpu, mem) is None, (name, machine, pod_fits(platform, vcpus, gib,
                                                                                           cpu, mem))
        assert f"`{machine}`" in docs, f"docs/deploy.md names no {machine} for the head pool on {platform}"
        for group in spec["workerGroupSpecs"]:
            kind = NODE_KINDS[group["labels"]["hetspot/gpu-type"]]
            if platform == "gke":
                machine, vcpus, gb = kind.gke_machine
                gib = gb * 1e9 / 2**30
            else:
                machine, vcpus, gib = kind.instance_type, kind.num_cpus, kind.memory_gib
            cpu, mem = _pod_requests(group["template"]["spec"])
            assert pod_fits(platform, vcpus, gib, cpu, mem) is None, (name, machine, pod_fits(platform, vcpus, gib,
                                                                                               cpu, mem))


def test_the_old_head_did_not_fit_an_8_vcpu_machine():
    """What the check above catches: the head of 8 CPUs and 32 GiB, plus the sidecar, on e2-standard-8."""
    from orchestrator.deploy.machines import KUBERAY_SIDECAR, pod_fits

    problem = pod_fits("gke", 8, 32, 8 + KUBERAY_SIDECAR[0], 32 + KUBERAY_SIDECAR[1])
    assert problem and "leaves 7.41 CPUs" in problem, problem
