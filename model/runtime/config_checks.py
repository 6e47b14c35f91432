"""Start-up validation of a Qwen4-Exp text config, with messages that name the file and the fix.

transformers validates the architecture when it parses ``config.json``; these checks cover what
our implementation additionally relies on, so a bad checkpoint stops the engine before weights
are read instead of failing inside a forward pass.
"""

from __future__ import annotations


class Qwen4ExpConfigError(ValueError):
    pass


def validate_text_config(config, source: str = "config.json") -> None:
    where = f"{source}/config.json" if not str(source).endswith(".json") else str(source)

    def fail(field: str, problem: str, fix: str) -> None:
        raise Qwen4ExpConfigError(f"{where}: {field}: {problem}; {fix}")

    if config.indexer_n_heads is None:
        fail(
            "indexer_n_heads", "QSA is not configured", "this container serves Qwen4-Exp with QSA layers only"
        )
    if config.hc_count <= 1:
        fail("hc_count", f"must be > 1, got {config.hc_count}", "use the checkpoint's original config.json")
    if config.ple_layer_ids:
        eos = config.eos_token_id
        if eos is None or (isinstance(eos, list) and not eos):
            fail("eos_token_id", "PLE needs an EOS id to segment documents", "set eos_token_id")
    if config.linear_key_head_dim != config.linear_value_head_dim:
        fail(
            "linear_key_head_dim",
            f"{config.linear_key_head_dim} != linear_value_head_dim {config.linear_value_head_dim}",
            "vLLM's Gated DeltaNet kernels need equal key and value head dims",
        )
