"""opfuse: pattern-aware operator fusion for Transformer inference.

    fused = opfuse.optimize(model, example_inputs)   # -> FusedModule (nn.Module)
    fused.report                                     # -> FusionReport
    opfuse.explain(model, example_inputs)            # report without rewriting
    opfuse.save(fused, "dir"); opfuse.load("dir")    # persist the plans; load needs no model
"""

__version__ = "0.1.0"

from .api import FusedModule, OptimizeError, explain, optimize  # noqa: E402
from .persist import LoadError, SaveError, load, save  # noqa: E402
from .report.data import FusionReport  # noqa: E402

__all__ = ["FusedModule", "FusionReport", "LoadError", "OptimizeError", "SaveError", "explain", "load", "optimize",
           "save", "__version__"]
