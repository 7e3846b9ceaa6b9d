"""Spot-fleet configs: the fleet's makeup (fleet.py) and the renderers for Ray's AWS launcher and KubeRay
(render.py)."""
