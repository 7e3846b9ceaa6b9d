"""`hetspot deploy render`: spot-fleet configs for your GPU mix (registered as a sub-app by orchestrator/cli/main.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from orchestrator.deploy.fleet import DEFAULT_GKE_MIX, DEFAULT_MIX
from orchestrator.deploy.render import DEFAULT_IMAGE, DEFAULT_INSTALL

deploy_app = typer.Typer(no_args_is_help=True, help="Spot-fleet configs for Ray's AWS launcher and KubeRay.")


def render_command(cloud: str, mix: str, region: str, platform: str, install: str, image: str, rayjob: bool) -> str:
    """The command line that renders these options: the header of the file, and how to re-render it."""
    cmd = f"hetspot deploy render --cloud {cloud} --mix {mix}"
    if cloud == "aws":
        cmd += f" --region {region}" + (f" --install {install}" if install else "")
    else:
        cmd += f" --platform {platform}" + (f" --image {image}" if image != DEFAULT_IMAGE else "")
        cmd += " --rayjob" if rayjob else ""
    return cmd


def render_text(cloud: str, mix: str | None = None, region: str = "us-east-1", platform: str = "gke",
                install: str = DEFAULT_INSTALL, image: str = DEFAULT_IMAGE, rayjob: bool = False) -> str:
    from orchestrator.deploy.fleet import MixError
    from orchestrator.deploy.render import aws_config, kuberay_cluster, kuberay_job, to_yaml
    from orchestrator.errors import ConfigError

    try:
        if cloud == "aws":
            mix = mix or DEFAULT_MIX
            docs = aws_config(mix, region, install)
        elif cloud == "kuberay":
            mix = mix or (DEFAULT_GKE_MIX if platform == "gke" else DEFAULT_MIX)
            docs = [kuberay_cluster(mix, platform, image)] + (kuberay_job() if rayjob else [])
        else:
            raise ConfigError(f"--cloud {cloud!r} must be 'aws' or 'kuberay'")
    except MixError as e:
        raise ConfigError(str(e)) from None
    return to_yaml(docs, render_command(cloud, mix, region, platform, install, image, rayjob))


def render(
    cloud: str = typer.Option(..., "--cloud", help="aws (Ray cluster launcher YAML) or kuberay (RayCluster manifest)"),
    mix: str | None = typer.Option(None, "--mix", help="most worker nodes per GPU type, like 'a100:2,l4:4,t4:2' "
                                   f"(default {DEFAULT_MIX}; on GKE, which has no A10G, {DEFAULT_GKE_MIX})"),
    region: str = typer.Option("us-east-1", "--region", help="AWS region (aws only)"),
    platform: str = typer.Option("gke", "--platform", help="gke or eks: the spot node selectors (kuberay only)"),
    install: str = typer.Option(DEFAULT_INSTALL, "--install",
                                help="an extra pip requirement for the nodes (aws), e.g. a hetspot wheel to have the "
                                     "`hetspot` command on the head; jobs ship hetspot themselves"),
    image: str = typer.Option(DEFAULT_IMAGE, "--image", help="container image with hetspot (kuberay)"),
    rayjob: bool = typer.Option(False, "--rayjob", help="kuberay: add a RayJob whose entry point is hetspot's driver "
                                                        "(an example job; edit its runtimeEnvYAML)"),
    out: str | None = typer.Option(None, "--out", help="write to this file instead of standard output"),
) -> None:
    """Write a spot-fleet config for your GPU mix, from the same templates as the files in deploy/."""
    if out and not Path(out).resolve().parent.is_dir():
        from orchestrator.errors import ConfigError

        raise ConfigError(f"--out {out}: the directory {str(Path(out).parent)!r} does not exist; create it first "
                          "(nothing was written)")
    if out and Path(out).is_dir():
        from orchestrator.errors import ConfigError

        raise ConfigError(f"--out {out} is a directory; name the file to write, e.g. {Path(out) / 'cluster.yaml'}")
    text = render_text(cloud, mix, region, platform, install, image, rayjob)
    if out:
        Path(out).write_text(text)
        typer.echo(f"wrote {out}", err=True)
    else:
        sys.stdout.write(text)
