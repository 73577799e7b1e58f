"""Extrapolators: a single-GPU trace and a parallel plan become per-GPU task streams.

Three floors, lowest first (docs/architecture.md):
- `extrapolators.execution`: the tasks a GPU runs and the SimPy runtime that runs them
  (`Runtime`), its timeline log and the symmetry that lets one GPU stand for many;
- `extrapolators.communication`: how a collective becomes transfers (textbook algorithms,
  ring orders, NCCL's model), registered by name (`COMM_MODELS`, `comm_class`);
- `extrapolators.modes`: the parallelism modes (DDP, TP, pipelines, FSDP, hybrid, 3D, Hop),
  registered by name (`EXTRAPOLATORS`, `register`, `extrapolator_class`).

This face hands nothing on, so that importing the runtime or the communication model never
loads the modes above them.
"""
