"""``model.upstream.optional_kernels``: upstream's CuTe-DSL HC kernel is kept off, not crashed
into, where its packages are missing, and off under ``QWEN4EXP_FORCE_SM86`` as on a 3090
(upstream's modules imported on the CPU build)."""

from __future__ import annotations

import pytest

from model.upstream import optional_kernels as K
from tests.upstream.importer import import_upstream

HC = import_upstream("vllm.models.qwen4_exp.nvidia.hyperconnection")
MODEL = import_upstream("vllm.models.qwen4_exp.nvidia.model")


@pytest.fixture
def restore(monkeypatch):
    """Upstream's originals come back after the test (the patch is process-wide)."""
    cls = HC.GatedResidual
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    monkeypatch.setattr(MODEL, "request_hc_down_silu_warmup", MODEL.request_hc_down_silu_warmup)
    monkeypatch.delattr(cls, K._PATCHED, raising=False)
    return cls


def test_nothing_changes_when_the_packages_are_there(restore):
    init = restore.__init__
    assert K.disable_cute_dsl_hc(missing=[]) is None
    assert restore.__init__ is init


def test_missing_packages_turn_the_kernel_off_and_its_warmup(restore, monkeypatch, caplog):
    def upstream_like_init(self, *args, **kwargs):
        self._use_hc_down_silu = True  # what upstream decides on sm_90+

    monkeypatch.setattr(restore, "__init__", upstream_like_init)
    monkeypatch.setattr(K.inspect, "getsource", lambda obj: "self._use_hc_down_silu = (")
    with caplog.at_level("WARNING"):
        note = K.disable_cute_dsl_hc(missing=["quack"])
    assert note and "quack not installed" in note and note in caplog.text
    layer = object.__new__(restore)
    layer.__init__()
    assert layer._use_hc_down_silu is False
    assert MODEL.request_hc_down_silu_warmup(None) is None  # a no-op now
    K.disable_cute_dsl_hc(missing=["quack"])  # idempotent: not wrapped twice
    assert restore.__init__.__name__ == "init_without_cute_dsl"
    assert restore.__init__.__closure__[0].cell_contents is upstream_like_init


def test_forcing_the_3090s_choices_turns_the_kernel_off_with_the_packages_there(restore, monkeypatch, caplog):
    def upstream_like_init(self, *args, **kwargs):
        self._use_hc_down_silu = True  # what upstream decides on sm_90+; a 3090 decides False

    monkeypatch.setattr(restore, "__init__", upstream_like_init)
    monkeypatch.setattr(K.inspect, "getsource", lambda obj: "self._use_hc_down_silu = (")
    with caplog.at_level("WARNING"):
        note = K.disable_cute_dsl_hc(missing=[], force_sm86=True)
    assert note and "QWEN4EXP_FORCE_SM86" in note and "not installed" not in note
    layer = object.__new__(restore)
    layer.__init__()
    assert layer._use_hc_down_silu is False


@pytest.mark.parametrize("force_sm86", [False, True])
@pytest.mark.parametrize(("short_prefill", "reference_rounding"), [(True, True), (False, False)])
def test_the_deployment_decides_which_patches_apply(
    monkeypatch, force_sm86, short_prefill, reference_rounding
):
    """The upstream subclasses install our patches from the deployment vLLM was given: the CuTe-DSL
    kernel off under the 3090 switch (not only without its packages), the optional ones per flag."""
    from dataclasses import replace

    from model.deployment.resolve import resolve
    from model.upstream import patches

    calls = []
    for module in (patches.qsa, patches.ple, patches.indexer_tiles, patches.gdn, patches.hc_mix):
        monkeypatch.setattr(
            module, "install", lambda name=module.__name__: calls.append(name.rsplit(".", 1)[1])
        )
    monkeypatch.setattr(
        patches.optional_kernels, "disable_cute_dsl_hc", lambda force_sm86: calls.append(("hc", force_sm86))
    )
    deployment = replace(
        resolve({}, cpu_build=False),
        force_sm86=force_sm86,
        gdn_short_prefill=short_prefill,
        hc_reference_rounding=reference_rounding,
    )
    patches.apply(deployment)
    optional = ["gdn", "hc_mix"] if short_prefill else []
    assert calls == ["qsa", "ple", ("hc", force_sm86), "indexer_tiles", *optional]


