"""Our changes to vLLM's own CUDA Qwen4-Exp, installed at one moment: the first model construction.

Why then: every change here acts on what upstream builds or runs (the QSA attention class its
decoder layers construct, the PLE table class and method selector, kernel launchers, the GDN
short-prefill path, the hyper-connection gate mix), so installing at construction is early enough,
and nothing changes merely because a module was imported (vLLM's inspection subprocess imports
the model module to read class attributes). Which optional changes apply is the deployment's
decision (:class:`model.deployment.resolve.Deployment`), not an environment read here.
Idempotent: every vLLM worker constructs one model, a test process may construct several.
"""

from __future__ import annotations

from model.deployment.resolve import Deployment
from model.upstream import gdn, hc_mix, indexer_tiles, optional_kernels, ple, qsa


def apply(deployment: Deployment) -> None:
    """Install what ``deployment`` asks for, before upstream builds anything.

    Always: our FP8 QSA cache owner in upstream's decoder layers (:mod:`model.upstream.qsa`), our PLE
    table formats (:mod:`model.upstream.ple`), the indexer prefill tile sized for the GPU
    (:mod:`model.upstream.indexer_tiles`), and the hyper-connection kept off a CuTe-DSL kernel whose
    packages are missing or that a 3090 would not pick (:mod:`model.upstream.optional_kernels`).
    Per deployment: one-launch short GDN prefills (``gdn_short_prefill``) and the gate mix rounded
    as transformers rounds it (``hc_reference_rounding``)."""
    qsa.install()
    ple.install()
    optional_kernels.disable_cute_dsl_hc(force_sm86=deployment.force_sm86)
    indexer_tiles.install()
    if deployment.gdn_short_prefill:
        gdn.install()
    if deployment.hc_reference_rounding:
        hc_mix.install()
