"""What a run returns: `Result` (iteration time, per-GPU timelines, breakdowns and their
exports), the memory model per GPU, and the figures."""

from triosim.results.result import Result

__all__ = ["Result"]
