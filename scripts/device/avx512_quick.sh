#!/usr/bin/env bash
# On a fresh lent GPU machine: vLLM CPU build checks on its AVX512-BF16/AMX CPU from the small bundle .gpu/mini/m.NN
# (no CUDA vLLM; it MUST hold nvidia_nccl_cu13: the CUDA torch 2.13 fails to import without it,
# 'undefined symbol: ncclCommResume', seen 2026-12-01): the GDN one-token unit test, planner vs vLLM, resilience, the quick-start service. Logs: $OUT/cpu2.
set -u; mkdir -p /tmp/mini && cat /tmp/asm/m.* | tar -x -C /tmp/mini && rm -f /tmp/asm/m.*
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/mini/whl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-cpu /tmp/mini/cpuwhl/*.whl 2>&1 | tail -2
ln -sfn /tmp/site /tmp/cpuview; rm -rf /tmp/proj; mkdir -p /tmp/proj; tar -xzf /tmp/mini/head.tar.gz -C /tmp/proj; cd /tmp/proj
source scripts/device/cpu_build_env.sh; export PYTHONUNBUFFERED=1; L=$OUT/cpu2; mkdir -p $L
python3 -c "import torch,vllm;from vllm.platforms import current_platform as p;print(torch.__version__,vllm.__version__,p.device_type,torch.cpu._is_avx512_bf16_supported())" > $L/host.txt 2>&1
t() { n=$1; c=$2; shift 2; taskset -c $c timeout 230 python3 -m pytest -q -rA -p no:cacheprovider "$@" > $L/$n.log 2>&1; echo "$n rc=$? $(tail -1 $L/$n.log)" >> $L/summary.txt; }
t gdn 0-3 tests/unit/test_gdn_one_token.py &
t planner 4-7 tests/deploy/test_planner_vs_vllm.py tests/deploy/test_cuda_preflight.py &
t resil 8-11 tests/service/test_resilience.py -k "one_token or failing_request" &
bash scripts/device/serve_smoke.sh $L 12-15 &
wait; cat $L/summary.txt $L/serve.txt $L/host.txt