def test_upstream_still_sets_the_flag_the_patch_clears():
    """If upstream renames the flag, the patch would clear nothing; the module refuses that."""
    import inspect

    assert "self._use_hc_down_silu" in inspect.getsource(HC.GatedResidual.__init__)


def test_a_renamed_flag_is_refused(restore, monkeypatch):
    monkeypatch.setattr(K.inspect, "getsource", lambda obj: "def __init__(self): pass")
    with pytest.raises(RuntimeError, match="no longer sets _use_hc_down_silu"):
        K.disable_cute_dsl_hc(missing=["cutlass"])


# ---- graph breaks ---------------------------------------------------------------------------------


def _resolve(module: str, qualname: str):
    import importlib

    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


@pytest.fixture
def breaks(monkeypatch):
    """Set each of upstream's break-point functions to a plain or a wrapped stand-in."""
    import functools

    import vllm.compilation.breakable_cudagraph as B

    for module, _ in K.GRAPH_BREAKS:
        import_upstream(module)

    def use(enabled: bool, wrapped: set[str]) -> None:
        monkeypatch.setattr(B, "is_breakable_cudagraph_enabled", lambda: enabled)
        for module, qualname in K.GRAPH_BREAKS:
            owner, name = _resolve(module, qualname)

            def plain(*args, **kwargs):
                return None

            stand_in = functools.wraps(plain)(lambda *a, **k: None) if qualname in wrapped else plain
            monkeypatch.setattr(owner, name, stand_in)

    return use


def test_every_break_point_upstream_names_exists():
    for module, qualname in K.GRAPH_BREAKS:
        owner, name = _resolve(module, qualname)
        assert callable(getattr(owner, name)), (module, qualname)


def test_missing_graph_breaks_are_found_and_refused(breaks):
    names = {q for _, q in K.GRAPH_BREAKS}
    breaks(enabled=False, wrapped=set())
    assert K.missing_graph_breaks() == []  # no breakable graphs: nothing to miss
    breaks(enabled=True, wrapped=names)
    assert K.missing_graph_breaks() == []
    K.refuse_missing_graph_breaks()
    breaks(enabled=True, wrapped=names - {"Qwen4ExpQSAAttention._run_qsa"})
    assert K.missing_graph_breaks() == ["vllm.models.qwen4_exp.nvidia.qsa.Qwen4ExpQSAAttention._run_qsa"]
    with pytest.raises(ValueError, match=r"imported before it enabled them.*_run_qsa.*--enforce-eager"):
        K.refuse_missing_graph_breaks()


def test_raw_upstream_gets_breakable_graphs_first_and_is_refused_without_its_breaks(
    breaks, restore, monkeypatch
):
    """The benches' baseline (plugin off, upstream imported before ``LLM()``): breakable graphs
    are enabled before anything is imported, the 3090's HC path is applied, and an engine whose
    break points were lost at an earlier import is refused rather than timed."""
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    monkeypatch.setattr(K.inspect, "getsource", lambda obj: "self._use_hc_down_silu = (")
    names = {q for _, q in K.GRAPH_BREAKS}
    breaks(enabled=True, wrapped=names)
    with pytest.raises(ValueError, match="VLLM_USE_BREAKABLE_CUDAGRAPH=1"):
        K.prepare_upstream_without_plugin(graphs=True)  # the caller enables them before importing vLLM
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    note = K.prepare_upstream_without_plugin(graphs=True, force_sm86=True)
    assert note and "QWEN4EXP_FORCE_SM86" in note
    assert restore.__init__.__name__ == "init_without_cute_dsl"
    breaks(enabled=True, wrapped=names - {"Qwen4ExpPLELayer._short_conv"})
    with pytest.raises(ValueError, match="_short_conv"):
        K.prepare_upstream_without_plugin(graphs=True)


def test_raw_upstream_eager_leaves_breakable_graphs_alone(breaks, restore, monkeypatch):
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    breaks(enabled=False, wrapped=set())
    K.prepare_upstream_without_plugin(graphs=False)
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" not in K.os.environ
