"""Parallelism on one device mesh: the mesh (dims.py), one plan per dimension composed by
one stream builder (template.py, streams.py), and `mode: mesh` (mode.py)."""

from extrapolators.modes.mesh.dims import DIMS, Layout, Mesh
from extrapolators.modes.mesh.mode import MeshMode
from extrapolators.modes.mesh.options import MeshOptions

__all__ = ["DIMS", "Layout", "Mesh", "MeshMode", "MeshOptions"]
