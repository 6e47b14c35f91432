"""Plain-torch references of the model's math: norms, RoPE, hyper-connections, QSA token selection and
sparse attention, the FP8 E4M3 codec.

The tests check ``model.ours`` and the Triton kernels of ``model.kernels`` against them, and
``model.ours`` runs them where no kernel applies (vLLM's CPU build). PLE's math is in ``model.ple``.
"""
