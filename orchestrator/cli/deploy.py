"""`hetspot deploy render`: spot-fleet configs for your GPU mix (registered as a sub-app by
orchestrator/cli/main.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from orchestrator.deploy.fleet import DEFAULT_GKE_MIX, DEFAULT_MIX
from orchestrator.deploy.image import IMAGE_TORCH
from orchestrator.deploy.render import DEFAULT_AMI, DEFAULT_IMAGE

deploy_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="Spot-fleet configs for Ray's AWS launcher and KubeRay.")


def render_command(cloud: str, mix: str, region: str, platform: str, image: str, rayjob: bool,
                   ami: str = DEFAULT_AMI, grace_s: int | None = None, s3_secret: str | None = None,
                   fast_health_checks: bool = False, torch_build: str = IMAGE_TORCH[1]) -> str:
    """The command line that renders these options: the header of the file, and how to re-render it."""
    cmd = f"hetspot deploy render --cloud {cloud} --mix {mix}"
    if cloud == "aws":
        cmd += f" --region {region}" + (f" --ami {ami}" if ami != DEFAULT_AMI else "")
    else:
        cmd += f" --platform {platform}" + (f" --grace-s {grace_s}" if grace_s is not None else "")
        cmd += f" --s3-secret {s3_secret}" if s3_secret else ""
        cmd += " --rayjob" if rayjob else ""
    cmd += f" --image {image}" if image != DEFAULT_IMAGE else ""
    cmd += f" --torch-build {torch_build}" if torch_build != IMAGE_TORCH[1] else ""
    return cmd + (" --fast-health-checks" if fast_health_checks else "")


def kinds_for_fleet(job_file: str) -> tuple[list, str]:
    """The node kinds and counts a job's `fleet:` asks for (its types at max_nodes, or the fleet its `auto:` chooses
    from its catalog, instance type for instance type), and the same as a --mix string for the file's header.
    ConfigError (exit 2) when the job asks for nothing or no shipped node type serves a type."""
    from orchestrator.deploy.fleet import MixError, instance_kind, kind_for
    from orchestrator.errors import ConfigError
    from orchestrator.job_spec import load_job

    job = load_job(job_file)
    if job.fleet is None:
        raise ConfigError(f"--from-job {job_file}: the job has no fleet: section; render from a job that asks for "
                          "its GPUs, or give --mix")
    try:
        if job.fleet.auto is not None:
            from orchestrator.control.fleet_choice import choose
            from planner import PlanningError

            try:
                choice, _ = choose(job)
            except PlanningError as e:
                raise ConfigError(f"{job_file}: field 'fleet.auto': {e}") from None
            kinds = [(instance_kind(name), n) for name, n in choice.best.fleet]
        else:
            kinds = [(kind_for(t.gpu_type, t.gpus_per_node), t.max_nodes) for t in job.fleet.types]
    except MixError as e:
        raise ConfigError(f"--from-job {job_file}: {e}") from None
    return kinds, ",".join(f"{k.instance_type}:{n}" for k, n in kinds)


def render_text(cloud: str, mix: str | None = None, region: str = "us-east-1", platform: str = "gke",
                image: str = DEFAULT_IMAGE, rayjob: bool = False, ami: str = DEFAULT_AMI, grace_s: int | None = None,
                s3_secret: str | None = None, fast_health_checks: bool = False, from_job: str | None = None,
                torch_build: str = IMAGE_TORCH[1]) -> str:
    from orchestrator.deploy.fleet import MixError
    from orchestrator.deploy.render import aws_config, kuberay_cluster, kuberay_job, to_yaml
    from orchestrator.errors import ConfigError

    if from_job is not None and (cloud != "aws" or mix is not None):
        raise ConfigError("--from-job renders the AWS config of a job's fleet (--cloud aws, without --mix)")
    try:
        if from_job is not None:
            kinds, _ = kinds_for_fleet(from_job)
            docs = aws_config(kinds, region, image, ami=ami, fast_health_checks=fast_health_checks,
                              torch_build=torch_build)
            header = render_command(cloud, "", region, platform, image, rayjob, ami, grace_s, s3_secret,
                                    fast_health_checks, torch_build).replace(" --mix ", f" --from-job {from_job}", 1)
            return to_yaml(docs, header)
        if cloud == "aws":
            mix = mix or DEFAULT_MIX
            docs = aws_config(mix, region, image, ami=ami, fast_health_checks=fast_health_checks,
                              torch_build=torch_build)
        elif cloud == "kuberay":
            mix = mix or (DEFAULT_GKE_MIX if platform == "gke" else DEFAULT_MIX)
            docs = [kuberay_cluster(mix, platform, image, grace_s=grace_s, s3_secret=s3_secret,
                                    fast_health_checks=fast_health_checks, torch_build=torch_build)]
            docs += kuberay_job(platform=platform, grace_s=grace_s) if rayjob else []
        else:
            raise ConfigError(f"--cloud {cloud!r} must be 'aws' or 'kuberay'")
    except MixError as e:
        raise ConfigError(str(e)) from None
    return to_yaml(docs, render_command(cloud, mix, region, platform, image, rayjob, ami, grace_s, s3_secret,
                                        fast_health_checks, torch_build))


def render(
    cloud: str = typer.Option(..., "--cloud", help="aws (Ray cluster launcher YAML) or kuberay (RayCluster manifest)"),
    mix: str | None = typer.Option(None, "--mix", help="most worker nodes per GPU type, like 'a100:2,l4:4,t4:2' "
                                   f"(default {DEFAULT_MIX}; on GKE, which has no A10G, {DEFAULT_GKE_MIX})"),
    region: str = typer.Option("us-east-1", "--region", help="AWS region (aws only)"),
    platform: str = typer.Option("gke", "--platform", help="gke, eks (managed node groups) or eks-karpenter "
                                 "(Karpenter or EKS Auto Mode): the spot node selectors (kuberay only)"),
    image: str = typer.Option(DEFAULT_IMAGE, "--image", help="the node image built from deploy/image/Dockerfile and "
                              "pushed to your registry (every node runs it)"),
    ami: str = typer.Option(DEFAULT_AMI, "--ami", help="aws: the machine image (an ami-... id, or resolve:ssm:NAME); "
                            "the default is AWS's current Deep Learning Base GPU AMI by its public SSM parameter"),
    grace_s: int | None = typer.Option(None, "--grace-s", min=1, max=600, help="kuberay: seconds a spot pod gets "
                                       "after its notice (default: GKE 15, EKS 120); the job's drain deadline"),
    s3_secret: str | None = typer.Option(None, "--s3-secret", help="kuberay: a Secret with AWS_ACCESS_KEY_ID and "
                                         "AWS_SECRET_ACCESS_KEY for S3, instead of the `hetspot` service account"),
    fast_health_checks: bool = typer.Option(False, "--fast-health-checks", help="declare a lost node dead in about "
                                            "2 s instead of Ray's 14 s (measured on one host only)"),
    from_job: str | None = typer.Option(None, "--from-job", help="aws: render exactly the node types and counts the "
                                        "job's fleet: asks for (its types, or the fleet its auto: chooses)"),
    torch_build: str = typer.Option(IMAGE_TORCH[1], "--torch-build", help="the CUDA build of torch in --image "
                                    f"(deploy/image/Dockerfile's TORCH_INDEX; {IMAGE_TORCH[1]} there): a GPU type "
                                    "it has no kernels for is refused"),
    install: str | None = typer.Option(None, "--install", hidden=True),
    rayjob: bool = typer.Option(False, "--rayjob", help="kuberay: add a RayJob whose entry point is hetspot's driver "
                                                        "(an example job; edit its runtimeEnvYAML)"),
    out: str | None = typer.Option(None, "--out", help="write to this file instead of standard output"),
) -> None:
    """Write a spot-fleet config for your GPU mix, from the same templates as the files in deploy/."""
    from orchestrator.errors import ConfigError

    if install is not None:
        raise ConfigError("--install is gone: nodes no longer install anything at launch. Build the node image "
                          "(docker build -f deploy/image/Dockerfile .), push it, and pass --image REGISTRY/NAME:TAG")
    if out and not Path(out).resolve().parent.is_dir():
        raise ConfigError(f"--out {out}: the directory {str(Path(out).parent)!r} does not exist; create it first "
                          "(nothing was written)")
    if out and Path(out).is_dir():
        raise ConfigError(f"--out {out} is a directory; name the file to write, e.g. {Path(out) / 'cluster.yaml'}")
    text = render_text(cloud, mix, region, platform, image, rayjob, ami, grace_s, s3_secret, fast_health_checks,
                       from_job, torch_build)
    if out:
        Path(out).write_text(text)
        typer.echo(f"wrote {out}", err=True)
    else:
        sys.stdout.write(text)
