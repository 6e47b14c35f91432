"""Triton kernels of the QSA path: sparse paged GQA attention over BF16, E4M3 or E5M2 caches.

``model.ours.qsa_attention`` and ``model.upstream.qsa_glue`` launch it on CUDA;
``model.ops.qsa_sparse_attention`` is its plain-torch specification. PLE's gather kernel is in ``model.ple``.
"""
