"""opfuse: pattern-aware operator fusion for Transformer inference.

    fused = opfuse.optimize(model, example_inputs)   # -> FusedModule (nn.Module)
    fused.report                                     # -> FusionReport
    opfuse.explain(model, example_inputs)            # report without rewriting
"""

__version__ = "0.1.0"

from .api import FusedModule, OptimizeError, explain, optimize  # noqa: E402
from .report.data import FusionReport  # noqa: E402

__all__ = ["FusedModule", "FusionReport", "OptimizeError", "explain", "optimize", "__version__"]
