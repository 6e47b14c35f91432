"""FP8 (E4M3) KV cache support for QSA layers: static scales, calibration, clip counting.

The RTX 3090 has no FP8 arithmetic, so a QSA layer with ``--kv-cache-dtype fp8`` stores K and V as
E4M3 *codes* (``uint8``) of ``value / scale`` and its attention widens them again (Triton kernel on
CUDA, plain torch on vLLM's CPU build). Everything about the scale lives here:

- ``settings``: the ``VLLM_QSA_KV_*`` environment variables and the cache-dtype choice, parsed and
  checked once at start-up so that a typo stops the server instead of silently changing numerics.
- ``sidecar``: the JSON file of per-layer static scales and its fail-closed validation, shared by
  the server and the merge CLI so both accept exactly the same files.
- ``ops``: the per-step device ops (encode, clip counting, running absmax). They never synchronise
  with the host and only add into preallocated tensors, so they keep working under CUDA graphs.
- ``state``: the per-layer module holding those device tensors (``QSAKVState``), nothing else.
- ``snapshot`` / ``runtime``: the process side, started once: a layer attaches itself after
  weight loading; the runtime registers it, exports its scale metric, logs it, and runs the
  background threads that read the counters off the device without blocking the compute stream
  and dump calibration statistics. ``runtime`` never imports ``state`` (no import cycle).
- ``merge``: ``python -m model.qsa_kv.merge`` turns calibration dumps of all ranks into a sidecar.
"""
