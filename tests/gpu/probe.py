"""Functions run inside vLLM's worker on our model (``LLM.apply_model``) by the GPU tests and probes.

They live in an importable module (not a script's ``__main__``) so a worker in another process can
unpickle them. Captures are kept in a module global of the worker and returned as CPU tensors.
"""

from __future__ import annotations

_CAPTURE: dict = {}
_HANDLES: list = []


def describe(model) -> dict:
    """Facts about the running model: device, QSA cache shapes, kernel use, PLE storage."""
    from model.ours.ple_layer import NgramTable
    from model.ours.qsa_attention import QSACache

    out: dict = {"device": str(next(model.parameters()).device), "qsa": [], "ple": []}
    for name, mod in model.named_modules():
        if isinstance(mod, QSACache):
            out["qsa"].append(
                {
                    "name": name,
                    "kv_cache_shape": list(mod.kv_cache.shape),
                    "block_size_config": mod.block_size,
                    "use_kernel": mod.use_kernel,
                    "format": mod.kv_format,
                }
            )
        elif isinstance(mod, NgramTable):
            st = mod.storage
            out["ple"].append({"name": name, "mode": st.mode, "pinned_bytes": st.pinned_bytes()})
    return out


def set_qsa_kernel(model, enabled: bool) -> int:
    """Route every QSA layer's attention through the Triton kernel (True) or the torch reference."""
    from model.ours.qsa_attention import QSACache

    n = 0
    for mod in model.modules():
        if isinstance(mod, QSACache):
            if not hasattr(mod, "_kernel_ok"):
                mod._kernel_ok = mod.use_kernel
            mod.use_kernel = bool(enabled) and mod._kernel_ok
            n += 1
    return n


def install_capture(model, num_tokens: int) -> int:
    """Record, for any forward over exactly ``num_tokens`` tokens, every decoder layer's output
    streams and each sub-module's input and output (PLE, mixer, MoE), plus the QSA selections."""
    import model.ours.qsa_attention as qa

    remove_capture(model)
    _CAPTURE.clear()

    def record(key):
        def hook(mod, args, out):
            x = args[0]
            if x.shape[0] != num_tokens:
                return
            o = out[0] if isinstance(out, tuple) else out
            _CAPTURE[key + ".in"] = x.detach().float().cpu()
            _CAPTURE[key + ".out"] = o.detach().float().cpu()

        return hook

    layers = model.model.layers
    for i, layer in enumerate(layers):
        _HANDLES.append(layer.register_forward_hook(record(f"layer{i}")))
        for sub in ("ple", "linear_attn", "self_attn", "mlp"):
            m = getattr(layer, sub, None)
            if m is not None:
                _HANDLES.append(m.register_forward_hook(record(f"layer{i}.{sub}")))

    # The adapter calls select_tokens (CPU) or select_tokens_batched (CUDA): capture both.
    for name in ("select_tokens", "select_tokens_batched"):
        original = getattr(qa, name)

        def capturing(index_q, positions, block_keys, budget, ratio, _original=original):
            sel, count = _original(index_q, positions, block_keys, budget, ratio)
            if index_q.shape[0] == num_tokens:
                _CAPTURE.setdefault("selected", []).append((sel.cpu(), count.cpu()))
            return sel, count

        setattr(qa, name, capturing)
        _HANDLES.append((name, original))
    return len(_HANDLES)


def remove_capture(model) -> None:
    import model.ours.qsa_attention as qa

    while _HANDLES:
        h = _HANDLES.pop()
        if isinstance(h, tuple):
            setattr(qa, h[0], h[1])
        else:
            h.remove()


def fetch_capture(model) -> dict:
    out = dict(_CAPTURE)
    _CAPTURE.clear()
    return out
